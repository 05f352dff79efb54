"""viasd's bf16 kernel for CPUs without bf16 matrix instructions (kernels/bf16.py, passes/bf16_linear.py)."""

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
from viasd.kernels import bf16
from viasd.kernels.build import Library
from viasd.passes import bf16_linear
from viasd.passes.bf16_linear import MAX_ROWS, CpuBf16Linear, use_bf16_kernel

needs_kernel = pytest.mark.skipif(not isinstance(bf16.kernel(), Library), reason=f"no bf16 kernel: {bf16.kernel()}")


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
    monkeypatch.setenv("VIASD_KERNELS", "-bf16")
    assert use_bf16_kernel(model) == 0 and not any(isinstance(m, CpuBf16Linear) for m in model.modules())
    monkeypatch.delenv("VIASD_KERNELS")
    monkeypatch.setattr(bf16_linear, "wanted", lambda: True)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert use_bf16_kernel(model) == linears > 0
    assert all(p is weights[name] for name, p in model.named_parameters())  # no copy, same names
    assert use_bf16_kernel(tiny_model("qwen2", dtype=torch.float32)) == 0  # not bf16: left to torch


@needs_kernel
def test_greedy_speculative_decoding_equals_plain_on_a_bf16_model_with_the_kernel(monkeypatch):
    monkeypatch.setattr(bf16_linear, "wanted", lambda: True)
    target = tiny_model("qwen2", dtype=torch.bfloat16)
    drafter = tiny_model("qwen2", layers=2, seed=1, dtype=torch.bfloat16)
    assert use_bf16_kernel(target) > 0 and use_bf16_kernel(drafter) > 0
    tok, config = tiny_tokenizer(64), GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(PROMPT, config)
    sd = SpeculativeDecoder(target, tok, ModelDrafter(drafter), gamma=4).generate(PROMPT, config)
    assert sd.tokens == plain.tokens
