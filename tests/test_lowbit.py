"""viasd's low-bit products, every format through one driver (kernels/lowbit.c; w4a8, w6a8, w8a8): the tiled layouts
keep every code and scale, the torch references are the exact products of int8 activations and the weights, and every
build this CPU runs computes them, for blocks of 1 to 16 tokens (partial tiles of rows too), each token the same bits
in any block and with any number of threads; both builds give the same bits; without a kernel the product says so
once and computes the same; bf16 goes in and out as one float32 product rounded once."""

from __future__ import annotations

import pytest
import torch

from viasd.kernels import build, w4a8, w6a8, w8a8
from viasd.kernels.build import Library
from viasd.kernels.cpu import cpu_flags

FORMATS = {"w4a8": w4a8, "w6a8": w6a8, "w8a8": w8a8}
RUNNABLE = [b for b in build.BUILDS if all(flag in cpu_flags() for flag in b.needs)]


def weights_of(name: str, n: int, k: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return FORMATS[name].random_weights(n, k, generator)


def activations(rows: int, k: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=generator) * torch.linspace(0.1, 4.0, k)  # groups of different ranges


def exact_product(x: torch.Tensor, module, weights) -> torch.Tensor:
    """What the kernels compute, in float64: activations rounded to 255 levels per token and group of 32, times the
    dequantized weights."""
    codes, step = w4a8.activation_codes(x)
    rounded = (codes * step[..., None]).reshape(x.shape)
    return rounded.double() @ module.dequantize(weights).double().T


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def test_the_4_bit_layout_keeps_every_code_scale_and_minimum():
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (40, 320), generator=generator)  # 40 rows: two tiles and a partial one
    scale, low = torch.rand(40, 10, generator=generator).half(), -torch.rand(40, 10, generator=generator).half()
    weights = w4a8.layout(codes, scale, low)
    assert weights.packed.shape == (3, 40, 64) and weights.scale.shape == (3, 10, 16) and weights.n == 40
    assert torch.equal(w4a8.codes_of(weights.packed, 40), codes.to(torch.uint8))
    assert torch.equal(w4a8.rows_of(weights.scale, 40), scale) and torch.equal(w4a8.rows_of(weights.low, 40), low)
    want = low.float().repeat_interleave(32, 1) + codes * scale.float().repeat_interleave(32, 1)
    assert torch.equal(w4a8.dequantize(weights), want)
    dense = torch.randn(40, 320, generator=generator)
    assert rel_error(w4a8.dequantize(w4a8.pack(dense)), dense) < 0.1  # 16 steps per group's range


def test_the_6_bit_layout_keeps_every_code_and_scale():
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 64, (21, 512), generator=generator)
    sub = torch.randint(-128, 128, (21, 32), generator=generator).to(torch.int8)
    d = torch.rand(21, 2, generator=generator).half()
    weights = w6a8.pack(codes, sub, d)
    assert weights.low.shape == (2, 64, 64) and weights.high.shape == (2, 32, 64) and weights.n == 21
    assert torch.equal(w6a8.codes_of(weights), codes.to(torch.uint8))
    want = (codes.float() - 32) * sub.float().repeat_interleave(16, 1) * d.float().repeat_interleave(256, 1)
    assert torch.equal(w6a8.dequantize(weights), want)
    with pytest.raises(ValueError, match="multiple of 256"):
        w6a8.pack(codes[:, :320], sub[:, :20], d)


def test_the_8_bit_layout_keeps_every_code_scale_and_minimum():
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-128, 128, (21, 96), generator=generator)  # a whole tile and a partial one
    scale, low = torch.rand(21, 3, generator=generator), -torch.rand(21, 3, generator=generator)
    weights = w8a8.layout(codes, scale, low)
    assert weights.codes.shape == (2, 24, 64) and weights.scale.shape == (2, 3, 16) and weights.n == 21
    assert torch.equal(w8a8.codes_of(weights), codes.to(torch.int8))
    assert int(weights.codes[0, 1, 4 * 2 + 3]) == int(codes[2, 4 + 3])  # quad 1, row 2, byte 3: input 7
    want = scale.repeat_interleave(32, 1) * codes + low.repeat_interleave(32, 1)
    assert torch.equal(w8a8.dequantize(weights), want)
    with pytest.raises(ValueError, match="multiple of 32"):
        w8a8.layout(codes[:, :80], scale, low)


