"""viasd's bf16 kernels: the widening one for CPUs without bf16 matrix instructions (kernels/bf16.py) and the
AVX-512 BF16 one (kernels/bf16_native.py), as bf16 Linear layers use them (kernels/bf16_linear.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import PROMPT
from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.decode.speculative import SpeculativeDecoder
from viasd.drafters.model_drafter import ModelDrafter
from viasd.engine import Engine, EngineSpec
from viasd.kernels import bf16, bf16_linear, bf16_native
from viasd.kernels.bf16_linear import (
    MAX_ROWS,
    NATIVE_BLOCK,
    NATIVE_MAX_ROWS,
    CpuBf16Linear,
    NativeBf16Linear,
    use_bf16_kernel,
)
from viasd.kernels.build import Library
from viasd.models.loading import LoadedModel
from viasd.views.recipe import QuantRecipe

needs_kernel = pytest.mark.skipif(not isinstance(bf16.kernel(), Library), reason=f"no bf16 kernel: {bf16.kernel()}")
needs_native = pytest.mark.skipif(
    not isinstance(bf16_native.kernel(), Library), reason=f"no AVX-512 BF16 kernel: {bf16_native.kernel()}"
)


def switched(layer: nn.Linear) -> nn.Linear:
    layer.__class__ = CpuBf16Linear
    return layer


@needs_kernel
def test_the_kernel_computes_the_bf16_product_and_a_tokens_bits_do_not_depend_on_its_block():
    torch.manual_seed(0)
    plain = nn.Linear(1000, 72).bfloat16()  # 1000 inputs: whole 16-input steps and a tail
    layer = switched(nn.Linear(1000, 72).bfloat16())
    layer.load_state_dict(plain.state_dict())
    x = torch.randn(1, MAX_ROWS, 1000).bfloat16()
    with torch.inference_mode():
        got = layer(x)
        exact = (x.double() @ plain.weight.double().T + plain.bias.double()).bfloat16()
        assert got.dtype == torch.bfloat16 and got.shape == (1, MAX_ROWS, 72)
        # Float32 sums rounded once to bf16: at most one bf16 step from the exact product.
        assert ((got.double() - exact.double()).abs() <= exact.double().abs() * 2**-7 + 1e-3).all()
        for rows in range(1, MAX_ROWS):
            assert torch.equal(layer(x[:, :rows]), got[:, :rows])
        # Longer passes (a prompt) are float32 products of the same weights, rounded once.
        long = torch.randn(1, MAX_ROWS + 3, 1000).bfloat16()
        widened = nn.functional.linear(long.float(), plain.weight.float(), plain.bias.float()).bfloat16()
        assert torch.equal(layer(long), widened)


def test_only_bf16_cpu_linear_layers_are_switched_and_keep_their_weights(monkeypatch):
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    weights = {name: p for name, p in model.named_parameters()}
    monkeypatch.setenv("VIASD_KERNELS", "-bf16,-bf16native")
    kernels = (CpuBf16Linear, NativeBf16Linear)
    assert use_bf16_kernel(model) == 0 and not any(isinstance(m, kernels) for m in model.modules())
    monkeypatch.delenv("VIASD_KERNELS")
    monkeypatch.setattr(bf16_linear, "native_wanted", lambda: False)
    monkeypatch.setattr(bf16_linear, "wanted", lambda: True)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert use_bf16_kernel(model) == linears > 0
    assert all(p is weights[name] for name, p in model.named_parameters())  # no copy, same names
    assert use_bf16_kernel(tiny_model("qwen2", dtype=torch.float32)) == 0  # not bf16: left to torch


@needs_kernel
def test_greedy_speculative_decoding_equals_plain_on_a_bf16_model_with_the_kernel(monkeypatch):
    monkeypatch.setattr(bf16_linear, "native_wanted", lambda: False)
    monkeypatch.setattr(bf16_linear, "wanted", lambda: True)
    target = tiny_model("qwen2", dtype=torch.bfloat16)
    drafter = tiny_model("qwen2", layers=2, seed=1, dtype=torch.bfloat16)
    assert use_bf16_kernel(target) > 0 and use_bf16_kernel(drafter) > 0
    tok, config = tiny_tokenizer(64), GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(PROMPT, config)
    sd = SpeculativeDecoder(target, tok, ModelDrafter(drafter), gamma=4).generate(PROMPT, config)
    assert sd.tokens == plain.tokens


@needs_native
def test_the_native_kernel_computes_the_bf16_product_and_a_tokens_bits_do_not_depend_on_its_block():
    torch.manual_seed(0)
    plain = nn.Linear(1000, 73).bfloat16()  # 1000 inputs: whole 32-input steps and a masked tail; 73: an odd row
    layer = nn.Linear(1000, 73).bfloat16()
    layer.__class__ = NativeBf16Linear
    layer.load_state_dict(plain.state_dict())
    x = torch.randn(1, NATIVE_MAX_ROWS, 1000).bfloat16()
    with torch.inference_mode():
        got = layer(x)
        exact = (x.double() @ plain.weight.double().T + plain.bias.double()).bfloat16()
        assert got.dtype == torch.bfloat16 and got.shape == (1, NATIVE_MAX_ROWS, 73)
        # Float32 sums rounded once to bf16: at most one bf16 step from the exact product.
        assert ((got.double() - exact.double()).abs() <= exact.double().abs() * 2**-7 + 1e-3).all()
        for rows in range(1, NATIVE_MAX_ROWS):
            assert torch.equal(layer(x[:, :rows]), got[:, :rows])
            assert torch.equal(layer(x[:, rows : rows + 1]), got[:, rows : rows + 1])  # any token, alone
        long = torch.randn(1, NATIVE_MAX_ROWS + 3, 1000).bfloat16()  # longer passes (a prompt): torch's product
        assert torch.equal(layer(long), plain(long))


def test_native_kernel_passes_its_own_check_wherever_the_cpu_has_avx512_bf16():
    """Its check (the float64 product, a token's bits in every block) runs at load and would silently hand the
    products back to torch: on a CPU with the instructions, a failed check is a failure here."""
    from viasd.kernels.build import library

    if any(flag not in bf16_native.cpu_flags() for flag in bf16_native.NEEDS) or not isinstance(library(), Library):
        pytest.skip("no AVX-512 BF16 here, or no kernel library")
    found = bf16_native.compiled()
    if isinstance(found, str) and "was not made by this compiler" in found:
        pytest.skip(found)  # a compiler older than AVX-512 BF16 (GCC < 10): a fact of the machine, said in one line
    assert isinstance(found, Library), found


def test_native_kernel_is_not_called_on_a_cpu_without_avx512_bf16(monkeypatch):
    from viasd.kernels.build import library

    if not isinstance(library(), Library):
        pytest.skip(f"no kernel library: {library()}")  # then that is the reason every kernel gives
    monkeypatch.setattr(bf16_native, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    reason = bf16_native.compiled.__wrapped__()
    assert reason == "not for this CPU (it lacks avx512f, avx512bw, avx512vl, avx512_bf16)"


@needs_native
def test_layers_switch_to_the_native_kernel_where_it_runs(monkeypatch):
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    monkeypatch.setattr(bf16_linear, "native_wanted", lambda: True)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert use_bf16_kernel(model) == linears > 0
    assert all(type(m) is NativeBf16Linear for m in model.modules() if isinstance(m, nn.Linear))


@needs_native
@pytest.mark.parametrize("gamma", [2, 5, NATIVE_BLOCK - 1])
def test_greedy_speculative_decoding_equals_plain_on_a_bf16_model_with_the_native_kernel(monkeypatch, gamma):
    monkeypatch.setattr(bf16_linear, "native_wanted", lambda: True)
    target = tiny_model("qwen2", dtype=torch.bfloat16)
    drafter = tiny_model("qwen2", layers=2, seed=1, dtype=torch.bfloat16)
    assert use_bf16_kernel(target) > 0 and use_bf16_kernel(drafter) > 0
    tok, config = tiny_tokenizer(64), GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(PROMPT, config)
    sd = SpeculativeDecoder(target, tok, ModelDrafter(drafter), gamma=gamma).generate(PROMPT, config)
    assert sd.tokens == plain.tokens


def test_speculation_over_the_native_kernel_drafts_one_fewer_than_its_block_unless_asked(monkeypatch):
    """A dense target on the native kernel verifies up to NATIVE_BLOCK tokens for about one step, so its
    speculative methods draft up to NATIVE_BLOCK - 1 per round; an asked gamma, and a target run as a quantized view
    (other passes, other costs), keep theirs."""
    monkeypatch.setattr(bf16_linear, "native_wanted", lambda: True)
    tok = tiny_tokenizer(64)

    def engine(native: bool, quant: QuantRecipe | str = "none") -> Engine:
        target = tiny_model("qwen2", dtype=torch.bfloat16)
        if native:
            use_bf16_kernel(target)
        small = LoadedModel(tiny_model("qwen2", layers=2, seed=1, dtype=torch.bfloat16), tok, "d", "d")
        spec = EngineSpec(target="t", drafter="d", device="cpu", quant=quant)
        return Engine(spec, target=LoadedModel(target, tok, "t", "t"), drafter=small)

    native = engine(True)
    assert [native.decoder(name).gamma for name in ("sd", "lookup", "sd:drafter=hybrid")] == [NATIVE_BLOCK - 1] * 3
    assert native.decoder("sd:gamma=3").gamma == 3
    assert engine(False).decoder("sd").gamma == 4
    assert engine(True, QuantRecipe.parse("int8")).decoder("sd").gamma == 4
