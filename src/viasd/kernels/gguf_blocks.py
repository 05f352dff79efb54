"""A GGUF file's blocks in the layouts of viasd's low-bit kernels: one numpy conversion per block type, and the
C repacker's call (kernels/repack.c) for the types it takes. Which format takes which type is the table's
(kernels/formats.py); what each conversion does:

Which kernel takes which block type, and how (each exactly, unless said):

* Q4_K (super-blocks of 256: fp16 d and dmin, eight 6-bit sub-block scales sc_j and minimums m_j, 4-bit codes,
  weight = d * sc_j * code - dmin * m_j per sub-block of 32) is int4a8's format (kernels/w4a8.py): groups of 32
  with an fp16 scale and minimum. The codes are taken as they are; each group's d * sc_j and -dmin * m_j are
  rounded once to fp16 (finer than the bf16 rounding of the dense model's copy of the same weights).
* Q4_0 (blocks of 32: fp16 d, 4-bit codes, weight = d * (code - 8)) and Q4_1 (fp16 d and m, weight = d * code + m)
  are int4a8 groups as they are: scale d and minimum -8d (a power of two times an fp16: exact) or m.
* Q6_K (per 256 an fp16 d, per 16 an int8 scale s_j, 6-bit codes, weight = d * s_j * (code - 32)) goes to the
  6-bit kernel (kernels/w6a8.py) as it is.
* Q8_0 (blocks of 32: fp16 d, int8 codes, weight = d * code) and Q5_K (Q4_K's scales with 5-bit codes) go to the
  8-bit kernel (kernels/w8a8.py: int8 codes, a float32 scale and minimum per 32), Q5_K's codes widened to bytes and
  its d * sc_j and -dmin * m_j multiplied out in float32, where they are exact.
* Q5_0 (blocks of 32: fp16 d, 5-bit codes, weight = d * (code - 16)) and Q5_1 (fp16 d and m, weight = d * code + m)
  go to the 8-bit kernel too: code - 16 or the code as a byte, d as the scale, no minimum or m (llama.cpp's Q4_K_M
  files store such blocks where a row is no whole number of 256-weight super-blocks: gemma3-270m's 640 inputs).

"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from viasd.kernels import w4a8, w6a8, w8a8
from viasd.kernels.build import Library, address, ffi
from viasd.kernels.interface import OK

_SUPER = 256  # weights per Q4_K, Q5_K or Q6_K block
_BYTES = 144  # a Q4_K block's size: d, dmin (fp16 each), 12 bytes of 6-bit scales and minimums, 128 bytes of codes
_BYTES5 = 176  # a Q5_K block's: Q4_K's d, dmin and scales, 32 bytes of fifth bits, 128 bytes of low nibbles
_BYTES6 = 210  # a Q6_K block's: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d (fp16)
_SMALL = 32  # weights per Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 block


def q4k_to_int4a8(blocks: np.ndarray, rows: int, columns: int) -> w4a8.FourBitWeights:
    """A Q4_K tensor's raw bytes [rows, columns / 256 * 144] as int4a8's codes, scales and minimums, in the kernel's
    layout. A block's 128 code bytes are four chunks of 32: byte j of chunk c holds weight 64c + j in its low nibble
    and 64c + 32 + j in its high one."""
    from gguf.quants import Q4_K

    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows * (columns // _SUPER), _BYTES)
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(raw[:, 4:16])  # [blocks, 8] each, the sub-blocks in order
    scale = (d * sc.astype(np.float32)).reshape(rows, columns // w4a8.GROUP)
    low = (-dmin * m.astype(np.float32)).reshape(rows, columns // w4a8.GROUP)
    chunks = raw[:, 16:].reshape(rows, columns // 64, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = torch.from_numpy((chunks & 15).reshape(rows, columns))
    return w4a8.layout(codes, torch.from_numpy(scale), torch.from_numpy(low))


def q6k_to_int6a8(blocks: np.ndarray, rows: int, columns: int) -> w6a8.SixBitWeights:
    """A Q6_K tensor's raw bytes [rows, columns / 256 * 210] in the 6-bit kernel's layout (the same numbers).

    In each half of a block (128 weights) byte l of its 64 low-nibble bytes holds weight l (low nibble) and l + 64
    (high), byte l + 32 weights l + 32 and l + 96; byte l of its 32 high-pair bytes holds the top two bits of weights
    l, l + 32, l + 64 and l + 96 (bits 0-1 .. 6-7)."""
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows * (columns // _SUPER), _BYTES6)
    low = raw[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    high = raw[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    codes = (low & 15).reshape(-1, _SUPER) | (high & 3).reshape(-1, _SUPER) << 4
    sub = raw[:, 192:208].copy().view(np.int8).reshape(rows, columns // 16)
    d = raw[:, 208:210].copy().view(np.float16).reshape(rows, columns // _SUPER)
    return w6a8.pack(torch.from_numpy(codes.reshape(rows, columns)), torch.from_numpy(sub), torch.from_numpy(d))


def _nibbles(codes: np.ndarray, blocks: int) -> np.ndarray:
    """A Q4_0 or Q4_1 block's 16 code bytes as its 32 codes: byte j holds weight j (low nibble) and j + 16."""
    halves = codes.reshape(blocks, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    return (halves & 15).reshape(blocks, _SMALL)


def q4_0_to_int4a8(blocks: np.ndarray, rows: int, columns: int) -> w4a8.FourBitWeights | None:
    """A Q4_0 tensor's raw bytes [rows, columns / 32 * 18] as int4a8 groups: scale d, minimum -8d; None where -8d
    leaves fp16's range (no real file comes near)."""
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows * (columns // _SMALL), 18)
    d = raw[:, 0:2].copy().view(np.float16).reshape(rows, columns // _SMALL)
    with np.errstate(over="ignore"):
        low = d * np.float16(-8)
    if not np.isfinite(low).all():
        return None
    codes = torch.from_numpy(_nibbles(raw[:, 2:], len(raw)).reshape(rows, columns))
    return w4a8.layout(codes, torch.from_numpy(d), torch.from_numpy(low))


def q4_1_to_int4a8(blocks: np.ndarray, rows: int, columns: int) -> w4a8.FourBitWeights:
    """A Q4_1 tensor's raw bytes [rows, columns / 32 * 20] as int4a8 groups: its d and m as they are."""
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows * (columns // _SMALL), 20)
    d = raw[:, 0:2].copy().view(np.float16).reshape(rows, columns // _SMALL)
    m = raw[:, 2:4].copy().view(np.float16).reshape(rows, columns // _SMALL)
    codes = torch.from_numpy(_nibbles(raw[:, 4:], len(raw)).reshape(rows, columns))
    return w4a8.layout(codes, torch.from_numpy(d), torch.from_numpy(m))


def q8_0_to_int8a8(blocks: np.ndarray, rows: int, columns: int) -> w8a8.EightBitWeights:
    """A Q8_0 tensor's raw bytes [rows, columns / 32 * 34] as 8-bit groups: its codes, d as the scale, no minimum."""
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows * (columns // _SMALL), 34)
    d = torch.from_numpy(raw[:, 0:2].copy().view(np.float16).reshape(rows, columns // _SMALL))
    codes = torch.from_numpy(raw[:, 2:].copy().view(np.int8).reshape(rows, columns))
    return w8a8.layout(codes, d.float(), torch.zeros(rows, columns // _SMALL))


def _five_bit_codes(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """A Q5_0 or Q5_1 block's 32 codes (0..31) from its 4 high-bit bytes (bit j of the little-endian word: weight
    j's fifth bit) and 16 low-nibble bytes (as Q4_0's)."""
    high = qh.copy().view("<u4").reshape(-1, 1) >> np.arange(_SMALL, dtype=np.uint32).reshape(1, _SMALL)
    return _nibbles(qs, len(qs)) | ((high & 1).astype(np.uint8) << 4)


def q5_0_to_int8a8(blocks: np.ndarray, rows: int, columns: int) -> w8a8.EightBitWeights:
    """A Q5_0 tensor's raw bytes [rows, columns / 32 * 22] (fp16 d, weight = d * (code - 16)) as 8-bit groups: codes
    - 16, d as the scale, no minimum."""
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows * (columns // _SMALL), 22)
    d = torch.from_numpy(raw[:, 0:2].copy().view(np.float16).reshape(rows, columns // _SMALL))
    codes = _five_bit_codes(raw[:, 2:6], raw[:, 6:]).astype(np.int8) - np.int8(16)
    return w8a8.layout(torch.from_numpy(codes.reshape(rows, columns)), d.float(), torch.zeros(rows, columns // _SMALL))


def q5_1_to_int8a8(blocks: np.ndarray, rows: int, columns: int) -> w8a8.EightBitWeights:
    """A Q5_1 tensor's raw bytes [rows, columns / 32 * 24] (fp16 d and m, weight = d * code + m) as 8-bit groups:
    its codes, d and m as they are."""
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows * (columns // _SMALL), 24)
    d = torch.from_numpy(raw[:, 0:2].copy().view(np.float16).reshape(rows, columns // _SMALL))
    m = torch.from_numpy(raw[:, 2:4].copy().view(np.float16).reshape(rows, columns // _SMALL))
    codes = _five_bit_codes(raw[:, 4:8], raw[:, 8:]).astype(np.int8)
    return w8a8.layout(torch.from_numpy(codes.reshape(rows, columns)), d.float(), m.float())


def q5k_to_int8a8(blocks: np.ndarray, rows: int, columns: int) -> w8a8.EightBitWeights:
    """A Q5_K tensor's raw bytes [rows, columns / 256 * 176] as 8-bit groups of 32: its 5-bit codes as bytes, each
    group's d * sc and -dmin * m in float32 (exact: an fp16 times a 6-bit integer). Code bytes as Q4_K's; byte l of
    the 32 fifth-bit bytes holds, in bit j, the top bit of weight 32j + l."""
    from gguf.quants import Q4_K

    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows * (columns // _SUPER), _BYTES5)
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(raw[:, 4:16])  # the same 6-bit scales and minimums as Q4_K's
    scale = (d * sc.astype(np.float32)).reshape(rows, columns // w8a8.GROUP)
    low = (-dmin * m.astype(np.float32)).reshape(rows, columns // w8a8.GROUP)
    chunks = raw[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    top = raw[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    codes = (chunks & 15).reshape(-1, _SUPER) | (top & 1).reshape(-1, _SUPER) << 4
    return w8a8.layout(torch.from_numpy(codes.reshape(rows, columns)), torch.from_numpy(scale), torch.from_numpy(low))


def repack(library: Library, function: str, empty: Callable[[int, int, str], Any], blocks: np.ndarray, rows: int,
           columns: int) -> Any:  # fmt: skip
    """A tensor's raw blocks [rows, bytes] rearranged by the C repacker's `function` (kernels/repack.c) into the
    tensors `empty(rows, columns, "cpu")` lays out (the format's weights, as the numpy conversion makes them)."""
    out = empty(rows, columns, "cpu")
    source = np.ascontiguousarray(blocks, dtype=np.uint8)
    pointer = ffi().cast("const uint8_t *", source.ctypes.data)
    threads = max(1, torch.get_num_threads())
    call = getattr(library.lib, function)
    if call(pointer, rows, columns, *(address(tensor) for tensor in out.tensors()), threads) != OK:
        raise ValueError(f"the repacker does not take a tensor of {columns} columns")
    return out