@pytest.mark.parametrize("name", FORMATS)
def test_the_reference_is_the_exact_product_of_int8_activations_and_the_weights(name):
    module = FORMATS[name]
    weights = weights_of(name, 40, 512)
    x = activations(6, 512)
    assert rel_error(module.reference(x, weights), exact_product(x, module, weights)) < 1e-6
    dense = x.double() @ module.dequantize(weights).double().T
    assert rel_error(module.reference(x, weights), dense) < 0.02  # int8 activations cost about 1%


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("chosen", RUNNABLE or [None], ids=lambda b: b.name if b else "none")
def test_every_build_computes_blocks_of_1_to_16_tokens_each_token_alike_in_any_block(chosen, name):
    if chosen is None:
        pytest.skip("this CPU runs no build of viasd's kernels")
    library = build.load(chosen)
    if not isinstance(library, Library):
        pytest.skip(library)  # no compiler here
    module = FORMATS[name]
    assert module._self_check(library) is None
    weights = weights_of(name, 40, 1280, seed=2)  # rows past the last whole tile; five 6-bit super-blocks
    x = activations(16, 1280, seed=3)
    block = module._run(library, x, weights, 2)
    assert rel_error(block, exact_product(x, module, weights)) < 1e-6
    for size in range(1, 17):  # one tile call takes 8 tokens (4 on AVX2): blocks past it, and every remainder
        for start in sorted({0, 16 - size, (3 * size) % (17 - size)}):
            part = module._run(library, x[start : start + size].contiguous(), weights, 2)
            assert torch.equal(part, block[start : start + size]), (size, start)
    assert torch.equal(module._run(library, x, weights, 1), block)  # and whatever the threads


@pytest.mark.skipif(len(RUNNABLE) < 2, reason="compares the AVX-512 build with the AVX2 one")
@pytest.mark.parametrize("name", FORMATS)
def test_the_avx2_build_gives_the_avx512_builds_bits(name):
    """Integer dot products are exact, and both builds scale and add them per lane in the same order."""
    libraries = [build.load(b) for b in RUNNABLE]
    if not all(isinstance(library, Library) for library in libraries):
        pytest.skip("no compiler here")
    module = FORMATS[name]
    weights, x = weights_of(name, 48, 768, seed=4), activations(9, 768, seed=5)
    wide, narrow = (module._run(library, x, weights, 2) for library in libraries)
    assert torch.equal(wide, narrow)


@pytest.mark.parametrize("name", FORMATS)
def test_without_its_kernel_the_product_says_so_once_and_computes_the_same(name, monkeypatch, capsys):
    """On a machine with no compiled kernel (another CPU, no C compiler) the view still works, on torch ops, and
    says why it is slow, once; switched off (VIASD_KERNELS) it says nothing."""
    module = FORMATS[name]
    weights, x = weights_of(name, 24, 512), activations(3, 512)
    monkeypatch.setattr(module, "kernel", lambda: f"this CPU lacks {name}")
    got = [module.product(x, weights) for _ in range(2)]
    assert capsys.readouterr().err == f"viasd: {module.NAME} products run on torch ops, slowly: this CPU lacks {name}\n"
    assert torch.equal(got[0], module.reference(x, weights))
    monkeypatch.undo()
    monkeypatch.setenv("VIASD_KERNELS", "off")
    assert torch.equal(module.product(x, weights), got[0]) and capsys.readouterr().err == ""


@pytest.mark.parametrize("name", FORMATS)
def test_bf16_activations_go_in_and_come_out_as_one_float32_product_rounded_once(name):
    """A bf16 model's activations go to the kernels as they are, and the output, bias added, comes back in bf16:
    the same bits as the float32 product of the same (exactly widened) input, bias added, rounded by torch."""
    module = FORMATS[name]
    generator = torch.Generator().manual_seed(4)
    x = (torch.randn(5, 512, generator=generator) * 3).bfloat16()
    bias = torch.randn(40, generator=generator).bfloat16()
    weights = weights_of(name, 40, 512, seed=6)
    got, want = module.product(x, weights, bias), module.product(x.float(), weights, bias.float())
    assert got.dtype == torch.bfloat16 and want.dtype == torch.float32
    assert torch.equal(got, want.to(torch.bfloat16))


def test_a_shape_the_kernel_does_not_take_is_a_clear_error():
    library = w4a8.kernel()
    if not isinstance(library, Library):
        pytest.skip(library)
    weights = weights_of("w4a8", 16, 320)
    with pytest.raises(ValueError, match="does not take 300 inputs"):
        w4a8._run(library, torch.randn(2, 300), weights, 1)
