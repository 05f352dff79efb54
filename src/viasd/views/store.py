"""Quantize once: a model's quantized Linear copies kept on disk, keyed by the model's fingerprint, its dtype and the
recipe.

The file (safetensors) is laid out so that its tensors, read back mapped from the file, start at 64-byte boundaries
as the copies made in memory do (views/tensor_file.py); one that does not (a file of another writer) is copied into
memory torch allocated. torch's int8 weight-only kernel reads its weights with aligned vector loads: a copy read from
a file that safetensors wrote itself, 8 bytes past a boundary, killed the process on AVX-512 CPUs.

The file is written atomically and checked on load: its format, model fingerprint, dtype and recipe, every module's
tensors, and every tensor's bytes against the xxh3-128 digest recorded when it was written (a flipped bit in a weight
would be a wrong answer, never an error). A file that fails a check is not used: the copies are made again and the
file replaced, with a line on stderr saying so. A cache folder that cannot be written (read-only, not a directory)
costs the cache, never the run: the copies are made in memory, with one line on stderr.

What the digest check adds to making a view from its cached copy: hashing the tensors just read, which are in
memory by then. Measured on the development machine (AMD EPYC, 2 shared cores) on the default models' copies:

| copy | xxh3-128 (used) | SHA-256 | BLAKE2b |
| --- | --- | --- | --- |
| target int4a8 (0.96 GB, 675 tensors) | 0.04 s | 0.55 s | 0.83 s |
| target int8 (1.55 GB, 478 tensors) | 0.06 s | 0.95 s | 1.95 s |
| drafter int4a8 (0.31 GB, 579 tensors) | 0.04 s | 0.29 s | 0.45 s |

against 0.4-0.6 s for reading the target's int4a8 copy and building its modules there (0.7 s on the Zen 5 EPYC,
docs/design.md).
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import xxhash
from safetensors import SafetensorError, safe_open
from torch import nn

from viasd.cache import cache_folder
from viasd.fileio import write_atomic
from viasd.kernels import formats
from viasd.models.fingerprint import model_fingerprint
from viasd.models.stored import FileLinear, has_dense_weights
from viasd.views.linears import join_siblings, layer_class
from viasd.views.quantize import QuantizedLinears, quantizable, quantize
from viasd.views.recipe import QuantRecipe
from viasd.views.tensor_file import pieces, read_tensors
from viasd.views.torch_kernels import aligned

if TYPE_CHECKING:
    from viasd.views.gguf import GgufWeights

# 2: a gguf recipe's 6-bit layers are the file's own blocks; 3: low-bit tiles; 4: a digest per tensor, the dtype;
# 5: tensors at 64-byte boundaries (a file of 4 is made again, not copied tensor by tensor at every load); 6: a gguf
# recipe also takes Q4_0, Q4_1 (as int4a8), Q8_0 and Q5_K (as int8a8) blocks, where 5 made them int8 weight-only; 7:
# and Q5_0 and Q5_1 (as int8a8)
FORMAT = "viasd-quantized/7"
# What smoothing calibrates on (activation ranges per channel): varied requests in the chat template.
SMOOTHING_TEXTS = (
    "Write a Python function that parses a CSV line into a list of fields, handling quoted commas.",
    "Summarize the causes of the French Revolution in three sentences.",
    "Translate into German: The train leaves at seven and arrives before noon.",
    "A shop sells pens at 3 dollars and notebooks at 5 dollars. How much do 4 pens and 2 notebooks cost?",
)


class DamagedCache(Exception):
    """A cached quantization that cannot be used (reason in the message)."""


def _dtype_name(model: nn.Module) -> str:
    """The model's dtype as a short name ('bfloat16'): its copies' scales and biases have it."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def cache_path(model: nn.Module, recipe: QuantRecipe, root: Path | None = None) -> Path:
    """Where the copies of `model` by `recipe` are kept: `<cache>/quantized/<fingerprint>/<dtype>/<recipe>.safetensors`.

    The fingerprint does not depend on the dtype the model was loaded in, and the copies do, so the dtype is part of
    the key: a bf16 and an fp32 view of one model each keep their own file instead of overwriting each other's.
    """
    base = root if root is not None else cache_folder("quantized")
    stem = re.sub(r"[^A-Za-z0-9._=,-]+", "_", recipe.name)
    return base / model_fingerprint(model) / _dtype_name(model) / f"{stem}.safetensors"


