"""A GGUF file's 6-bit weights (Q6_K) x int8 activations: the layout, the product, and the CPU kernel behind it.

Q4_K_M files store their most sensitive tensors (the output head, some value and down projections) at 6 bits. The
`gguf` view computes on those numbers as they are, as it does on the file's 4-bit blocks (models/w4a8.py),
instead of an int8 copy of their dequantized weights: 6.56 bits per weight to read instead of 8, and int8 dot
products instead of a bf16 one. The layout and the arithmetic are in `w6a8.c`; on x86 with AVX-512 VNNI or AVX2
the product is that C kernel (in viasd's kernel library, checked against `reference` when loaded), elsewhere
`reference` computes the same numbers with torch ops, more slowly. Each row (token) of a block gets a result that
does not depend on the other rows.
"""

from __future__ import annotations

import functools

import torch

from viasd.kernels import w4a8
from viasd.kernels.build import Library, address, checked, sizes, status, usable
from viasd.kernels.notice import warn_once
from viasd.kernels.switch import OFF

SUB = sizes()["VIASD_SUB"]  # inputs per int8 sub-block scale
SUPER = sizes()["VIASD_SUPER"]  # inputs per fp16 super-block scale


class SixBitWeights:
    """One layer's 6-bit weights in the kernel's layout: w = d * sub * (code - 32), codes 0..63.

    low [out, in/2] uint8 (the codes' low nibbles, w4a8's layout), high [out, in/4] uint8 (their top two bits),
    sub [out, in/16] int8 (a scale per 16 inputs), d [out, in/256] fp16 (a scale per 256 inputs).
    """

    __slots__ = ("d", "high", "low", "sub")

    def __init__(self, low: torch.Tensor, high: torch.Tensor, sub: torch.Tensor, d: torch.Tensor) -> None:
        self.low, self.high, self.sub, self.d = low, high, sub, d

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.low, self.high, self.sub, self.d


