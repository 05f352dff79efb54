"""End to end on the real default pair (Qwen2.5-Coder 0.5B drafter -> 1.5B target).

Runs the target as loaded (its dense copy, not the default gguf view: --quant none) in fp32: in bf16 a block pass and
a single-token pass round differently, so about 1% of greedy argmaxes flip between plain decoding and any
block-verifying method (see README, "Exactness").
The first run fetches and converts both models (about 1.6 GB of downloads, 3 minutes).
"""

import pytest

from viasd.decode.base import GenerationConfig
from viasd.engine import Engine, EngineSpec
from viasd.views.recipe import DENSE

pytestmark = pytest.mark.real

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash map is in two sentences.",
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineSpec(dtype="fp32", device="cpu", quant=DENSE))


def test_classic_sd_reproduces_plain_greedy_on_the_real_pair(engine):
    config = GenerationConfig(max_new_tokens=40)
    accepted_per_call = []
    for prompt in PROMPTS:
        ids = engine.encode([{"role": "user", "content": prompt}])
        plain = engine.generate(ids, "plain", config)
        sd = engine.generate(ids, "sd", config)
        assert sd.tokens == plain.tokens, prompt
        assert sd.text == plain.text and len(plain.tokens) > 5
        accepted_per_call.append(sd.stats.tokens_per_target_call)
    # The 0.5B drafter agrees with the 1.5B target often: more than one token per target call on average.
    assert sum(accepted_per_call) / len(accepted_per_call) > 1.5


def test_adaptive_drafts_reproduce_plain_greedy_on_the_real_pair(engine):
    """The draft stop threshold and the hybrid drafter (copied and model drafts, and a generation too short for
    the model drafter) change what is drafted, never what is generated."""
    config = GenerationConfig(max_new_tokens=40)
    copying = "Repeat this sentence exactly, then say it once more: the quick brown fox jumps over the lazy dog."
    sources: set[str] = set()
    for prompt in [*PROMPTS, copying]:
        ids = engine.encode([{"role": "user", "content": prompt}])
        plain = engine.generate(ids, "plain", config).tokens
        for method in ("sd:stop=0", "sd:drafter=hybrid:budget=0", "sd:drafter=hybrid:budget=100"):
            out = engine.generate(ids, method, config)
            assert out.tokens == plain, (method, prompt)
            sources |= {f"{method} {name}" for name in out.stats.sources}
    assert {"sd:drafter=hybrid:budget=0 lookup", "sd:drafter=hybrid:budget=0 model"} <= sources, sources
    assert not any(s.startswith("sd:drafter=hybrid:budget=100 model") for s in sources)  # 40 < 100 x prompt
