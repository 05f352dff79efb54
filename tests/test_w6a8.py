"""A GGUF file's 6-bit (Q6_K) weights x int8 activations (models/w6a8.py, w6a8.c): the layout, the arithmetic, the
compiled builds, and the file's blocks read as the gguf library reads them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from helpers import random_q6k
from viasd.kernels import w4a8, w6a8
from viasd.kernels.build import BUILDS, Build, Library, load
from viasd.kernels.cpu import cpu_flags
from viasd.views.gguf import q6k_to_int6a8

Q6_K = gguf.GGMLQuantizationType.Q6_K


def exact_product(x: torch.Tensor, weights: w6a8.SixBitWeights) -> torch.Tensor:
    """The kernel's arithmetic in float64: activations rounded to 255 levels per token and group of 32, times the
    dequantized 6-bit weights."""
    codes, step = w4a8.activation_codes(x)
    rounded = (codes * step[..., None]).reshape(x.shape)
    return rounded.double() @ w6a8.dequantize(weights).double().T


def test_q6k_blocks_are_the_weights_the_gguf_library_reads_from_them():
    raw = random_q6k(24, 768, seed=0)
    six = q6k_to_int6a8(raw, 24, 768)
    want = torch.from_numpy(gguf_dequantize(raw, Q6_K).astype(np.float32))
    assert torch.equal(w6a8.dequantize(six), want)  # the same codes and scales: no rounding at all
    assert six.low.shape == (24, 384) and six.high.shape == (24, 192) and six.sub.shape == (24, 48)
    assert six.d.shape == (24, 3) and int(w6a8.codes_of(six).max()) <= 63


def test_the_layout_keeps_every_code():
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 64, (5, 512), generator=generator)
    weights = w6a8.pack(codes, torch.ones(5, 32, dtype=torch.int8), torch.ones(5, 2, dtype=torch.float16))
    assert torch.equal(w6a8.codes_of(weights), codes.to(torch.uint8))
    assert torch.equal(w6a8.dequantize(weights), codes.float() - 32)
    with pytest.raises(ValueError, match="multiple of 256"):
        w6a8.pack(codes[:, :320], torch.ones(5, 20, dtype=torch.int8), torch.ones(5, 2, dtype=torch.float16))


def test_the_reference_computes_codes_times_per_group_int8_activations():
    weights = q6k_to_int6a8(random_q6k(40, 512, seed=1), 40, 512)
    x = torch.randn(6, 512) * torch.linspace(0.1, 4.0, 512)  # groups of very different ranges
    want = exact_product(x, weights)
    got = w6a8.reference(x, weights)
    assert ((got.double() - want).norm() / want.norm()) < 1e-6
    dense = x.double() @ w6a8.dequantize(weights).double().T
    assert ((got.double() - dense).norm() / dense.norm()) < 0.02  # int8 activations cost about 1%


def runnable_builds() -> list[Build]:
    return [build for build in BUILDS if all(flag in cpu_flags() for flag in build.needs)]


@pytest.mark.parametrize("build", runnable_builds() or [None], ids=lambda b: b.name if b else "none")
def test_every_build_this_cpu_runs_agrees_with_the_reference_and_with_itself_in_any_block(build):
    if build is None:
        pytest.skip("this CPU runs no build of the 6-bit kernel")
    kernel = load(build)
    if not isinstance(kernel, Library):
        pytest.skip(kernel)  # no compiler here
    assert w6a8._self_check(kernel) is None
    weights = q6k_to_int6a8(random_q6k(48, 1280, seed=2), 48, 1280)  # five super-blocks: an odd pair count
    x = torch.randn(11, 1280) * torch.linspace(0.1, 4.0, 1280)
    block = w6a8._run(kernel, x, weights, 2)
    want = exact_product(x, weights)
    assert ((block.double() - want).norm() / want.norm()) < 1e-6
    # A row's result is the same bits whichever block it came in (blocks of 4 rows share each weight read).
    for start, size in ((0, 1), (3, 1), (10, 1), (1, 2), (5, 3), (2, 4), (4, 7)):
        part = w6a8._run(kernel, x[start : start + size].contiguous(), weights, 2)
        assert torch.equal(part, block[start : start + size]), (start, size)
    assert torch.equal(w6a8._run(kernel, x, weights, 1), block)  # and whatever the threads


def test_without_its_kernel_the_product_says_so_once_and_computes_the_same(monkeypatch, capsys):
    weights = q6k_to_int6a8(random_q6k(8, 256, seed=3), 8, 256)
    x = torch.randn(3, 256)
    monkeypatch.setattr(w6a8, "kernel", lambda: "this CPU lacks avx2")
    got = [w6a8.product(x, weights) for _ in range(2)]
    assert capsys.readouterr().err == "viasd: 6-bit x int8 products run on torch ops, slowly: this CPU lacks avx2\n"
    assert torch.equal(got[0], w6a8.reference(x, weights))


@pytest.mark.parametrize("six_bit", [True, False], ids=["w6a8", "w4a8"])
def test_bf16_activations_go_in_and_come_out_as_one_float32_product_rounded_once(six_bit):
    """A bf16 model's activations go to the kernels as they are, and the output, bias added, comes back in bf16:
    the same bits as the float32 product of the same (exactly widened) input, bias added, rounded by torch."""
    generator = torch.Generator().manual_seed(4)
    x = (torch.randn(5, 512, generator=generator) * 3).bfloat16()
    bias = torch.randn(40, generator=generator).bfloat16()
    if six_bit:
        weights = q6k_to_int6a8(random_q6k(40, 512, seed=5), 40, 512)
        got, want = w6a8.product(x, weights, bias), w6a8.product(x.float(), weights, bias.float())
    else:
        packed, scale, low = w4a8.pack(torch.randn(40, 512, generator=generator))
        got, want = w4a8.product(x, packed, scale, low, bias), w4a8.product(x.float(), packed, scale, low, bias.float())
    assert got.dtype == torch.bfloat16 and want.dtype == torch.float32
    assert torch.equal(got, want.to(torch.bfloat16))
