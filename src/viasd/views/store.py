"""Quantize once: a model's quantized Linear copies kept on disk, keyed by the model's fingerprint and the recipe.

The file (safetensors) is written atomically and checked on load: its format, model fingerprint and recipe,
and every module's tensors. A file that fails a check is not used: the copies are made again and the file
replaced, with a line on stderr saying so.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_bytes
from torch import nn

from viasd.cache import cache_folder
from viasd.fileio import write_atomic
from viasd.kernels import w6a8
from viasd.models.fingerprint import model_fingerprint
from viasd.views.linears import (
    Int4Int8Linear,
    Int4WeightOnlyLinear,
    Int6Int8Linear,
    Int8DynamicLinear,
    Int8WeightOnlyLinear,
    join_siblings,
)
from viasd.views.quantize import QuantizedLinears, quantizable, quantize
from viasd.views.recipe import QuantRecipe

if TYPE_CHECKING:
    from viasd.views.gguf import GgufWeights

FORMAT = "viasd-quantized/3"  # 2: a gguf recipe's 6-bit layers are the file's own blocks; 3: low-bit tiles
# What smoothing calibrates on (activation ranges per channel): varied requests in the chat template.
SMOOTHING_TEXTS = (
    "Write a Python function that parses a CSV line into a list of fields, handling quoted commas.",
    "Summarize the causes of the French Revolution in three sentences.",
    "Translate into German: The train leaves at seven and arrives before noon.",
    "A shop sells pens at 3 dollars and notebooks at 5 dollars. How much do 4 pens and 2 notebooks cost?",
)
_CLASSES: dict[str, type[nn.Module]] = {
    "int8": Int8DynamicLinear,
    "int8wo": Int8WeightOnlyLinear,
    "int4": Int4WeightOnlyLinear,
    "int4a8": Int4Int8Linear,
    "int6a8": Int6Int8Linear,
}


class DamagedCache(Exception):
    """A cached quantization that cannot be used (reason in the message)."""


def cache_path(model: nn.Module, recipe: QuantRecipe, root: Path | None = None) -> Path:
    """Where the copies of `model` by `recipe` are kept: `<cache>/quantized/<fingerprint>/<recipe>.safetensors`."""
    base = root if root is not None else cache_folder("quantized")
    stem = re.sub(r"[^A-Za-z0-9._=,-]+", "_", recipe.name)
    return base / model_fingerprint(model) / f"{stem}.safetensors"


def _to_bytes(linears: QuantizedLinears, fingerprint: str) -> bytes:
    tensors: dict[str, torch.Tensor] = {}
    for name, module in linears.modules.items():
        for key, tensor in module.named_buffers():
            tensors[f"{name}/{key}"] = tensor.contiguous()
    metadata = {"format": FORMAT, "fingerprint": fingerprint, "recipe": linears.recipe.name}
    return save_bytes(tensors, metadata=metadata)


def _load(path: Path, model: nn.Module, recipe: QuantRecipe) -> QuantizedLinears:
    """Rebuild the modules from a file's tensors, checking everything a damaged or foreign file would break."""
    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise DamagedCache(f"not a viasd quantization file (format {metadata.get('format')!r})")
        if metadata.get("fingerprint") != model_fingerprint(model) or metadata.get("recipe") != recipe.name:
            raise DamagedCache("it was made for another model or recipe")
        tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 (safe_open is no dict)
    names = [name for name in quantizable(model) if not recipe.keeps(name)]
    layers = quantizable(model)
    out = QuantizedLinears(recipe)
    for name in names:
        # A fresh module of the right shapes (from the model's own layer), then the file's tensors in its place.
        # A gguf recipe's layers are int4a8 where the source file had 4-bit blocks, 6-bit where it had 6-bit ones,
        # int8 weight-only elsewhere.
        kind = recipe.kind_of(name)
        if recipe.gguf and f"{name}/packed" not in tensors:
            kind = "int6a8" if f"{name}/high" in tensors else "int8wo"
        probe = _probe(layers[name], recipe, kind)
        for key, expected in probe.named_buffers():
            stored = tensors.get(f"{name}/{key}")
            if stored is None or stored.shape != expected.shape or stored.dtype != expected.dtype:
                raise DamagedCache(f"tensor {name}/{key} is missing or of another shape")
            setattr(probe, key, stored)
        if not isinstance(probe, _CLASSES[kind]):
            raise DamagedCache(f"{name}: unexpected module kind")
        out.modules[name] = probe
        out.from_file += recipe.gguf and kind in ("int4a8", "int6a8")
    if len(tensors) != sum(1 for m in out.modules.values() for _ in m.named_buffers()):
        raise DamagedCache("it holds tensors of layers the recipe does not quantize")
    return out


