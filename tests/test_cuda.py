"""The exactness checks again, on a GPU: every decision on the device (verify/resident.py), one read per decision.

Skipped where no CUDA device exists. They need torch, transformers, tokenizers and pytest only (no scipy: the
chi-square p-values come from tests/laws.py), so they run from a checkout on a machine without network
(`scripts/device_check.sh`). Tiny float64 models keep block and single-token passes equal to rounding, so greedy
outputs compare token for token.
"""

import math
import warnings

import pytest
import torch

from host_reads import host_reads
from laws import ALPHA, exact_joint, pooled_pvalue, sample_counts
from tiny import ARCHITECTURES, tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig, decision_generator
from viasd.decode.plain import PlainDecoder
from viasd.decode.round import RoundPolicy
from viasd.decode.speculative import SpeculativeDecoder
from viasd.decode.tiered import TieredDecoder
from viasd.drafters.model_drafter import ModelDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.passes.session import KVSession, upload_ids
from viasd.verify.acceptance import residual_rows
from viasd.verify.gates import Gate
from viasd.verify.penalties import Penalties, penalised
from viasd.verify.resident import block_outcomes, first_rejection
from viasd.verify.sampling import SamplingParams, pick, soft_probs, warp_probs
from viasd.views.layer_skip import LayerMask

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here: the device path runs on CPU tensors in tests/test_resident.py",
)

PROMPT = [3, 4, 5, 6, 7, 3, 4, 5, 9, 12]
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)


def cuda(model):
    return model.to("cuda")


def test_logits_generators_and_decisions_stay_on_the_device():
    session = KVSession(cuda(tiny_model("llama")))
    logits = session.forward(PROMPT, keep=3)
    assert logits.device.type == "cuda" and logits.dtype == torch.float32
    assert decision_generator(SAMPLED, session.device).device.type == "cuda"
    assert pick(logits, SAMPLED, decision_generator(SAMPLED, session.device)).device.type == "cuda"


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampling"])
def test_the_device_side_maths_and_uploads_never_wait_for_the_device(params):
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(5, 64, device="cuda")
    logits[2, 3] = float("nan")
    draft = warp_probs(torch.randn(4, 60, device="cuda"), SamplingParams(temperature=1.0))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = upload_ids([1, 2, 3, 63], torch.device("cuda"))
        probs = warp_probs(logits, params)
        pick(logits, params, generator)
        first_rejection(block_outcomes(tokens, draft, logits, params, generator))
        block_outcomes(tokens, None, logits, params, generator)
        for signal in ("kl", "confidence"):
            Gate(signal).signals(soft_probs(logits[:4], params), draft, tokens)
        residual_rows(probs[:4], None, tokens)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_speculative_equals_plain(arch):
    target, tok = cuda(tiny_model(arch)), tiny_tokenizer(64)
    config = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(PROMPT, config).tokens
    drafters = {
        "small-model": ModelDrafter(cuda(tiny_model(arch, layers=2, seed=1))),
        "prompt-lookup": PromptLookupDrafter(),
        "self": ModelDrafter(target, LayerMask.skipping(4, [2]), name="self"),
    }
    for name, drafter in drafters.items():
        out = SpeculativeDecoder(target, tok, drafter, gamma=4).generate(PROMPT, config)
        assert out.tokens == plain, name
    lossless = TieredDecoder(
        target, tok, drafters["small-model"], [LayerMask.full(4)], RoundPolicy(Gate("kl", (-1.0, math.inf)), cap=8)
    )
    out = lossless.generate(PROMPT, config)
    assert out.tokens == plain and out.stats.unchecked_tokens > 0


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampling"])
def test_exact_via_equals_sd(params):
    target, tok = cuda(tiny_model("qwen2")), tiny_tokenizer(64)
    small = cuda(tiny_model("qwen2", layers=2, seed=1))
    config = GenerationConfig(
        max_new_tokens=40, ignore_eos=True, sampling=SamplingParams(**{**params.__dict__, "seed": 11})
    )
    sd = SpeculativeDecoder(target, tok, ModelDrafter(small), gamma=4).generate(PROMPT, config)
    via = TieredDecoder(
        target, tok, ModelDrafter(small), [LayerMask.skipping(4, [2])], RoundPolicy(Gate.exact(), gamma=4)
    )
    out = via.generate(PROMPT, config)
    assert out.tokens == sd.tokens and out.stats.target_calls == sd.stats.target_calls


def test_each_decision_reads_the_device_once(monkeypatch):
    target, tok = cuda(tiny_model("llama")), tiny_tokenizer(64)
    small = cuda(tiny_model("llama", layers=2, seed=1))
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True, sampling=SamplingParams(temperature=0.7, seed=5))
    with host_reads(monkeypatch) as reads:
        out = SpeculativeDecoder(target, tok, ModelDrafter(small), gamma=4).generate(PROMPT, config)
    assert len(reads.reads) == out.stats.rounds + out.stats.sources["model"].rounds
    policy = RoundPolicy(Gate("kl", (0.05, math.inf)), cap=6)
    with host_reads(monkeypatch) as reads:
        out = TieredDecoder(target, tok, ModelDrafter(small), [LayerMask.skipping(4, [1])], policy).generate(
            PROMPT, config
        )
    s = out.stats
    assert len(reads.reads) == s.sources["model"].rounds + s.slim_calls + s.target_calls - 1