def _digest(tensor: torch.Tensor) -> str:
    """xxh3-128 of a tensor's bytes, in hex (the bytes safetensors stores: contiguous, on the CPU)."""
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return xxhash.xxh3_128(data.numpy()).hexdigest()


def _to_pieces(linears: QuantizedLinears, model: nn.Module) -> Iterator[Any]:
    """The copies as a safetensors file in pieces (views/tensor_file.py), whose metadata says what they were made
    from and records each tensor's digest."""
    tensors: dict[str, torch.Tensor] = {}
    for name, module in linears.modules.items():
        for key, tensor in module.named_buffers():
            tensors[f"{name}/{key}"] = tensor.contiguous()
    metadata = {
        "format": FORMAT,
        "fingerprint": model_fingerprint(model),
        "dtype": _dtype_name(model),
        "recipe": linears.recipe.name,
        "digests": json.dumps({key: _digest(tensor) for key, tensor in tensors.items()}, sort_keys=True),
    }
    return pieces(tensors, metadata)


def _check_digests(tensors: dict[str, torch.Tensor], recorded: str | None) -> None:
    """Refuse tensors whose bytes are not the ones written (each against the digest recorded for it)."""
    try:
        digests = json.loads(recorded or "")
    except (ValueError, RecursionError):
        raise DamagedCache("its tensor digests are missing or unreadable") from None
    if not isinstance(digests, dict) or set(digests) != set(tensors):
        raise DamagedCache("its tensor digests do not match its tensors")
    for key, tensor in tensors.items():
        if _digest(tensor) != digests[key]:
            raise DamagedCache(f"tensor {key} has other contents than were written (xxh3 digest differs)")


def _load(path: Path, model: nn.Module, recipe: QuantRecipe) -> QuantizedLinears:
    """Rebuild the modules from a file's tensors, checking everything a damaged or foreign file would break."""
    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata() or {}
    if metadata.get("format") != FORMAT:
        raise DamagedCache(f"not a viasd quantization file of this version (format {metadata.get('format')!r})")
    if metadata.get("fingerprint") != model_fingerprint(model) or metadata.get("recipe") != recipe.name:
        raise DamagedCache("it was made for another model or recipe")
    if metadata.get("dtype") != _dtype_name(model):
        raise DamagedCache(f"it was made for the model in {metadata.get('dtype')}, not {_dtype_name(model)}")
    tensors = read_tensors(path)[1]  # read, not mapped: see `read_tensors`
    _check_digests(tensors, metadata.get("digests"))
    names = [name for name in quantizable(model) if not recipe.keeps(name)]
    layers = quantizable(model)
    out = QuantizedLinears(recipe)
    for name in names:
        # A fresh module of the right shapes (from the model's own layer), then the file's tensors in its place.
        # A gguf recipe's layers are in the format that took the source file's blocks (the one whose tensors the
        # file holds), int8 weight-only elsewhere.
        kind = recipe.kind_of(name)
        if recipe.gguf and kind == formats.INT4A8.name:
            kind = _stored_kind(name, tensors)
        probe = layer_class(kind).empty(layers[name], recipe)  # type: ignore[attr-defined]
        for key, expected in probe.named_buffers():
            stored = tensors.get(f"{name}/{key}")
            if stored is None or stored.shape != expected.shape or stored.dtype != expected.dtype:
                raise DamagedCache(f"tensor {name}/{key} is missing or of another shape")
            setattr(probe, key, aligned(stored))  # as a copy made in memory is: kernels may rely on it
        if not isinstance(probe, layer_class(kind)):
            raise DamagedCache(f"{name}: unexpected module kind")
        out.modules[name] = probe
        out.from_file += recipe.gguf and bool(formats.named(kind).blocks)
    if len(tensors) != sum(1 for m in out.modules.values() for _ in m.named_buffers()):
        raise DamagedCache("it holds tensors of layers the recipe does not quantize")
    return out


