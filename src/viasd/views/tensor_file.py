"""Tensors as a safetensors file laid out for memory-mapped reads: its data starts at a 64-byte boundary and the
tensors whose sizes are whole multiples of 64 bytes (in practice every tensor of a quantized copy) come first, so
that safetensors' reader, which maps the file, hands each of them out at an address as aligned as torch's own
allocations: what torch's CPU kernels assume (views/torch_kernels.py), without a copy.

safetensors' own writer starts the data wherever its header ends (8 bytes past a multiple of 8), and the format
allows no gaps between tensors; what it does allow is spaces after the header, which is all this writer adds.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from safetensors.torch import save as save_bytes

from viasd.views.torch_kernels import ALIGNMENT

# safetensors' names of the dtypes a quantized copy may hold.
_DTYPES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
}


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as safetensors stores them: contiguous, on the CPU, as uint8."""
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)


def to_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """The safetensors file of `tensors` and `metadata` as one buffer (`pieces` gives it in pieces)."""
    return b"".join(bytes(piece) for piece in pieces(tensors, metadata))


def pieces(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> Iterator[Any]:
    """The safetensors file of `tensors` and `metadata` in pieces to write one after another (the header, then each
    tensor's bytes, not copied), its tensors at 64-byte boundaries where their sizes allow (safetensors' own layout
    on a big-endian machine, or for a dtype not named here)."""
    if sys.byteorder != "little" or any(t.dtype not in _DTYPES for t in tensors.values()):
        yield save_bytes(dict(tensors), metadata=dict(metadata))
        return
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    order = sorted(tensors, key=lambda name: (sizes[name] % ALIGNMENT != 0, name))
    offsets, end = {}, 0
    for name in order:
        offsets[name], end = (end, end + sizes[name]), end + sizes[name]
    entries = {
        name: {"dtype": _DTYPES[tensors[name].dtype], "shape": list(tensors[name].shape), "data_offsets": offsets[name]}
        for name in order
    }
    text = json.dumps({"__metadata__": dict(metadata), **entries}, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGNMENT)  # spaces after the header: the data starts at a multiple
    yield len(text).to_bytes(8, "little") + text
    for name in order:
        yield _bytes_of(tensors[name]).numpy()


def read_tensors(path: str | os.PathLike[str]) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A safetensors file's metadata and tensors, each read into memory of its own (no mapping of the file).

    A mapped file would count every page the reader touched (a digest check touches them all) as the process's
    memory for as long as any tensor of it lives, also those of tensors replaced after loading (sibling layers are
    stacked into one copy, views/linears.py); tensors of their own free as they go. A malformed file raises
    ValueError."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        head = handle.read(8)
        if len(head) != 8:
            raise ValueError("not a safetensors file (shorter than its header)")
        length = int.from_bytes(head, "little")
        if length > size - 8:
            raise ValueError("not a safetensors file (its header runs past its end)")
        header = json.loads(handle.read(length))
        if not isinstance(header, dict):
            raise ValueError("not a safetensors file (its header is no table)")
        metadata = header.pop("__metadata__", None) or {}
        names = {name: dtype for dtype, name in _DTYPES.items()}
        tensors: dict[str, torch.Tensor] = {}
        for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            begin, end = (int(x) for x in entry["data_offsets"])
            dtype = names.get(entry["dtype"])
            shape = [int(x) for x in entry["shape"]]
            if dtype is None or not 0 <= begin <= end <= size - 8 - length:
                raise ValueError(f"tensor {name}: an unknown dtype or data outside the file")
            tensor = torch.empty(shape, dtype=dtype)
            if tensor.numel() * tensor.element_size() != end - begin:
                raise ValueError(f"tensor {name}: {end - begin} bytes for shape {shape}")
            handle.seek(8 + length + begin)
            if tensor.numel() and handle.readinto(tensor.reshape(-1).view(torch.uint8).numpy()) != end - begin:
                raise ValueError(f"tensor {name}: the file ends early")
            tensors[name] = tensor
    return dict(metadata), tensors
