"""A GGUF file's own quantized blocks as viasd's low-bit weights, so that a model converted from a GGUF file
computes on the file's numbers rather than on a second rounding of its dequantized weights.

Which format takes which block type is the table's (kernels/formats.py), and how each type's blocks become the
format's weights is kernels/gguf_blocks.py's (each exactly, unless said there). Tensors the file stores otherwise are
quantized from the dense weights (int8 weight-only: see the `gguf` recipe, views/recipe.py). Each tensor is checked
against the model's own weight before use, so a file of another model, or a conversion that reordered a tensor, is
not taken.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from viasd.kernels import formats, gguf_blocks, w4a8, w6a8, w8a8
from viasd.kernels.build import Library, checked
from viasd.kernels.gguf_blocks import q4_0_to_int4a8 as q4_0_to_int4a8
from viasd.kernels.gguf_blocks import q4_1_to_int4a8 as q4_1_to_int4a8
from viasd.kernels.gguf_blocks import q4k_to_int4a8 as q4k_to_int4a8
from viasd.kernels.gguf_blocks import q5_0_to_int8a8 as q5_0_to_int8a8
from viasd.kernels.gguf_blocks import q5_1_to_int8a8 as q5_1_to_int8a8
from viasd.kernels.gguf_blocks import q5k_to_int8a8 as q5k_to_int8a8
from viasd.kernels.gguf_blocks import q6k_to_int6a8 as q6k_to_int6a8
from viasd.kernels.gguf_blocks import q8_0_to_int8a8 as q8_0_to_int8a8
from viasd.models.stored import unpermuted as _unpermuted
from viasd.views.recipe import QuantRecipe

# The GGML types whose blocks one of viasd's kernels takes (in the order a tensor's weights are looked for).
KERNEL_TYPES = formats.KERNEL_TYPES
# Types that are no quantization of their own: a file of only these has no view to take over.
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
# Largest relative (Frobenius) difference between a tensor's dequantized blocks and the model's weight for the
# two to count as the same: bf16 rounding leaves about 0.002; another tensor or layout differs by about 1.
_SAME = 0.01
# Per GGML type: how a tensor's raw bytes [rows, blocks * block bytes] become its format's weights (the table's).
_CONVERTERS = {blocks.name: blocks.convert for f in formats.FORMATS for blocks in f.blocks}
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


def _repacked(library: Library, blocks: np.ndarray, rows: int, columns: int, kind: str) -> OwnWeights:
    """A tensor's blocks of GGML type `kind` (one of REPACKED_TYPES) as `converted` makes them, by the C repacker."""
    taken, found = formats.blocks_of(kind), formats.taking(kind)
    assert taken is not None and taken.repack is not None and found.empty is not None
    return gguf_blocks.repack(library, taken.repack, found.empty, blocks, rows, columns)


# Per type the C repacker takes: its call (`_repacked`), as the numpy conversion's in `_CONVERTERS`.
_REPACKED: dict[str, Callable[[Library, np.ndarray, int, int], OwnWeights]] = {
    kind: functools.partial(_repacked, kind=kind) for kind in formats.REPACKED_TYPES
}
REPACKED_TYPES = formats.REPACKED_TYPES  # the block types the C repacker rearranges


def _repack_check(library: Library) -> str | None:
    """Why the C repacker's tiles are not the numpy converters' on random blocks (finite scales), or None."""
    import gguf

    generator = np.random.default_rng(0)
    rows, columns = 40, 512  # a partial last tile, two blocks a row
    for kind in (kind for kind in KERNEL_TYPES if kind in REPACKED_TYPES):
        weights, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]  # per block: weights, bytes
        at, count = formats.blocks_of(kind).scales  # type: ignore[union-attr]  # where its fp16 scales lie, how many
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
        return self.own(module, weight, formats.INT4A8.types)  # type: ignore[return-value]

    def int6a8(self, module: str, weight: torch.Tensor) -> w6a8.SixBitWeights | None:
        """Module `module`'s 6-bit weights from the file's Q6_K blocks, or None (as `own`)."""
        return self.own(module, weight, formats.INT6A8.types)  # type: ignore[return-value]


def _dequantize(weights: OwnWeights) -> torch.Tensor:
    return formats.of_weights(weights).dequantize(weights)  # type: ignore[union-attr, misc]


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
