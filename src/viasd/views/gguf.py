"""A GGUF file's own quantized blocks as viasd's low-bit weights, so that a model converted from a GGUF file
computes on the file's numbers rather than on a second rounding of its dequantized weights.

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

Tensors the file stores otherwise are quantized from the dense weights (int8 weight-only: see the `gguf` recipe,
views/recipe.py). Each tensor is checked against the model's own weight before use, so a file of another model, or
a conversion that reordered a tensor, is not taken.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from viasd.kernels import w4a8, w6a8, w8a8
from viasd.kernels.build import Library, address, checked, ffi
from viasd.kernels.interface import OK
from viasd.models.stored import unpermuted as _unpermuted
from viasd.views.recipe import QuantRecipe

_SUPER = 256  # weights per Q4_K, Q5_K or Q6_K block
_BYTES = 144  # a Q4_K block's size: d, dmin (fp16 each), 12 bytes of 6-bit scales and minimums, 128 bytes of codes
_BYTES5 = 176  # a Q5_K block's: Q4_K's d, dmin and scales, 32 bytes of fifth bits, 128 bytes of low nibbles
_BYTES6 = 210  # a Q6_K block's: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d (fp16)
_SMALL = 32  # weights per Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 block
# The GGML types whose blocks one of viasd's kernels takes (in the order a tensor's weights are looked for).
KERNEL_TYPES = ("Q4_K", "Q4_0", "Q4_1", "Q6_K", "Q8_0", "Q5_K", "Q5_0", "Q5_1")
# Types that are no quantization of their own: a file of only these has no view to take over.
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
# Largest relative (Frobenius) difference between a tensor's dequantized blocks and the model's weight for the
# two to count as the same: bf16 rounding leaves about 0.002; another tensor or layout differs by about 1.
_SAME = 0.01


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


# Per GGML type: the kernel's format and how a tensor's raw bytes [rows, blocks * block bytes] become its weights.
_CONVERTERS = {
    "Q4_K": q4k_to_int4a8,
    "Q4_0": q4_0_to_int4a8,
    "Q4_1": q4_1_to_int4a8,
    "Q6_K": q6k_to_int6a8,
    "Q8_0": q8_0_to_int8a8,
    "Q5_K": q5k_to_int8a8,
    "Q5_0": q5_0_to_int8a8,
    "Q5_1": q5_1_to_int8a8,
}
OwnWeights = w4a8.FourBitWeights | w6a8.SixBitWeights | w8a8.EightBitWeights


# Rows converted at a time (whole tiles): the conversions' temporaries are several bytes per weight, which for an 8B
# model's output head (545M weights) would be gigabytes at once.
_CHUNK_ROWS = 4096


def converted(kind: str, blocks: np.ndarray, rows: int, columns: int) -> OwnWeights | None:
    """A tensor's raw blocks of GGML type `kind` [rows, bytes] in the format of the kernel that takes them: by the C
    repacker where it is built and takes the type (REPACKED_TYPES), else converted a chunk of rows at a time; None
    where no kernel takes the type (or a Q4_0 block's minimum leaves fp16)."""
    convert = _CONVERTERS.get(kind)
    if convert is None:
        return None
    if kind in _REPACKED and fast_repacking():
        return _REPACKED[kind](repacker(), blocks, rows, columns)  # type: ignore[arg-type]
    if rows <= _CHUNK_ROWS:
        return convert(blocks, rows, columns)
    parts = []
    for begin in range(0, rows, _CHUNK_ROWS):
        count = min(_CHUNK_ROWS, rows - begin)
        part = convert(np.asarray(blocks[begin : begin + count]), count, columns)
        if part is None:
            return None
        parts.append(part)
    joined = [torch.cat(tensors) for tensors in zip(*(part.tensors() for part in parts), strict=True)]
    return type(parts[0])(*joined, rows)  # type: ignore[arg-type]


def _repack_q4k(library: Library, blocks: np.ndarray, rows: int, columns: int) -> w4a8.FourBitWeights:
    """`q4k_to_int4a8` by the C repacker (kernels/repack.c)."""
    tiles = -(-rows // w4a8.TILE)
    packed = torch.empty(tiles, columns // 8, 4 * w4a8.TILE, dtype=torch.uint8)
    scale, low = (torch.empty(tiles, columns // w4a8.GROUP, w4a8.TILE, dtype=torch.float16) for _ in range(2))
    _call(library.lib.q4k_repack, blocks, rows, columns, packed, scale, low)
    return w4a8.FourBitWeights(packed, scale, low, rows)


def _repack_q6k(library: Library, blocks: np.ndarray, rows: int, columns: int) -> w6a8.SixBitWeights:
    """`q6k_to_int6a8` by the C repacker (kernels/repack.c)."""
    tiles = -(-rows // w6a8.TILE)
    low = torch.empty(tiles, columns // 8, 4 * w6a8.TILE, dtype=torch.uint8)
    high = torch.empty(tiles, columns // w6a8.SUB, 4 * w6a8.TILE, dtype=torch.uint8)
    sub = torch.empty(tiles, columns // w6a8.SUB, w6a8.TILE, dtype=torch.int8)
    d = torch.empty(tiles, columns // w6a8.SUPER, w6a8.TILE, dtype=torch.float16)
    _call(library.lib.q6k_repack, blocks, rows, columns, low, high, sub, d)
    return w6a8.SixBitWeights(low, high, sub, d, rows)


def _repack_small(library: Library, blocks: np.ndarray, rows: int, columns: int, kind: str) -> w8a8.EightBitWeights:
    """`q8_0_to_int8a8` or `q5_0_to_int8a8` by the C repacker (kernels/repack.c)."""
    tiles = -(-rows // w8a8.TILE)
    codes = torch.empty(tiles, columns // 4, 4 * w8a8.TILE, dtype=torch.int8)
    scale, low = (torch.empty(tiles, columns // w8a8.GROUP, w8a8.TILE, dtype=torch.float32) for _ in range(2))
    function = library.lib.q8_0_repack if kind == "Q8_0" else library.lib.q5_0_repack
    _call(function, blocks, rows, columns, codes, scale, low)
    return w8a8.EightBitWeights(codes, scale, low, rows)


def _call(function: Callable[..., int], blocks: np.ndarray, rows: int, columns: int, *out: torch.Tensor) -> None:
    source = np.ascontiguousarray(blocks, dtype=np.uint8)
    pointer = ffi().cast("const uint8_t *", source.ctypes.data)
    threads = max(1, torch.get_num_threads())
    if function(pointer, rows, columns, *(address(tensor) for tensor in out), threads) != OK:
        raise ValueError(f"the repacker does not take a tensor of {columns} columns")


_REPACKED: dict[str, Callable[[Library, np.ndarray, int, int], OwnWeights]] = {
    "Q4_K": _repack_q4k,
    "Q6_K": _repack_q6k,
    "Q8_0": functools.partial(_repack_small, kind="Q8_0"),
    "Q5_0": functools.partial(_repack_small, kind="Q5_0"),
}
REPACKED_TYPES = frozenset(_REPACKED)  # the block types the C repacker rearranges


def _repack_check(library: Library) -> str | None:
    """Why the C repacker's tiles are not the numpy converters' on random blocks (finite scales), or None."""
    generator = np.random.default_rng(0)
    rows, columns = 40, 512  # a partial last tile, two blocks a row
    # Per type: block bytes, weights per block, where its fp16 scales lie and how many (Q4_K: d and dmin).
    for kind, size, weights, at, count in (("Q4_K", _BYTES, _SUPER, 0, 2), ("Q6_K", _BYTES6, _SUPER, 208, 1),
                                           ("Q8_0", 34, _SMALL, 0, 1), ("Q5_0", 22, _SMALL, 0, 1)):  # fmt: skip
        raw = generator.integers(0, 256, (rows, columns // weights * size), dtype=np.uint8)
        scales = generator.uniform(1e-4, 1e-2, (rows, columns // weights, count)).astype(np.float16)
        raw.reshape(rows, columns // weights, size)[:, :, at : at + 2 * count] = scales.view(np.uint8)  # finite
        expected = _CONVERTERS[kind](raw, rows, columns)
        found = _REPACKED[kind](library, raw, rows, columns)
        if expected is None or not all(
            torch.equal(a, b) for a, b in zip(expected.tensors(), found.tensors(), strict=True)
        ):
            return f"rearranges {kind} blocks otherwise than the numpy conversion"
    return None


@functools.cache
def repacker() -> Library | str:
    """The C repacker, checked once per process, or why it is not used (one line)."""
    return checked("GGUF repacking", _repack_check)


def fast_repacking() -> bool:
    """Whether REPACKED_TYPES are rearranged by the C repacker (a 1.5B model's view in 0.35 s on 2 cores, against
    some 12 s of numpy), so that a stored model's view is made at each start rather than cached."""
    return isinstance(repacker(), Library)


class GgufWeights:
    """The tensors of a GGUF file in block types viasd's kernels take (KERNEL_TYPES), by the Hugging Face module
    names of the model converted from it."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path
        reader = gguf.GGUFReader(path)
        self._tensors = {tensor.name: tensor for tensor in reader.tensors}
        arch_name = _field_text(reader, "general.architecture")
        archs = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
        blocks = reader.fields.get(f"{arch_name}.block_count")
        if arch_name not in archs or blocks is None:
            self._names = None
        else:
            count = int(blocks.parts[blocks.data[0]][0])
            self._names = gguf.get_tensor_name_map(archs[arch_name], count)
        heads = _field_int(reader, f"{arch_name}.attention.head_count")
        # Query and key projections' heads, for rows a conversion to GGUF reordered (`_unpermuted`).
        self._heads = {"q_proj": heads, "k_proj": _field_int(reader, f"{arch_name}.attention.head_count_kv") or heads}

    def stored_type(self, module: str) -> str | None:
        """The GGML type name the file stores module `module`'s weight as, or None where it has no such tensor. A
        model whose head is its embedding (tied) finds the head as the file's embedding, which is where a file
        without an output tensor keeps it."""
        import gguf

        tensor = self._tensor(module)
        return None if tensor is None else gguf.GGMLQuantizationType(tensor.tensor_type).name

    def _tensor(self, module: str) -> object | None:
        if self._names is None:
            return None
        name = self._names.get_name(module)
        tensor = self._tensors.get(f"{name}.weight") if name else None
        if tensor is None and name == "output":
            tensor = self._tensors.get("token_embd.weight")  # a tied head; `_same` refuses it where it is not
        return tensor

    def own(self, module: str, weight: torch.Tensor, kinds: tuple[str, ...] = KERNEL_TYPES) -> OwnWeights | None:
        """Module `module`'s weights from the file's own blocks for one of viasd's kernels, or None: the file does
        not store it as one of `kinds`, or its blocks are not `weight` [out, in] (another model, or a layout the
        conversion changed)."""
        import gguf

        kind = self.stored_type(module)
        if kind not in kinds:
            return None
        tensor = self._tensor(module)
        size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        rows, columns = weight.shape
        if columns % size or tuple(tensor.data.shape) != (rows, columns // size * type_size):  # type: ignore[attr-defined]
            return None
        raw = tensor.data  # type: ignore[attr-defined]
        found = _CONVERTERS[kind](raw, rows, columns)
        if found is not None and _same(_dequantize(found), weight):
            return found
        heads = self._heads.get(module.rsplit(".", 1)[-1])
        if found is None or not heads or rows % (2 * heads):
            return None
        found = _CONVERTERS[kind](_unpermuted(raw, heads), rows, columns)
        return found if found is not None and _same(_dequantize(found), weight) else None

    def int4a8(self, module: str, weight: torch.Tensor) -> w4a8.FourBitWeights | None:
        """Module `module`'s int4a8 tensors from the file's Q4_K, Q4_0 or Q4_1 blocks, or None (as `own`)."""
        return self.own(module, weight, ("Q4_K", "Q4_0", "Q4_1"))  # type: ignore[return-value]

    def int6a8(self, module: str, weight: torch.Tensor) -> w6a8.SixBitWeights | None:
        """Module `module`'s 6-bit weights from the file's Q6_K blocks, or None (as `own`)."""
        return self.own(module, weight, ("Q6_K",))  # type: ignore[return-value]


def _dequantize(weights: OwnWeights) -> torch.Tensor:
    if isinstance(weights, w4a8.FourBitWeights):
        return w4a8.dequantize(weights)
    if isinstance(weights, w6a8.SixBitWeights):
        return w6a8.dequantize(weights)
    return w8a8.dequantize(weights)


def _same(blocks: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a file's dequantized blocks are the model's `weight` (up to the dense copy's rounding)."""
    dense = weight.detach().float().cpu()
    return float((blocks - dense).norm() / dense.norm().clamp_min(1e-12)) < _SAME


def _field_int(reader: object, key: str) -> int | None:
    field = reader.fields.get(key)  # type: ignore[attr-defined]
    return None if field is None else int(field.parts[field.data[0]][0])


def _field_text(reader: object, key: str) -> str:
    field = reader.fields.get(key)  # type: ignore[attr-defined]
    if field is None:
        return ""
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def source_gguf(name: str, path: str) -> Path | None:
    """The GGUF file a loaded model (its spec `name`, its `path`) came from: a default model's verified file
    (shelved in the cache when it was converted, else assembled once), or the .gguf file it was loaded from;
    None for a model that never was a GGUF file."""
    from viasd.models.catalog import find_default_model
    from viasd.models.fetch import ensure_default_gguf

    if find_default_model(name) is not None:
        return ensure_default_gguf(name)
    location = Path(path)
    return location if location.is_file() and location.suffix.lower() == ".gguf" else None


def _at_hand(name: str, path: str) -> Path | None:
    """The model's source GGUF file where it is at hand (nothing is fetched): a default model's shelved file, or the
    .gguf file it was loaded from; None otherwise."""
    from viasd.models.catalog import find_default_model
    from viasd.models.fetch import default_cache_dir

    entry = find_default_model(name)
    location = default_cache_dir() / "gguf" / entry.gguf_filename if entry is not None else Path(path)
    return location if location.is_file() and location.suffix.lower() == ".gguf" else None


def _tensor_types(location: Path) -> set[str] | None:
    """The GGML type names of a GGUF file's tensors, or None where it cannot be read (its header read once per
    file, size and modification time: a start-up asks twice, for the default target and for `auto`)."""
    try:
        stat = location.stat()
    except OSError:
        return None
    types = _read_tensor_types(str(location), stat.st_size, stat.st_mtime_ns)
    return set(types) if types is not None else None


@functools.lru_cache(maxsize=8)
def _read_tensor_types(location: str, size: int, mtime_ns: int) -> frozenset[str] | None:
    """The types, from viasd's cache where an earlier run recorded them for this file, size and time, else from the
    header (gguf's reader parses every metadata field, the whole vocabulary included: seconds per start-up)."""
    import gguf

    from viasd.cache import cache_folder
    from viasd.fileio import write_atomic

    key = hashlib.sha256(f"{location}\0{size}\0{mtime_ns}".encode()).hexdigest()[:32]
    record = cache_folder("gguf-types") / f"{key}.json"
    try:
        known = json.loads(record.read_text())
        if isinstance(known, list) and all(isinstance(name, str) for name in known):
            return frozenset(known)
    except (OSError, ValueError):
        pass  # not recorded yet, or a damaged record: read the header
    try:
        reader = gguf.GGUFReader(location)
    except (OSError, ValueError):
        return None
    types = frozenset(gguf.GGMLQuantizationType(tensor.tensor_type).name for tensor in reader.tensors)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(record, json.dumps(sorted(types)))
    except OSError:
        pass  # an unwritable cache: the header is read again next time, nothing else changes
    return types


def has_own_blocks(name: str, path: str) -> bool:
    """Whether the model's source GGUF file is at hand (nothing is fetched) and stores some tensor in a block type
    one of viasd's kernels takes (KERNEL_TYPES), so that its `gguf` view takes blocks from it."""
    location = _at_hand(name, path)
    return location is not None and bool(set(KERNEL_TYPES) & (_tensor_types(location) or set()))


def stored_view(name: str, path: str) -> tuple[QuantRecipe | None, str | None]:
    """What a model (its spec `name`, its `path`; before loading, the spec for both) runs as by default: as its GGUF
    file stores it, the `gguf` view, where it comes from a GGUF file with tensors in block types viasd's kernels
    take; else as loaded (None). The second value is one line to say, or None: why a model from a GGUF file runs as
    its dense copy instead, or which of its file's block types run as int8 weight-only in its `gguf` view (those no
    kernel takes). Only the file's header is read, and nothing is fetched."""
    from viasd.models.catalog import find_default_model
    from viasd.models.fetch import repair_command

    location = _at_hand(name, path)
    if location is None:
        if find_default_model(name) is None:
            return None, None  # not from a GGUF file: as loaded
        return None, (
            f"{name}'s GGUF file is not in the cache, so it runs as its dense copy, dequantized from the file "
            f"(`{repair_command(name)}` keeps the file for its own-blocks view)"
        )
    types = _tensor_types(location)
    if types is None:
        return None, f"cannot read the tensor types of {location}; running its dense copy, as loaded"
    others = ", ".join(sorted(types - FLOAT_TYPES - set(KERNEL_TYPES)))
    if set(KERNEL_TYPES) & types:
        note = None
        if others:
            note = (
                f"{location.name}'s {others} tensors run as int8 weight-only (viasd has no kernel for {others}; "
                f"it takes {', '.join(KERNEL_TYPES)})"
            )
        return QuantRecipe.parse("gguf"), note
    stored = others or ", ".join(sorted(types))
    return None, (
        f"{location.name} stores its weights as {stored}, of which viasd has no kernel (it takes "
        f"{', '.join(KERNEL_TYPES)} blocks): running its dense copy, dequantized from the file (--quant int4a8 "
        "quantizes that copy to 4 bits)"
    )