def pack(codes: torch.Tensor, sub: torch.Tensor, d: torch.Tensor) -> SixBitWeights:
    """Codes [out, in] (0..63, `in` a multiple of 256), their sub-block and super-block scales, in the kernel's
    layout (see `w6a8.c`): the low nibbles as w4a8 packs 4-bit codes; the top two bits of each pair of 64-input
    chunks c, c' in 32 bytes, byte t holding those of inputs c:32+t, c':32+t, c:t and c':t (bits 0-1 .. 6-7)."""
    rows, columns = codes.shape
    if columns % SUPER:
        raise ValueError(f"6-bit weights need a multiple of {SUPER} inputs, got {columns}")
    codes = codes.to(torch.uint8)
    low = w4a8.pack_codes(codes & 15)
    top = (codes >> 4).reshape(rows, columns // 128, 2, 2, 32)  # [row, pair, chunk of the pair, half, t]
    high = top[:, :, 0, 1] | top[:, :, 1, 1] << 2 | top[:, :, 0, 0] << 4 | top[:, :, 1, 0] << 6
    return SixBitWeights(low, high.reshape(rows, columns // 4).contiguous(), sub.contiguous(), d.contiguous())


def codes_of(weights: SixBitWeights) -> torch.Tensor:
    """The codes [out, in] (0..63) that `pack` laid out."""
    rows = weights.low.shape[0]
    low = w4a8.unpack(weights.low).reshape(rows, -1)
    high = weights.high.reshape(rows, -1, 1, 32)
    top = torch.cat([high >> 4, high, high >> 6, high >> 2], dim=2) & 3  # [row, pair, c:0.. c:32.. c':0.. c':32.., t]
    return low | top.reshape(rows, -1) << 4


def dequantize(weights: SixBitWeights) -> torch.Tensor:
    """The float32 weight [out, in] the codes and scales stand for."""
    rows = weights.low.shape[0]
    codes = codes_of(weights).float().reshape(rows, -1, SUB) - 32.0
    scale = weights.sub.float().reshape(rows, -1, SUPER // SUB) * weights.d.float()[..., None]
    return (codes * scale.reshape(rows, -1, 1)).reshape(rows, -1)


def reference(x: torch.Tensor, weights: SixBitWeights) -> torch.Tensor:
    """x [rows, in] float32 @ W^T by the kernel's arithmetic, in torch ops: float32 [rows, out].

    The integer dot products are exact in float32 (at most 16 * 63 * 127), so how torch blocks the product cannot
    change them; each output sums its own row of per-sub-block terms. Rows go a few at a time to bound memory.
    """
    codes = codes_of(weights).float().reshape(weights.low.shape[0], -1, SUB).transpose(0, 1).transpose(1, 2)
    scale = weights.sub.float() * weights.d.float().repeat_interleave(SUPER // SUB, dim=1)  # [out, S]
    return torch.cat([_reference_rows(chunk, codes, scale) for chunk in x.split(8)])


def _reference_rows(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    a, step = w4a8.activation_codes(x)
    a = a.reshape(x.shape[0], -1, SUB)  # [rows, S, 16]
    dots = torch.bmm(a.transpose(0, 1), codes).permute(1, 2, 0)  # [rows, out, S]
    factor = scale[None] * step.repeat_interleave(w4a8.GROUP // SUB, dim=1)[:, None, :]
    return (factor * dots).sum(dim=-1) - 32.0 * (factor * a.sum(-1)[:, None, :]).sum(dim=-1)


@functools.cache
def compiled() -> Library | str:
    """The compiled kernel, checked once per process (whatever VIASD_KERNELS says), or why there is none."""
    return checked("6-bit x int8", _self_check)


def kernel() -> Library | str:
    """The compiled kernel, checked once per process, or why it is not used (a sentence)."""
    return usable("w6a8", compiled)


def _run(
    library: Library, x: torch.Tensor, weights: SixBitWeights, threads: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (`kernel_input`) @ W^T + bias (float32) by the kernel, in x's dtype."""
    out = torch.empty(x.shape[0], weights.low.shape[0], dtype=x.dtype)
    pointers = [address(t) for t in weights.tensors()]
    status = library.lib.w6a8_linear(address(x), x.dtype == torch.bfloat16, x.shape[0], x.shape[1], *pointers,
                                     weights.low.shape[0], address(bias), address(out), threads)  # fmt: skip
    if status != 0:
        raise MemoryError("the 6-bit x int8 kernel could not allocate its scratch memory")
    return out


def random_weights(rows: int, columns: int, generator: torch.Generator) -> SixBitWeights:
    """Random codes and scales of Q6_K's ranges (for checks and timings)."""
    codes = torch.randint(0, 64, (rows, columns), generator=generator)
    sub = torch.randint(-128, 128, (rows, columns // SUB), generator=generator).to(torch.int8)
    d = (torch.rand(rows, columns // SUPER, generator=generator) * 1e-3 + 1e-4).half()
    return pack(codes, sub, d)


def _self_check(library: Library) -> str | None:
    """Why the kernel cannot be trusted here, or None: a small product (blocks of 1 to 6 tokens) must match
    `reference` and give each token the same bits in every block."""
    generator = torch.Generator().manual_seed(0)
    weights = random_weights(24, 768, generator)
    x = torch.randn(6, 768, generator=generator) * torch.linspace(0.1, 4.0, 768)
    want = reference(x, weights)
    got = _run(library, x, weights, 2)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
        return "disagrees with the reference product"
    for rows in range(1, 6):
        if not torch.equal(_run(library, x[:rows].contiguous(), weights, 2), got[:rows]):
            return "gives a token other bits in another block"
    return None


def kernel_status() -> str:
    """`compiled (BUILD)` when the fast CPU kernel is in use, else why not."""
    return status(kernel())


def product(x: torch.Tensor, weights: SixBitWeights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ W^T + bias [rows, out] in x's dtype, computed in float32 and rounded once: the C kernel on a
    capable CPU, else `reference`."""
    if x.device.type == "cpu":
        found = kernel()
        if isinstance(found, Library):
            b = None if bias is None else bias.float().contiguous()
            return _run(found, w4a8.kernel_input(x), weights, torch.get_num_threads(), b).to(x.dtype)
        if found != OFF:
            warn_once(f"6-bit x int8 products run on torch ops, slowly: {found}")
    out = reference(x.float(), weights)
    return (out if bias is None else out + bias.float()).to(x.dtype)