def _probe(linear: nn.Linear, recipe: QuantRecipe, kind: str) -> nn.Module:
    """An empty module of `kind` with the shapes and dtypes `linear`'s copy by `recipe` has."""
    meta = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    meta = meta.to(linear.weight.dtype)
    smooth = torch.ones(linear.in_features, device="meta") if recipe.smooth else None
    if kind == "int8":
        module = Int8DynamicLinear.from_linear(meta, smooth)
    elif kind == "int8wo":
        module = Int8WeightOnlyLinear.from_linear(meta)
    elif kind == "int4a8":
        module = Int4Int8Linear.from_linear(meta)
    elif kind == "int6a8":
        module = Int6Int8Linear(_six_bit_probe(linear.out_features, linear.in_features), meta.bias)
    else:
        module = _int4_probe(linear, recipe.group_size)
    return module


def _six_bit_probe(rows: int, columns: int) -> w6a8.SixBitWeights:
    empty = functools.partial(torch.empty, device="meta")
    tiles = -(-rows // w6a8.TILE)
    low, high = empty(tiles, columns // 8, 64, dtype=torch.uint8), empty(tiles, columns // 16, 64, dtype=torch.uint8)
    return w6a8.SixBitWeights(low, high, empty(tiles, columns // 16, w6a8.TILE, dtype=torch.int8),
                              empty(tiles, columns // 256, w6a8.TILE, dtype=torch.float16), rows)  # fmt: skip


def _int4_probe(linear: nn.Linear, group_size: int) -> nn.Module:
    """An empty int4 weight-only module of `linear`'s shapes: torch's CPU int4 packing keeps [out, in/2] bytes and
    [in/group, out, 2] bf16 scales and zeros (packing a zero weight of the same shape instead took seconds)."""
    empty = functools.partial(torch.empty, device="meta")
    rows, columns = linear.out_features, linear.in_features
    packed = empty(rows, columns // 2, dtype=torch.uint8)
    scales_zeros = empty(columns // group_size, rows, 2, dtype=torch.bfloat16)
    bias = None if linear.bias is None else empty(rows, dtype=linear.bias.dtype)
    return Int4WeightOnlyLinear(packed, scales_zeros, group_size, bias)


def cached_quantize(
    model: nn.Module,
    recipe: QuantRecipe,
    sequences: Callable[[], Sequence[Sequence[int]]],
    root: Path | None = None,
    log: Callable[[str], None] = lambda text: print(text, file=sys.stderr),
    gguf: Callable[[], GgufWeights | None] = lambda: None,
) -> QuantizedLinears:
    """The model's copies by `recipe`: from the cache when a sound file is there, else made (calibration token
    sequences from `sequences()` when the recipe smooths, the source GGUF file's blocks from `gguf()` when it
    takes them over) and cached."""
    path = cache_path(model, recipe, root)
    device = next(model.parameters()).device
    if path.is_file():
        try:
            out = _load(path, model, recipe)
            for module in out.modules.values():
                module.to(device)
            join_siblings(out.modules)
            return out
        except (DamagedCache, SafetensorError, ValueError, KeyError, OSError) as error:
            log(f"the cached {recipe.name} copies at {path} cannot be used ({error}); quantizing again")
    out = quantize(model, recipe, sequences() if recipe.smooth else (), gguf() if recipe.gguf else None)
    write_atomic(path, _to_bytes(out, model_fingerprint(model)))
    return out