def _stored_kind(name: str, tensors: dict[str, torch.Tensor]) -> str:
    """The format of a gguf recipe's int4a8 layer `name` in its file: the one that took the source file's blocks,
    whose tensors the file holds for it, else the fallback (int8 weight-only)."""
    for found in formats.FORMATS:
        if found.blocks and all(f"{name}/{key}" in tensors for key in found.keys):
            return found.name
    return formats.FALLBACK.name


_REPORTED: set[Path] = set()  # cache folders whose fault was reported already (once per process)


def _read_cached(
    path: Path, model: nn.Module, recipe: QuantRecipe, log: Callable[[str], None]
) -> QuantizedLinears | None:
    """The copies from a sound cached file, or None: no file (or no readable folder: writing says so), or a file
    that fails a check (one line, then they are made again)."""
    try:
        if not path.is_file():
            return None
    except OSError:
        return None
    try:
        return _load(path, model, recipe)
    except (DamagedCache, SafetensorError, ValueError, KeyError, OSError) as error:
        log(f"the cached {recipe.name} copies at {path} cannot be used ({error}); quantizing again")
        return None


def _store(path: Path, data: Callable[[], Iterable[Any]], log: Callable[[str], None]) -> None:
    """Write a cache file; where the folder cannot take it, say so once per folder and go on without the cache.
    A file of the layout before the dtype was part of the key is removed once its successor is written."""
    folder = path.parents[2]
    try:
        write_atomic(path, data())
    except OSError as error:
        if folder not in _REPORTED:
            _REPORTED.add(folder)
            reason = error.strerror or str(error)
            log(f"cannot cache quantized copies in {folder} ({path}: {reason}); they are made in memory at each start")
        return
    with contextlib.suppress(OSError):
        (path.parent.parent / path.name).unlink(missing_ok=True)


def repacked_at_start(model: nn.Module, recipe: QuantRecipe) -> bool:
    """Whether the `gguf` view of a stored model (models/stored.py) is made from its file at every start: the C
    repacker is built and takes the block type of every layer the view quantizes."""
    from viasd.views.gguf import fast_repacking

    if not recipe.gguf:
        return False
    layers = [linear for name, linear in quantizable(model).items() if not recipe.keeps(name)]
    if not layers or not all(isinstance(linear, FileLinear) for linear in layers):
        return False
    return all(linear.file_tensor.kind in formats.REPACKED_TYPES for linear in layers) and fast_repacking()


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
    takes them over) and cached where the cache can be written."""
    path = cache_path(model, recipe, root)
    if repacked_at_start(model, recipe):
        # The file is the cache: its blocks are rearranged in memory at each start (kernels/repack.c), faster than
        # an earlier cached copy is read. One an earlier viasd wrote is removed: it doubled the file on disk.
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        return quantize(model, recipe)
    device = next(model.parameters()).device
    out = _read_cached(path, model, recipe, log)
    if out is not None:
        for module in out.modules.values():
            module.to(device)
        join_siblings(out.modules)
        return out
    # A stored model's layers carry their blocks (models/stored.py): no second reading of its file.
    taken = recipe.gguf and has_dense_weights(model)
    out = quantize(model, recipe, sequences() if recipe.smooth else (), gguf() if taken else None)
    _store(path, lambda: _to_pieces(out, model), log)
    return out
