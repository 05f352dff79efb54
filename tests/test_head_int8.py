"""A draft head computing in int8 (heads/int8.py) or another dtype: its codes are the nearest to its weights, its
scores follow its float head's, and speculative decoding with it stays exact (greedy tokens, sampling law)."""

from __future__ import annotations

import pytest
import torch

from helpers import Recording
from laws import ALPHA, exact_joint, pooled_pvalue
from test_drafts import SAMPLING, sample_counts
from test_head import PROMPT, random_head
from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.decode.speculative import SpeculativeDecoder
from viasd.drafters.head import HeadDrafter, head_compute
from viasd.heads.int8 import int8_weights
from viasd.kernels import w8a8

COMPUTES = ("int8", "bfloat16", "float32")


def test_int8_codes_are_the_nearest_to_each_weight_and_a_zero_group_stays_zero():
    torch.manual_seed(0)
    weight = torch.randn(40, 96) * torch.linspace(0.01, 3.0, 96)
    weight[3, 32:64] = 0.0  # a group of zeros: scale 0, no division by it
    weight[5, 7] = 50.0  # an outlier: the bound below holds per group, so it widens only its own group's step
    quantized = int8_weights(weight)
    back = w8a8.dequantize(quantized)
    step = weight.reshape(40, 3, 32).abs().amax(-1, keepdim=True) / 127
    assert torch.isfinite(back).all()
    assert ((back - weight).reshape(40, 3, 32).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(back[3, 32:64], torch.zeros(32))


def test_an_int8_head_scores_as_its_float_head():
    """Logits of a draft step from the int8 head stay within 2% (relative, L2) of the float32 head's."""
    target = tiny_model("qwen2")
    head = random_head(64, 64, scale=0.2)
    exact, int8 = HeadDrafter(head, target, compute="float32"), HeadDrafter(head, target, compute="int8")
    torch.manual_seed(1)
    with torch.inference_mode():
        for _ in range(20):
            state, token = torch.randn(64), int(torch.randint(64, ()))
            want = exact.logits(exact.head.step(state, exact.embed(token)))
            got = int8.logits(int8.head.step(state, int8.embed(token)))
            assert float((got - want).norm() / want.norm()) < 0.02


@pytest.mark.parametrize("compute", COMPUTES)
def test_greedy_with_a_head_equals_plain_whatever_it_computes_in(compute):
    target, tok = tiny_model("qwen2"), tiny_tokenizer(64)
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(PROMPT, config).tokens
    drafter = Recording(HeadDrafter(random_head(64, 64), target, compute=compute))
    out = SpeculativeDecoder(target, tok, drafter, gamma=5).generate(PROMPT, config)
    assert out.tokens == plain
    assert out.stats.sources["head"].drafted > 40


@pytest.mark.parametrize("params", SAMPLING[:1], ids=["t1"])
def test_sampling_with_an_int8_head_follows_the_target_distribution(params):
    """Chi-square against the exact law of the warped target (false-alarm rate ALPHA)."""
    vocab, length, n = 6, 3, 1500
    target = tiny_model("qwen2", vocab_size=vocab, init_scale=0.15)
    head = random_head(64, 5, seed=3, scale=0.3)
    decoder = SpeculativeDecoder(target, tiny_tokenizer(vocab), HeadDrafter(head, target, compute="int8"), gamma=2)
    counts, _ = sample_counts(decoder, [2, 3, 4, 2], params, length, n)
    assert pooled_pvalue(exact_joint(target, [2, 3, 4, 2], params, vocab, length), counts, n) > ALPHA


def test_the_default_is_int8_only_where_the_kernel_runs_and_the_shapes_fit(monkeypatch):
    cpu = torch.device("cpu")
    head = random_head(64, 64)
    monkeypatch.setenv("VIASD_KERNELS", "-w8a8")  # every kernel but the 8-bit one
    assert head_compute(cpu, torch.bfloat16, head, 64) in ("bfloat16", "float32")
    monkeypatch.delenv("VIASD_KERNELS")
    assert head_compute(cpu, torch.bfloat16, head, 48) != "int8"  # 48 inputs: not whole groups of 32
    if not isinstance(w8a8.kernel(), str):  # the kernel runs here
        assert head_compute(cpu, torch.bfloat16, head, 64) == "int8"
    assert head_compute(torch.device("meta"), torch.bfloat16, head, 64) == "bfloat16"  # not a CPU: as stored


def test_an_unknown_compute_is_refused_by_name():
    with pytest.raises(ValueError, match="'int4'"):
        HeadDrafter(random_head(64, 64), tiny_model("qwen2"), compute="int4")


def test_the_head_compute_option_reaches_the_drafter(monkeypatch, tmp_path):
    """`head_compute` is honoured (the drafter computes as named), and without it the machine's default holds."""
    from test_auto import engine
    from viasd.heads.file import save_head
    from viasd.heads.find import trained_head_path
    from viasd.models.fingerprint import model_fingerprint

    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path))
    built = engine()
    fingerprint = model_fingerprint(built.target.model)
    head = random_head(64, 64, dtype=torch.float32)
    save_head(trained_head_path(fingerprint), head, fingerprint, "v", {})
    for compute in COMPUTES:
        assert built.decoder(f"sd:drafter=head:head_compute={compute}").drafter.compute == compute
    hybrid = built.decoder("sd:drafter=lookup+head:head_compute=float32").drafter
    assert hybrid.model.compute == "float32"
    default = head_compute(torch.device("cpu"), torch.float32, head, 64)
    assert built.decoder("sd:drafter=head").drafter.compute == default


def test_int8_drafting_where_it_cannot_run_is_refused_in_one_line():
    """A hidden size that is not whole groups of 32 cannot take the 8-bit kernel's layout: a clear error, not a
    half-built drafter."""
    target = tiny_model("qwen2", hidden=48)
    with pytest.raises(ValueError, match="groups of 32"):
        HeadDrafter(random_head(48, 64), target, compute="int8")
    assert HeadDrafter(random_head(48, 64), target).compute != "int8"  # the default falls back by itself
