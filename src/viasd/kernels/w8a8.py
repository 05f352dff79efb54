"""int8 weights in groups of 32 x int8 activations: the 8-bit format's layout, its torch reference, and its kernel
(`w8a8.c`).

Weights are int8 codes in groups of 32 inputs with a float32 scale and minimum per group, w = scale * code + low,
stored in tiles of 16 output rows (kernels/lowbit.h, w8a8.c). It is what a GGUF file's Q8_0 blocks are (d as the
scale, no minimum), and what its Q5_K blocks are with their 5-bit codes widened to bytes and each group's scale
d * sc and minimum -dmin * m multiplied out (exactly, in float32): the `gguf` view computes on those numbers as they
are (views/gguf.py). On x86 with AVX-512 VNNI or AVX2 the product is the C kernel, checked against `reference`
when loaded; elsewhere `reference` computes the same numbers with torch ops, more slowly. Each token of a block
gets a result that does not depend on the other tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from viasd.kernels import lowbit, w4a8
from viasd.kernels.build import Library, checked, status, usable

GROUP = w4a8.GROUP  # inputs per scale and minimum
NAME = "int8 x int8"  # in messages
TILE = w4a8.TILE


@dataclass(frozen=True)
class EightBitWeights:
    """One layer's 8-bit weights in the kernel's layout: codes [T, in/4, 64] int8 (T = tiles of 16 rows), scale and
    low [T, in/32, 16] float32; `n` output rows (the last tile's rows beyond it are zero)."""

    codes: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor
    n: int

    @property
    def k(self) -> int:
        return self.codes.shape[1] * 4

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scale, self.low


def layout(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> EightBitWeights:
    """Codes [n, in] (-128..127, `in` a multiple of 32), scale and low [n, in/32] in the kernel's layout: per tile,
    quad o of inputs and row i, byte 4i + b holds code 4o + b."""
    n, k = codes.shape
    if k % GROUP:
        raise ValueError(f"8-bit weights need a multiple of {GROUP} inputs, got {k}")
    tiled = w4a8.tiles_of(codes.to(torch.int8), n)  # [T, in, 16]
    quads = tiled.reshape(tiled.shape[0], k // 4, 4, TILE).transpose(2, 3).reshape(tiled.shape[0], k // 4, 4 * TILE)
    return EightBitWeights(quads.contiguous(), w4a8.tiles_of(scale.float(), n), w4a8.tiles_of(low.float(), n), n)


def empty(rows: int, columns: int, device: str = "meta") -> EightBitWeights:
    """Weights of `rows` x `columns` in the layout, uninitialized (as `w4a8.empty`)."""
    tiles = -(-rows // TILE)
    codes = torch.empty(tiles, columns // 4, 4 * TILE, dtype=torch.int8, device=device)
    scale, low = (torch.empty(tiles, columns // GROUP, TILE, dtype=torch.float32, device=device) for _ in range(2))
    return EightBitWeights(codes, scale, low, rows)


def codes_of(weights: EightBitWeights) -> torch.Tensor:
    """`layout`'s codes [n, in] (int8)."""
    tiles, quads = weights.codes.shape[:2]
    lanes = weights.codes.reshape(tiles, quads, TILE, 4).permute(0, 2, 1, 3)  # [T, 16 rows, in/4, 4]
    return lanes.reshape(tiles * TILE, quads * 4)[: weights.n]


def dequantize(weights: EightBitWeights) -> torch.Tensor:
    """The float32 weight [n, in] that the codes, scales and minimums stand for."""
    n = weights.n
    codes = codes_of(weights).float().reshape(n, -1, GROUP)
    scale, low = w4a8.rows_of(weights.scale, n), w4a8.rows_of(weights.low, n)
    return (scale[..., None] * codes + low[..., None]).reshape(n, -1)


def reference(x: torch.Tensor, weights: EightBitWeights) -> torch.Tensor:
    """x [rows, in] float32 @ W^T by the kernel's arithmetic, in torch ops: float32 [rows, n].

    The integer dot products are exact in float32 (at most 32 * 128 * 127), so how torch blocks the product cannot
    change them; each output sums its own row of per-group terms. Rows go a few at a time to bound memory.
    """
    n = weights.n
    codes = codes_of(weights).float().reshape(n, -1, GROUP).transpose(0, 1).transpose(1, 2)  # [G, 32, n]
    scale, low = w4a8.rows_of(weights.scale, n), w4a8.rows_of(weights.low, n)
    return torch.cat([_reference_rows(chunk, codes, scale, low) for chunk in x.split(8)])


def _reference_rows(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    a, step = w4a8.activation_codes(x)  # [rows, G, 32], [rows, G]
    dots = torch.bmm(a.transpose(0, 1), codes).permute(1, 2, 0)  # [rows, n, G]
    terms = dots * scale[None] * step[:, None, :] + low[None] * (a.sum(-1) * step)[:, None, :]
    return terms.contiguous().sum(dim=-1)


_run = functools.partial(lowbit.run, "w8a8_linear", NAME)  # x @ W^T + bias by the kernel


def random_weights(rows: int, columns: int, generator: torch.Generator) -> EightBitWeights:
    """Random codes over the whole int8 range (-128 included), scales and minimums of Q8_0's and Q5_K's ranges (for
    checks and timings)."""
    codes = torch.randint(-128, 128, (rows, columns), generator=generator)
    scale = torch.rand(rows, columns // GROUP, generator=generator) * 1e-3 + 1e-4
    low = -torch.rand(rows, columns // GROUP, generator=generator) * 0.05
    return layout(codes, scale, low)


def _self_check(library: Library) -> str | None:
    """Why the kernel cannot be trusted here, or None (kernels/lowbit.py's check, on random weights)."""
    weights = random_weights(40, 320, torch.Generator().manual_seed(0))
    return lowbit.self_check(lambda x, w, threads: _run(library, x, w, threads), reference, weights)


@functools.cache
def compiled() -> Library | str:
    """The compiled kernel, checked once per process (whatever VIASD_KERNELS says), or why there is none."""
    return checked(NAME, _self_check)


def kernel() -> Library | str:
    """The compiled kernel, checked once per process, or why it is not used (a sentence)."""
    return usable("w8a8", compiled)


def kernel_status() -> str:
    """`compiled (BUILD)` when the fast CPU kernel is in use, else why not."""
    return status(kernel())


def product(x: torch.Tensor, weights: EightBitWeights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ W^T + bias [rows, n] in x's dtype, computed in float32 and rounded once: the C kernel on a
    capable CPU, else `reference`."""
    return lowbit.product(x, weights, bias, kernel(), _run, reference, NAME)