def test_outside_model_passes_the_gpu_is_waited_for_at_most_once_per_decision(monkeypatch):
    """torch's sync debug mode warns at every CUDA synchronisation; model passes (transformers' own) are left
    out. What remains is viasd's: at most one per decision, the reads of test_each_decision_reads_the_device_once."""
    target, tok = cuda(tiny_model("llama")), tiny_tokenizer(64)
    small = cuda(tiny_model("llama", layers=2, seed=1))
    original = KVSession._run

    def unwatched(self, *args, **kwargs):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("warn")

    monkeypatch.setattr(KVSession, "_run", unwatched)
    policy = RoundPolicy(Gate("kl", (0.05, math.inf)), cap=6)
    decoders = {
        "sd": SpeculativeDecoder(target, tok, ModelDrafter(small), gamma=4),
        "via": TieredDecoder(target, tok, ModelDrafter(small), [LayerMask.skipping(4, [1])], policy),
        "plain": PlainDecoder(target, tok),
    }
    for params in (GREEDY, SAMPLED):
        config = GenerationConfig(
            max_new_tokens=24, ignore_eos=True, sampling=SamplingParams(**{**params.__dict__, "seed": 3})
        )
        for name, decoder in decoders.items():
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = decoder.generate(PROMPT, config)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            syncs = sum("synchroniz" in str(w.message) for w in caught)
            s = out.stats
            drafts = s.sources["model"].rounds if s.sources else 0
            decisions = s.new_tokens if name == "plain" else drafts + s.slim_calls + s.target_calls - int(name == "via")
            assert 0 < syncs <= decisions, (name, params, syncs, decisions)


def law_setup():
    vocab, length = 6, 3
    target = cuda(tiny_model("qwen2", vocab_size=vocab, init_scale=0.15))
    small = cuda(tiny_model("qwen2", vocab_size=vocab, layers=2, seed=5, init_scale=0.15))
    return vocab, length, target, small, tiny_tokenizer(vocab), [2, 3, 4]


def test_sd_sampling_follows_the_target():
    vocab, length, target, small, tok, prompt = law_setup()
    n = 1500
    decoder = SpeculativeDecoder(target, tok, ModelDrafter(small), gamma=2)
    counts, stats = sample_counts(decoder, prompt, SAMPLED, length, n)
    assert sum(s.evaluated - s.accepted for s in stats) > n // 10
    assert pooled_pvalue(exact_joint(target, prompt, SAMPLED, vocab, length), counts, n) > ALPHA


def test_a_slim_tier_that_is_the_target_samples_the_targets_law():
    vocab, length, target, small, tok, prompt = law_setup()
    params, n = SamplingParams(temperature=1.0), 1500
    via = TieredDecoder(
        target, tok, ModelDrafter(small), [LayerMask.full(4)], RoundPolicy(Gate("kl", (-1.0, math.inf)), gamma=2)
    )
    counts, stats = sample_counts(via, prompt, params, length, n)
    assert sum(s.tiers["slim"].rejected for s in stats) > n // 10
    assert pooled_pvalue(exact_joint(target, prompt, params, vocab, length), counts, n) > ALPHA


PENALTIES = Penalties(0.5, 0.3, 1.3, 6, ((3, 1.0), (9, -2.0)), prompt_length=len(PROMPT), ends=frozenset({1}))


def test_penalties_never_wait_for_the_device():
    """verify/penalties.py adjusts logits where they live: host ids are uploaded without a wait, device drafts are
    read there."""
    logits = torch.randn(5, 64, device="cuda")
    drafts = upload_ids([1, 2, 3, 63], torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = penalised(logits, PENALTIES, [*PROMPT, 5, 6], [1, 2, 3, 63])
        last = penalised(logits[-1:], PENALTIES, [*PROMPT, 5, 6], drafts)
        warp_probs(rows, SamplingParams(temperature=0.8, min_p=0.1))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(last[0], rows[-1])


def test_greedy_under_penalties_equals_plain_on_the_device():
    target, tok = cuda(tiny_model("llama")), tiny_tokenizer(64)
    sampling = SamplingParams(penalties=Penalties(0.5, 0.5, 1.3, bias=((8, 1.5),)))
    config = GenerationConfig(max_new_tokens=32, ignore_eos=True, sampling=sampling)
    plain = PlainDecoder(target, tok).generate(PROMPT, config).tokens
    assert (
        plain != PlainDecoder(target, tok).generate(PROMPT, GenerationConfig(max_new_tokens=32, ignore_eos=True)).tokens
    )
    for drafter in (ModelDrafter(cuda(tiny_model("llama", layers=2, seed=1))), ModelDrafter(target)):
        assert SpeculativeDecoder(target, tok, drafter, gamma=4).generate(PROMPT, config).tokens == plain
    lossless = TieredDecoder(
        target, tok, ModelDrafter(target), [LayerMask.full(4)], RoundPolicy(Gate("kl", (-1.0, math.inf)), cap=8)
    )
    assert lossless.generate(PROMPT, config).tokens == plain
