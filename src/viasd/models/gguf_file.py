"""A GGUF file's index: its scalar metadata and where each tensor's blocks lie, read in a fraction of a second.

gguf-py's `GGUFReader` builds an array view for every element of every metadata array (a 152k-token vocabulary and
its merges): about 10 s per start-up on a 2-core CPU for the default models. Start-up needs only the scalars (the
architecture, sizes, alignment) and the tensors' names, types, shapes and offsets, so this reader steps over arrays
without building anything and maps the file once (read-only, as llama.cpp does): a tensor's blocks are a view of the
mapping, paged in when read. gguf-py still names the types and their block sizes (`GGMLQuantizationType`,
`GGML_QUANT_SIZES`) and dequantizes blocks.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from viasd.errors import ViasdError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# Scalar value types: struct format by GGUF value type (8: string, 9: array are read apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_SHORT_ARRAY = 64  # arrays up to this many scalars are kept (per-layer head counts); longer ones are stepped over


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: its GGML type's name, its shape as torch writes it ([rows, columns] for a matrix) and
    the absolute offset and size of its bytes."""

    name: str
    kind: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1

    @property
    def columns(self) -> int:
        return self.shape[-1]


class GgufError(ViasdError):
    """A file that is no GGUF file viasd reads; `reason` says why, without the file's name."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.reason = reason


_LENGTH = struct.Struct("<Q")  # a string's length, before its bytes


class _Cursor:
    """Reads little-endian values from a buffer, refusing to run past its end (a truncated file)."""

    def __init__(self, buffer: memoryview, path: Path) -> None:
        self.buffer, self.at, self.path = buffer, 0, path

    def take(self, fmt: str) -> int | float | bool:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buffer):
            raise GgufError(self.path, "not a whole GGUF file: its header ends early")
        (value,) = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += size
        return value

    def text(self) -> str:
        length = int(self.take("<Q"))
        if self.at + length > len(self.buffer):
            raise GgufError(self.path, "not a whole GGUF file: its header ends early")
        raw = bytes(self.buffer[self.at : self.at + length])
        self.at += length
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        # A vocabulary is some 150,000 strings: read their lengths with one bound unpacker, not `take` each (3x).
        unpack, buffer, at, end = _LENGTH.unpack_from, self.buffer, self.at, len(self.buffer) - 8
        for _ in range(count):
            if at > end:
                raise GgufError(self.path, "not a whole GGUF file: its header ends early")
            at += 8 + unpack(buffer, at)[0]
        self.at = at
        if self.at > len(self.buffer):
            raise GgufError(self.path, "not a whole GGUF file: its header ends early")

    def value(self, kind: int) -> object:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.text()
        if kind == _ARRAY:
            item, count = int(self.take("<I")), int(self.take("<Q"))
            if item == _STRING:
                self.skip_strings(count)
                return None
            if item not in _SCALARS:
                raise GgufError(self.path, f"a metadata array of unknown type {item}")
            size = struct.calcsize(_SCALARS[item])
            if count <= _SHORT_ARRAY:
                return [self.take(_SCALARS[item]) for _ in range(count)]
            self.at += size * count
            return None
        raise GgufError(self.path, f"a metadata value of unknown type {kind}")


class GgufFile:
    """A GGUF file mapped read-only: `metadata` (scalars, short arrays; long arrays as None) and `tensors` by name."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as error:
            raise GgufError(self.path, f"cannot be read ({error})") from error
        cursor = _Cursor(memoryview(self._map), self.path)  # type: ignore[arg-type]
        if bytes(self._map[:4]) != _MAGIC:
            raise GgufError(self.path, "not a GGUF file (it does not start with 'GGUF')")
        cursor.at = 4
        version = int(cursor.take("<I"))
        if version not in (2, 3):
            raise GgufError(self.path, f"GGUF version {version}, which viasd does not read (2 or 3)")
        count, keys = int(cursor.take("<Q")), int(cursor.take("<Q"))
        self.metadata: dict[str, object] = {}
        for _ in range(keys):
            key = cursor.text()
            self.metadata[key] = cursor.value(int(cursor.take("<I")))
        infos = []
        for _ in range(count):
            name = cursor.text()
            dims = [int(cursor.take("<Q")) for _ in range(int(cursor.take("<I")))]
            kind, offset = int(cursor.take("<I")), int(cursor.take("<Q"))
            infos.append((name, dims, kind, offset))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT) or _DEFAULT_ALIGNMENT)  # type: ignore[call-overload]
        start = -(-cursor.at // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, kind, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(kind)
            except ValueError:
                raise GgufError(self.path, f"tensor {name} has a type viasd does not know ({kind})") from None
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            shape = tuple(reversed(dims))  # GGUF lists the fastest-moving dimension first
            if shape[-1] % block:
                raise GgufError(self.path, f"tensor {name}'s rows are no whole number of {qtype.name} blocks")
            nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * size
            info = TensorInfo(name, qtype.name, shape, start + offset, nbytes)
            if info.offset + nbytes > len(self._map):
                raise GgufError(
                    self.path, f"not a whole GGUF file: tensor {name} runs past its end ({len(self._map):,} bytes)"
                )
            self.tensors[name] = info

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def number(self, key: str) -> int | None:
        """An integer field of the architecture's (`block_count` is `<arch>.block_count`), or None."""
        value = self.metadata.get(f"{self.architecture}.{key}")
        if isinstance(value, list):  # per-layer values: the first layer's
            value = value[0] if value else None
        return None if value is None else int(value)  # type: ignore[call-overload]

    def blocks(self, name: str) -> np.ndarray:
        """Tensor `name`'s bytes as [rows, bytes per row] (a view of the mapping: nothing is read until used)."""
        info = self.tensors[name]
        data = self._map[info.offset : info.offset + info.nbytes]
        return data.reshape(info.rows, -1)

    def rows(self, name: str, index: np.ndarray) -> np.ndarray:
        """Rows `index` of tensor `name`'s bytes [len(index), bytes per row], read with pread: a mapping would map
        the pages around every row it touches (the kernel's fault-around, 64 KB), so sampling a few rows of every
        tensor (a fingerprint) or looking up a prompt's embeddings would count most of the file in the process's
        memory."""
        info = self.tensors[name]
        width = info.nbytes // info.rows
        rows = np.asarray(index, dtype=np.int64).reshape(-1)
        if (
            len(rows)
            and rows[0] >= 0
            and rows[-1] < info.rows
            and np.array_equal(rows, np.arange(rows[0], rows[-1] + 1))
        ):
            with open(self.path, "rb", buffering=0) as handle:  # a run of rows: one read
                data = os.pread(handle.fileno(), width * len(rows), info.offset + int(rows[0]) * width)
            return np.frombuffer(data, dtype=np.uint8).reshape(len(rows), width).copy()
        out = np.empty((len(index), width), dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as handle:
            descriptor = handle.fileno()
            for at, row in enumerate(np.asarray(index, dtype=np.int64).tolist()):
                if not 0 <= row < info.rows:
                    raise IndexError(f"row {row} of {name}, which has {info.rows}")
                out[at] = np.frombuffer(os.pread(descriptor, width, info.offset + row * width), dtype=np.uint8)
        return out

    def release(self, name: str | None = None) -> None:
        """Unmap the pages of tensor `name` (None: of the whole file) read so far; they stay in the page cache. Its
        blocks were taken into a view's layout, and the process should not count them as its memory twice (an 8B
        model's first view took 12.6 GB at its peak with every page of the file still mapped)."""
        mapping = getattr(self._map, "_mmap", None)
        if mapping is None or not hasattr(mapping, "madvise"):
            return
        if name is None:
            mapping.madvise(mmap.MADV_DONTNEED)
            return
        info = self.tensors[name]
        start = info.offset // mmap.PAGESIZE * mmap.PAGESIZE  # whole pages inside the tensor's bytes
        end = (info.offset + info.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

    def types(self) -> set[str]:
        """The GGML type names of its tensors."""
        return {info.kind for info in self.tensors.values()}
