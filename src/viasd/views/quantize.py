"""Quantized copies of a model's Linear layers by a recipe (views/recipe.py): made here from the model's own weights
(or a GGUF file's blocks, views/gguf.py), kept together as the `QuantizedLinears` a view swaps in for a pass.

Layers named in the recipe's `keep` stay as they are (bf16). The model's own weights are never changed or copied
whole: one Linear at a time is read while its quantized copy is made.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from viasd.errors import ViasdError
from viasd.kernels import formats
from viasd.models.stored import FileLinear, dense_copy, densify, file_of
from viasd.views.linears import (
    Int4Int8Linear,
    Int4WeightOnlyLinear,
    Int8DynamicLinear,
    Int8WeightOnlyLinear,
    flat,
    join_siblings,
    layer_class,
)
from viasd.views.recipe import QuantRecipe

if TYPE_CHECKING:
    from viasd.views.gguf import GgufWeights, OwnWeights


def quantizable(model: nn.Module) -> dict[str, nn.Linear]:
    """The Linear layers a recipe may quantize: every Linear of the decoder and the LM head."""
    return {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def activation_ranges(model: nn.Module, names: Sequence[str], sequences: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Per input channel, the largest |activation| that each named Linear sees over the token sequences."""
    modules = dict(model.named_modules())
    ranges: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            amax = flat(args[0]).abs().amax(dim=0).float()
            ranges[name] = amax if name not in ranges else torch.maximum(ranges[name], amax)

        return record

    handles = [modules[name].register_forward_pre_hook(hook(name)) for name in names]
    device = next(model.parameters()).device
    try:
        with torch.inference_mode():
            for ids in sequences:
                model(input_ids=torch.tensor([list(ids)], device=device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return ranges


def smoothing(act_range: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel factor s = max|x|^a / max|w|^(1-a) (clamped away from 0)."""
    w_range = weight.detach().float().abs().amax(dim=0).clamp_min(1e-5)
    return (act_range.clamp_min(1e-5).pow(alpha) / w_range.pow(1.0 - alpha)).clamp_min(1e-5)


@dataclass(eq=False)
class QuantizedLinears:
    """A model's quantized Linear layers by module name, swapped in for a pass by `applied`.

    Compared by identity: two quantizations are never the same view, even of the same recipe.
    """

    recipe: QuantRecipe
    modules: dict[str, nn.Module] = field(default_factory=dict)
    from_file: int = 0  # how many layers took a GGUF file's own blocks (4-, 6- or 8-bit)
    _owners: dict[int, list[tuple[nn.Module, str, nn.Module]]] = field(default_factory=dict, repr=False)

    def prepare(self) -> None:
        """Put every layer in the form its kernel computes from now, not at its first pass (torch's int8 kernel
        packs its weights, some 40 ms for a 1536 x 8960 layer): making a view costs its time at load, never in
        a generation."""
        work = [prepare for module in self.modules.values() if (prepare := getattr(module, "prepare", None))]
        # Layers are independent and torch releases the GIL while it packs: one worker per thread torch uses.
        with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
            list(pool.map(lambda prepare: prepare(), work))

    def nbytes(self) -> int:
        """Memory the quantized copies take (the model's own weights are not counted)."""
        return sum(t.numel() * t.element_size() for m in self.modules.values() for t in m.buffers())

    @contextmanager
    def applied(self, model: nn.Module) -> Iterator[None]:
        """Run `model` with these layers swapped in; restored on exit (also on error). Not re-entrant."""
        if id(model) not in self._owners:  # (parent, attribute, quantized copy), looked up once per model
            owners = dict(model.named_modules())
            self._owners[id(model)] = [
                (owners[name.rpartition(".")[0]], name.rpartition(".")[2], module)
                for name, module in self.modules.items()
            ]
        # Each swapped layer is a registered submodule of its parent, so swapping is one entry of the parent's
        # `_modules` (what nn.Module.__setattr__ ends up doing for a module, minus its checks: some 200 swaps in
        # and out per pass of a quantized view cost 1-2 ms of a 40 ms decoding step that way).
        swapped: list[tuple[dict[str, nn.Module | None], str, nn.Module | None]] = []
        try:
            for parent, child, module in self._owners[id(model)]:
                registry = parent._modules
                swapped.append((registry, child, registry[child]))
                registry[child] = module
            yield
        finally:
            for registry, child, original in reversed(swapped):
                registry[child] = original


def quantize(
    model: nn.Module,
    recipe: QuantRecipe,
    sequences: Sequence[Sequence[int]] = (),
    gguf: GgufWeights | None = None,
) -> QuantizedLinears:
    """Quantized copies of the model's Linear layers by `recipe` (`sequences`: token ids for smoothing). A `gguf`
    recipe takes the blocks of `gguf`, the file the model was converted from, where it stores them in a type one of
    viasd's kernels takes (views/gguf.py), and makes the other layers int8 weight-only."""
    stored = any(isinstance(module, FileLinear) for module in quantizable(model).values())
    if stored and recipe.smooth:
        densify(model, f"quantization {recipe.name} smooths by the dense model's activations")
    if recipe.gguf and gguf is None and not stored:
        raise ViasdError("quantization gguf takes the blocks of the GGUF file the model came from: it has none")
    names = [name for name in quantizable(model) if not recipe.keeps(name)]
    if not names:
        raise ViasdError(f"quantization {recipe.name}: it keeps every Linear layer; nothing to quantize")
    ranges: Mapping[str, torch.Tensor] = {}
    if recipe.smooth:
        if not sequences:
            raise ViasdError("smoothing needs calibration token sequences")
        ranges = activation_ranges(model, names, sequences)
    layers = quantizable(model)
    out = QuantizedLinears(recipe)
    with torch.inference_mode():
        for name in names:
            linear = layers[name]
            kind = recipe.kind_of(name)
            if isinstance(linear, FileLinear) and not (kind == "int4a8" and recipe.gguf):
                # A stored layer quantized from its dense weight: made for this layer alone and dropped after, so
                # the model never holds its dense copy whole.
                linear = dense_copy(linear)
            if kind == "int8":
                smooth = smoothing(ranges[name], linear.weight, recipe.smooth) if name in ranges else None
                out.modules[name] = Int8DynamicLinear.from_linear(linear, smooth)
            elif kind == "int8wo":
                out.modules[name] = Int8WeightOnlyLinear.from_linear(linear)
            elif kind == "int4a8" and recipe.gguf and isinstance(linear, FileLinear):
                out.modules[name] = _from_blocks(linear)
                out.from_file += not isinstance(out.modules[name], Int8WeightOnlyLinear)
            elif kind == "int4a8" and gguf is not None and recipe.gguf:
                weight = linear.weight
                out.modules[name] = _from_file(linear, gguf.own(name, weight))
                out.from_file += not isinstance(out.modules[name], Int8WeightOnlyLinear)
            elif kind == "int4a8":
                out.modules[name] = Int4Int8Linear.from_linear(linear)
            else:
                out.modules[name] = Int4WeightOnlyLinear.from_linear(linear, recipe.group_size)
    join_siblings(out.modules)
    file = file_of(model)
    if file is not None:
        file.release()  # its blocks are in the view's layout now
    return out


def _from_blocks(linear: FileLinear) -> nn.Module:
    """A stored layer's copy from its own blocks (models/stored.py), as `_from_file` takes them; int8 weight-only, from
    a dense copy made for the moment, where no kernel takes its type."""
    from viasd.views.gguf import converted

    tensor = linear.file_tensor
    rows, columns = tensor.shape
    own = converted(tensor.kind, tensor.blocks(), rows, columns)
    made = _from_file(linear, own) if own is not None else Int8WeightOnlyLinear.from_linear(dense_copy(linear))
    tensor.source.file.release(tensor.name)  # its pages are in the copy's layout now
    return made


def _from_file(linear: nn.Linear, own: OwnWeights | None) -> nn.Module:
    """A layer's copy from its GGUF file's own blocks (`own`, in the format of the kernel that takes them); the
    fallback format (int8 weight-only) where the file has none a kernel takes for it (int8 keeps what a tensor stored
    at more bits holds)."""
    found = formats.of_weights(own)
    if found is None:
        return layer_class(formats.FALLBACK.name).from_linear(linear)  # type: ignore[attr-defined]
    return layer_class(found.name).from_linear(linear, own)  # type: ignore[attr-defined]
