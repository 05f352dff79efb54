"""Tensors as a safetensors file laid out for memory-mapped reads: its data starts at a 64-byte boundary and the
tensors whose sizes are whole multiples of 64 bytes (in practice every tensor of a quantized copy) come first, so
that safetensors' reader, which maps the file, hands each of them out at an address as aligned as torch's own
allocations: what torch's CPU kernels assume (views/torch_kernels.py), without a copy.

safetensors' own writer starts the data wherever its header ends (8 bytes past a multiple of 8), and the format
allows no gaps between tensors; what it does allow is spaces after the header, which is all this writer adds.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping

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
    """The safetensors file of `tensors` and `metadata`, its tensors at 64-byte boundaries where their sizes allow
    (safetensors' own layout on a big-endian machine, or for a dtype not named here)."""
    if sys.byteorder != "little" or any(t.dtype not in _DTYPES for t in tensors.values()):
        return save_bytes(dict(tensors), metadata=dict(metadata))
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
    start = 8 + len(text)
    out = bytearray(start + end)
    out[:start] = len(text).to_bytes(8, "little") + text
    view = memoryview(out)
    for name in order:
        begin, stop = offsets[name]
        view[start + begin : start + stop] = _bytes_of(tensors[name]).numpy()
    return out  # a bytearray, which is bytes to write: the file's bytes without one more copy of them
