"""int4 weights x int8 activations: the 4-bit format's layout, its torch reference, and its kernel (`w4a8.c`).

Weights are 4-bit codes in groups of 32 inputs with an fp16 scale and minimum per group, stored in tiles of 16
output rows (kernels/lowbit.h, w4a8.c). On an x86 CPU with AVX-512 VNNI or AVX2 the product is the C kernel, checked
against `reference` before first use; everywhere else (no compiler, another CPU, CUDA, `VIASD_KERNELS=off`)
`reference` computes the same numbers with torch ops, more slowly. Both give every token a result that does not
depend on the other tokens of its block.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from viasd.kernels import lowbit
from viasd.kernels.build import Library, checked, sizes, status, usable

GROUP = sizes()["VIASD_GROUP"]  # inputs per scale and minimum (weights) and per step (activations)
NAME = "int4 x int8"  # in messages
TILE = sizes()["VIASD_TILE"]  # output rows per tile


@dataclass(frozen=True)
class FourBitWeights:
    """One layer's 4-bit weights in the kernel's layout: packed [T, in/8, 64] uint8 (T = tiles of 16 rows), scale
    and low [T, in/32, 16] fp16; `n` output rows (the last tile's rows beyond it are zero)."""

    packed: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor
    n: int

    @property
    def k(self) -> int:
        return self.packed.shape[1] * 8

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.packed, self.scale, self.low


def tiles_of(rows: torch.Tensor, n: int) -> torch.Tensor:
    """Per-row values [n, C] as tiles [T, C, 16] (rows padded with zeros to whole tiles)."""
    count = -(-n // TILE)
    padded = torch.zeros((count * TILE, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    padded[:n] = rows
    return padded.reshape(count, TILE, -1).transpose(1, 2).contiguous()


def rows_of(tiles: torch.Tensor, n: int) -> torch.Tensor:
    """`tiles_of`'s inverse: [T, C, 16] -> [n, C]."""
    return tiles.transpose(1, 2).reshape(-1, tiles.shape[1])[:n]


def tile_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [n, in] (0..15) in the tiled layout [T, in/8, 64]: per tile, octet o and row i, byte 4i + b holds code
    8o + b in its low nibble and code 8o + 4 + b in its high one."""
    n, k = codes.shape
    octets = tiles_of(codes.to(torch.uint8).reshape(n, k // 8, 8).reshape(n, -1), n)  # [T, in, 16]
    octets = octets.reshape(octets.shape[0], k // 8, 8, TILE).permute(0, 1, 3, 2)  # [T, in/8, 16 rows, 8]
    return (octets[..., :4] | octets[..., 4:] << 4).reshape(octets.shape[0], k // 8, 4 * TILE).contiguous()


def codes_of(packed: torch.Tensor, n: int) -> torch.Tensor:
    """`tile_codes`'s inverse: the codes [n, in]."""
    tiles, octets = packed.shape[:2]
    lanes = packed.reshape(tiles, octets, TILE, 4)
    codes = torch.cat([lanes & 0x0F, lanes >> 4], dim=-1)  # [T, in/8, 16, 8]
    return codes.permute(0, 2, 1, 3).reshape(tiles * TILE, octets * 8)[:n]


def layout(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> FourBitWeights:
    """Codes [n, in] (0..15), scale and low [n, in/32] (fp16) in the kernel's layout."""
    n = codes.shape[0]
    return FourBitWeights(tile_codes(codes), tiles_of(scale.half(), n), tiles_of(low.half(), n), n)


def empty(rows: int, columns: int, device: str = "meta") -> FourBitWeights:
    """Weights of `rows` x `columns` in the layout, uninitialized: shapes only on "meta" (a cached copy's probe:
    packing a meta weight instead ran every packing op, about 5 ms a layer at each start), what the C repacker
    fills on "cpu"."""
    tiles = -(-rows // TILE)
    groups = (tiles, columns // GROUP, TILE)
    packed = torch.empty(tiles, columns // 8, 4 * TILE, dtype=torch.uint8, device=device)
    scale, low = (torch.empty(groups, dtype=torch.float16, device=device) for _ in range(2))
    return FourBitWeights(packed, scale, low, rows)


def pack(weight: torch.Tensor) -> FourBitWeights:
    """`weight` [out, in] as 4-bit codes in groups of 32 inputs, w ~ low + code * scale (each group's range in 16
    steps), in the kernel's layout."""
    rows, columns = weight.shape
    groups = weight.detach().float().reshape(rows, columns // GROUP, GROUP)
    low = groups.amin(dim=-1).half()
    scale = ((groups.amax(dim=-1) - low.float()) / 15.0).clamp_min(1e-6).half()
    codes = torch.round((groups - low.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
    return layout(codes.reshape(rows, columns), scale, low)


def dequantize(weights: FourBitWeights) -> torch.Tensor:
    """The float32 weight [n, in] that the codes, scales and minimums stand for."""
    n = weights.n
    codes = codes_of(weights.packed, n).float().reshape(n, -1, GROUP)
    scale, low = rows_of(weights.scale, n).float(), rows_of(weights.low, n).float()
    return (low[..., None] + codes * scale[..., None]).reshape(n, -1)


def activation_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] quantized per row and group of 32 as the kernels do: the codes [rows, G, 32] (integers in
    float32) and each group's step max|x| / 127 [rows, G]."""
    rows, columns = x.shape
    groups = x.reshape(rows, columns // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1)
    # A true division, as the kernels make it (torch computes a number over a tensor through a reciprocal).
    inverse = torch.where(amax > 0, amax.new_tensor(127.0) / amax, torch.zeros_like(amax))
    return torch.round(groups * inverse[..., None]), amax / 127.0


def reference(x: torch.Tensor, weights: FourBitWeights) -> torch.Tensor:
    """x [rows, in] float32 @ W^T by the kernel's arithmetic, in torch ops: float32 [rows, n].

    The integer dot products are exact in float32 (at most 32 * 15 * 127), so how torch blocks the matrix
    product cannot change them; each output then sums its own row of per-group terms, in an order that does not
    depend on the other rows of the block. Rows go a few at a time to bound the memory.
    """
    n = weights.n
    codes = codes_of(weights.packed, n).float().reshape(n, -1, GROUP).transpose(0, 1).transpose(1, 2)  # [G, 32, n]
    scale, low = rows_of(weights.scale, n).float(), rows_of(weights.low, n).float()
    return torch.cat([_reference_rows(chunk, codes, scale, low) for chunk in x.split(8)])


def _reference_rows(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    a, step = activation_codes(x)  # [rows, G, 32], [rows, G]
    dots = torch.bmm(a.transpose(0, 1), codes).permute(1, 2, 0)  # [rows, n, G]
    terms = dots * scale[None] * step[:, None, :] + low[None] * (a.sum(-1) * step)[:, None, :]
    return terms.contiguous().sum(dim=-1)


_run = functools.partial(lowbit.run, "w4a8_linear", NAME)  # x @ W^T + bias by the kernel


def random_weights(rows: int, columns: int, generator: torch.Generator) -> FourBitWeights:
    """Random codes, scales and minimums of Q4_K's ranges (for checks and timings)."""
    codes = torch.randint(0, 16, (rows, columns), generator=generator)
    scale = torch.rand(rows, columns // GROUP, generator=generator) * 0.01 + 1e-3
    low = -torch.rand(rows, columns // GROUP, generator=generator) * 0.08
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
    return usable("w4a8", compiled)


def kernel_status() -> str:
    """`compiled (BUILD)` when the fast CPU kernel is in use, else why not."""
    return status(kernel())


def product(x: torch.Tensor, weights: FourBitWeights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ W^T + bias [rows, n] in x's dtype, computed in float32 and rounded once: the C kernel on a
    capable CPU, else `reference`."""
    return lowbit.product(x, weights, bias, kernel(), _run, reference, NAME)
