"""A GGUF file's 6-bit weights (Q6_K) x int8 activations: the 6-bit format's layout, its torch reference, and its
kernel (`w6a8.c`).

Q4_K_M files store their most sensitive tensors (the output head, some value and down projections) at 6 bits. The
`gguf` view computes on those numbers as they are, as it does on the file's 4-bit blocks (kernels/w4a8.py),
instead of an int8 copy of their dequantized weights: 6.56 bits per weight to read instead of 8, and int8 dot
products instead of a bf16 one. Weights are stored in tiles of 16 output rows (kernels/lowbit.h, w6a8.c); on x86
with AVX-512 VNNI or AVX2 the product is the C kernel (checked against `reference` when loaded), elsewhere
`reference` computes the same numbers with torch ops, more slowly. Each token of a block gets a result that does
not depend on the other tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from viasd.kernels import lowbit, w4a8
from viasd.kernels.build import Library, checked, sizes, status, usable

SUB = sizes()["VIASD_SUB"]  # inputs per int8 sub-block scale
SUPER = sizes()["VIASD_SUPER"]  # inputs per fp16 super-block scale
NAME = "6-bit x int8"  # in messages
TILE = w4a8.TILE


@dataclass(frozen=True)
class SixBitWeights:
    """One layer's 6-bit weights in the kernel's layout, w = d * sub * (code - 32), codes 0..63, in tiles of 16 rows:
    low [T, in/8, 64] uint8 (the codes' low nibbles, w4a8's layout), high [T, in/16, 64] uint8 (their top two
    bits), sub [T, in/16, 16] int8 (a scale per 16 inputs), d [T, in/256, 16] fp16 (a scale per 256 inputs); `n`
    output rows."""

    low: torch.Tensor
    high: torch.Tensor
    sub: torch.Tensor
    d: torch.Tensor
    n: int

    @property
    def k(self) -> int:
        return self.low.shape[1] * 8

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.low, self.high, self.sub, self.d


def pack(codes: torch.Tensor, sub: torch.Tensor, d: torch.Tensor) -> SixBitWeights:
    """Codes [n, in] (0..63, `in` a multiple of 256), their sub-block scales [n, in/16] (int8) and super-block scales
    [n, in/256] (fp16), in the kernel's layout (see `w6a8.c`)."""
    n, columns = codes.shape
    if columns % SUPER:
        raise ValueError(f"6-bit weights need a multiple of {SUPER} inputs, got {columns}")
    codes = codes.to(torch.uint8)
    top = w4a8.tiles_of(codes >> 4, n)  # [T, in, 16]
    top = top.reshape(top.shape[0], columns // SUB, 4, 4, TILE).permute(0, 1, 4, 3, 2)  # [T, S, row, b, quarter]
    high = top[..., 0] | top[..., 1] << 2 | top[..., 2] << 4 | top[..., 3] << 6  # quarter q: inputs 16s + 4q + b
    return SixBitWeights(w4a8.tile_codes(codes & 15), high.reshape(top.shape[0], columns // SUB, 4 * TILE).contiguous(),
                         w4a8.tiles_of(sub.to(torch.int8), n), w4a8.tiles_of(d.half(), n), n)  # fmt: skip


def empty(rows: int, columns: int, device: str = "meta") -> SixBitWeights:
    """Weights of `rows` x `columns` in the layout, uninitialized (as `w4a8.empty`)."""
    tiles = -(-rows // TILE)
    low = torch.empty(tiles, columns // 8, 4 * TILE, dtype=torch.uint8, device=device)
    high = torch.empty(tiles, columns // SUB, 4 * TILE, dtype=torch.uint8, device=device)
    sub = torch.empty(tiles, columns // SUB, TILE, dtype=torch.int8, device=device)
    return SixBitWeights(low, high, sub, torch.empty(tiles, columns // SUPER, TILE, dtype=torch.float16, device=device),
                         rows)  # fmt: skip


def codes_of(weights: SixBitWeights) -> torch.Tensor:
    """The codes [n, in] (0..63) that `pack` laid out."""
    n, k = weights.n, weights.k
    tiles = weights.high.shape[0]
    lanes = weights.high.reshape(tiles, k // SUB, TILE, 4)  # byte b of row i
    top = torch.stack([lanes & 3, lanes >> 2 & 3, lanes >> 4 & 3, lanes >> 6], dim=-2)  # [T, S, 16, quarter, b]
    top = top.permute(0, 2, 1, 3, 4).reshape(tiles * TILE, k)[:n]
    return w4a8.codes_of(weights.low, n) | top << 4


def scales_of(weights: SixBitWeights) -> torch.Tensor:
    """d * sub per row and sub-block [n, in/16], in float32."""
    d = w4a8.rows_of(weights.d, weights.n).float().repeat_interleave(SUPER // SUB, dim=1)
    return w4a8.rows_of(weights.sub, weights.n).float() * d


def dequantize(weights: SixBitWeights) -> torch.Tensor:
    """The float32 weight [n, in] the codes and scales stand for."""
    n = weights.n
    codes = codes_of(weights).float().reshape(n, -1, SUB) - 32.0
    return (codes * scales_of(weights)[..., None]).reshape(n, -1)


def reference(x: torch.Tensor, weights: SixBitWeights) -> torch.Tensor:
    """x [rows, in] float32 @ W^T by the kernel's arithmetic, in torch ops: float32 [rows, n].

    The integer dot products are exact in float32 (at most 16 * 63 * 127), so how torch blocks the product cannot
    change them; each output sums its own row of per-sub-block terms. Rows go a few at a time to bound memory.
    """
    n = weights.n
    codes = codes_of(weights).float().reshape(n, -1, SUB).transpose(0, 1).transpose(1, 2)  # [S, 16, n]
    return torch.cat([_reference_rows(chunk, codes, scales_of(weights)) for chunk in x.split(8)])


def _reference_rows(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    a, step = w4a8.activation_codes(x)
    a = a.reshape(x.shape[0], -1, SUB)  # [rows, S, 16]
    dots = torch.bmm(a.transpose(0, 1), codes).permute(1, 2, 0)  # [rows, n, S]
    steps = step.repeat_interleave(w4a8.GROUP // SUB, dim=1)[:, None, :]  # [rows, 1, S]
    return (scale[None] * steps * dots).sum(dim=-1) - 32.0 * (scale[None] * (steps * a.sum(-1)[:, None, :])).sum(-1)


_run = functools.partial(lowbit.run, "w6a8_linear", NAME)  # x @ W^T + bias by the kernel


def random_weights(rows: int, columns: int, generator: torch.Generator) -> SixBitWeights:
    """Random codes and scales of Q6_K's ranges (for checks and timings)."""
    codes = torch.randint(0, 64, (rows, columns), generator=generator)
    sub = torch.randint(-128, 128, (rows, columns // SUB), generator=generator).to(torch.int8)
    d = (torch.rand(rows, columns // SUPER, generator=generator) * 1e-3 + 1e-4).half()
    return pack(codes, sub, d)


def _self_check(library: Library) -> str | None:
    """Why the kernel cannot be trusted here, or None (kernels/lowbit.py's check, on random weights)."""
    weights = random_weights(40, 512, torch.Generator().manual_seed(0))
    return lowbit.self_check(lambda x, w, threads: _run(library, x, w, threads), reference, weights)


@functools.cache
def compiled() -> Library | str:
    """The compiled kernel, checked once per process (whatever VIASD_KERNELS says), or why there is none."""
    return checked(NAME, _self_check)


def kernel() -> Library | str:
    """The compiled kernel, checked once per process, or why it is not used (a sentence)."""
    return usable("w6a8", compiled)


def kernel_status() -> str:
    """`compiled (BUILD)` when the fast CPU kernel is in use, else why not."""
    return status(kernel())


def product(x: torch.Tensor, weights: SixBitWeights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ W^T + bias [rows, n] in x's dtype, computed in float32 and rounded once: the C kernel on a
    capable CPU, else `reference`."""
    return lowbit.product(x, weights, bias, kernel(), _run, reference, NAME)
