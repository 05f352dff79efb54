"""A GGUF file's own 4-bit blocks as int4a8 weights, so that a model converted from a Q4_K GGUF computes on them.

A Q4_K super-block holds 256 weights of one row: an fp16 scale d and minimum dmin, eight 6-bit sub-block scales sc_j
and minimums m_j, and 128 bytes of 4-bit codes, with weight = d * sc_j * code - dmin * m_j in sub-block j of 32
inputs. That is int4a8's format (kernels/w4a8.py): groups of 32 with a scale and a minimum. The view takes the codes
as they are (laid out in the kernel's tiles) and multiplies out each group's scale and minimum (rounded to fp16,
finer than the bf16 rounding of the dense model's copy of the same weights). Re-quantizing the dense weights instead
would round them a second time, onto another grid.

Q4_K_M keeps its most sensitive tensors at 6 bits, as Q6_K: per super-block of 256 an fp16 scale d, per sub-block
of 16 an int8 scale s_j, and 6-bit codes q with weight = d * s_j * (q - 32). Those are taken as they are too, laid
out for the 6-bit kernel (kernels/w6a8.py). Layers the file stores otherwise are quantized from the dense weights
(int8 weight-only: see the `gguf` recipe, views/recipe.py). Each tensor is checked against the model's own
weight before use, so a file of another model, or a conversion that reordered a tensor, is not taken.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from viasd.kernels import w4a8, w6a8
from viasd.views.recipe import QuantRecipe

_SUPER = 256  # weights per Q4_K or Q6_K block
_BYTES = 144  # a Q4_K block's size: d, dmin (fp16 each), 12 bytes of 6-bit scales and minimums, 128 bytes of codes
_BYTES6 = 210  # a Q6_K block's: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d (fp16)
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


class GgufWeights:
    """The Q4_K and Q6_K tensors of a GGUF file, by the Hugging Face module names of the model converted from it."""

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

    def _blocks(self, module: str, weight: torch.Tensor, kind: str, size: int) -> np.ndarray | None:
        """The raw blocks of module `module`'s weight [out, in] where the file stores it as `kind` (a GGML type
        name) in blocks of `size` bytes per 256 inputs; None where it does not."""
        import gguf

        if self._names is None:
            return None
        name = self._names.get_name(module)
        tensor = self._tensors.get(f"{name}.weight") if name else None
        if tensor is None or tensor.tensor_type != gguf.GGMLQuantizationType[kind]:
            return None
        rows, columns = weight.shape
        if columns % _SUPER or tuple(tensor.data.shape) != (rows, columns // _SUPER * size):
            return None
        return tensor.data

    def int4a8(self, module: str, weight: torch.Tensor) -> w4a8.FourBitWeights | None:
        """Module `module`'s int4a8 tensors from the file's Q4_K blocks, or None: the file has no such Q4_K
        tensor, or its blocks are not `weight` [out, in] (another model, or a layout the conversion changed)."""
        blocks = self._blocks(module, weight, "Q4_K", _BYTES)
        if blocks is None:
            return None
        four = q4k_to_int4a8(blocks, *weight.shape)
        return four if _same(w4a8.dequantize(four), weight) else None

    def int6a8(self, module: str, weight: torch.Tensor) -> w6a8.SixBitWeights | None:
        """Module `module`'s 6-bit weights from the file's Q6_K blocks, or None (as `int4a8`)."""
        blocks = self._blocks(module, weight, "Q6_K", _BYTES6)
        if blocks is None:
            return None
        six = q6k_to_int6a8(blocks, *weight.shape)
        return six if _same(w6a8.dequantize(six), weight) else None


def _same(blocks: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a file's dequantized blocks are the model's `weight` (up to the dense copy's rounding)."""
    dense = weight.detach().float().cpu()
    return float((blocks - dense).norm() / dense.norm().clamp_min(1e-12)) < _SAME


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
    import gguf

    try:
        reader = gguf.GGUFReader(location)
    except (OSError, ValueError):
        return None
    return frozenset(gguf.GGMLQuantizationType(tensor.tensor_type).name for tensor in reader.tensors)


def has_q4k_blocks(name: str, path: str) -> bool:
    """Whether the model's source GGUF file is at hand (nothing is fetched) and stores some tensor as Q4_K, so that
    its `gguf` view takes blocks from it."""
    location = _at_hand(name, path)
    return location is not None and "Q4_K" in (_tensor_types(location) or set())


def stored_view(name: str, path: str) -> tuple[QuantRecipe | None, str | None]:
    """What a model (its spec `name`, its `path`; before loading, the spec for both) runs as by default: as its GGUF
    file stores it, the `gguf` view, where it comes from a GGUF file with Q4_K tensors; else as loaded (None). The
    second value is one line saying why a model from a GGUF file runs as its dense copy instead (None: it does not).
    Only the file's header is read, and nothing is fetched."""
    from viasd.models.catalog import find_default_model
    from viasd.models.fetch import repair_command

    location = _at_hand(name, path)
    if location is None:
        if find_default_model(name) is None:
            return None, None  # not from a GGUF file: as loaded
        return None, (
            f"{name}'s GGUF file is not in the cache, so it runs as its dense copy, dequantized from the file "
            f"(`{repair_command(name)}` keeps the file for its 4-bit view)"
        )
    types = _tensor_types(location)
    if types is None:
        return None, f"cannot read the tensor types of {location}; running its dense copy, as loaded"
    if "Q4_K" in types:
        return QuantRecipe.parse("gguf"), None
    stored = ", ".join(sorted(types - {"F32", "F16", "BF16"})) or ", ".join(sorted(types))
    return None, (
        f"{location.name} stores its weights as {stored}, of which viasd has no 4-bit view (it takes Q4_K and Q6_K "
        "blocks): running its dense copy, dequantized from the file (--quant int4a8 quantizes that copy to 4 bits)"
    )
