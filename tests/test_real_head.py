"""The draft head shipped for the default target: found for it, and drafting drafts it keeps, exactly.

Runs the target's dense copy in fp32 (as test_real_pair.py does: there block and single-token passes round alike, so
greedy identity is exact); the head was trained on the gguf view's features, which the dense copy's resemble.
"""

import pytest

from viasd.decode.base import GenerationConfig
from viasd.engine import Engine, EngineSpec
from viasd.heads.file import load_head
from viasd.heads.find import SHIPPED
from viasd.views.recipe import DENSE

pytestmark = pytest.mark.real

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "List three uses of a binary search tree, one line each.",
]


def test_the_shipped_head_drafts_for_the_default_target_and_keeps_plain_greedy_output():
    engine = Engine(EngineSpec(dtype="fp32", device="cpu", quant=DENSE))
    shipped = [load_head(path) for path in sorted(SHIPPED.glob("*.safetensors"))]
    assert engine.draft_head().digest in {head.digest for head in shipped}  # the target's own head is shipped
    config = GenerationConfig(max_new_tokens=48)
    accepted = 0
    for prompt in PROMPTS:
        ids = engine.encode([{"role": "user", "content": prompt}])
        plain = engine.generate(ids, "plain", config)
        out = engine.generate(ids, "sd:drafter=head", config)
        assert out.tokens == plain.tokens, prompt
        accepted += out.stats.sources["head"].accepted
    # A head that kept nothing would be a second model's or a broken file: this one keeps about 0.6 per round.
    assert accepted >= 10
