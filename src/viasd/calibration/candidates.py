"""The candidates a calibration chooses among: drafters (the drafter model or a model's quantized view) and slim
views (a layer mask, quantized copies of the target, or both), named as gate records and profiles name them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from viasd.calibration.head_drafts import HEAD, HeadSource
from viasd.calibration.teacher import TeacherSequence, model_logits
from viasd.errors import ViasdError
from viasd.models.fingerprint import model_fingerprint
from viasd.models.loading import LoadedModel
from viasd.profile import RoutingProfile
from viasd.views.layer_skip import LayerMask
from viasd.views.quantize import QuantizedLinears
from viasd.views.recipe import QuantRecipe
from viasd.views.view import View, applied

Quantizer = Callable[[LoadedModel, QuantRecipe], QuantizedLinears]


def parse_drafter(name: str) -> tuple[bool, QuantRecipe | None]:
    """A drafter candidate's name -> (the target's own view?, quantization recipe or None)."""
    kind, _, recipe = name.partition(":")
    if name == HEAD:
        return False, None
    if kind not in ("model", "self") or (kind == "self" and not recipe):
        raise ViasdError(f"drafter candidate {name!r}: write model, model:RECIPE, self:RECIPE (e.g. self:int8) or head")
    return kind == "self", QuantRecipe.parse(recipe) if recipe else None


def drafter_name(profile: RoutingProfile) -> str:
    """A profile's drafter as a candidate name (model, model:RECIPE, self:RECIPE or head)."""
    if profile.head_drafter:
        return HEAD
    recipe = profile.drafter_quant
    return f"{'self' if profile.self_drafter else 'model'}{':' + recipe.name if recipe else ''}"


def quantize_plainly(model: LoadedModel, recipe: QuantRecipe) -> QuantizedLinears:
    """Quantized copies made on the spot (no disk cache, no smoothing calibration)."""
    from viasd.views.quantize import quantize

    return quantize(model.model, recipe)


@dataclass(frozen=True)
class DraftSource:
    """A drafter candidate: a model (the drafter, or the target itself) and the view it drafts as."""

    name: str
    loaded: LoadedModel
    view: View | None
    is_self: bool
    recipe: QuantRecipe | None

    @classmethod
    def make(cls, name: str, target: LoadedModel, drafter: LoadedModel, quantized: Quantizer) -> DraftSource:
        is_self, recipe = parse_drafter(name)
        loaded = target if is_self else drafter
        view = View(linears=quantized(loaded, recipe)) if recipe else None
        return cls(name, loaded, view, is_self, recipe)

    def identity(self) -> list[Any]:
        """What its records depend on (the plain drafter keeps the key it always had)."""
        base = [model_fingerprint(self.loaded.model)]
        return base if self.name == "model" else [*base, self.name]

    def timed(self) -> tuple[nn.Module, View | None]:
        """What the cost table times: the model and the view it drafts as."""
        return self.loaded.model, self.view

    def logits(self, seq: TeacherSequence) -> torch.Tensor:
        with applied(self.loaded.model, self.view):
            return model_logits(self.loaded.model, seq.ids, seq.start)

    def profile_entry(self) -> dict[str, Any]:
        entry = {"name": self.loaded.name, "fingerprint": model_fingerprint(self.loaded.model)}
        if self.recipe:
            entry["quant"] = self.recipe.name
        if self.is_self:
            entry["self"] = True
        return entry


def drafter_source(
    name: str,
    target: LoadedModel,
    drafter: LoadedModel,
    quantized: Quantizer,
    base: QuantizedLinears | None = None,
    depths: int = 8,
) -> DraftSource | HeadSource:
    """The drafter candidate `name`: the target's draft head (`head`: the one `via` would draft with, recorded to
    `depths` drafts per round, deeper ones read as the deepest; timed on the target as `base`), else the drafter
    model or a model's view."""
    if name != HEAD:
        return DraftSource.make(name, target, drafter, quantized)
    from viasd.heads.find import find_head

    found = find_head(target.model)
    return HeadSource.make(target.model, found.head, found.digest, depths, View(linears=base) if base else None)


@dataclass(frozen=True)
class SlimCandidate:
    """A slim view to calibrate: a layer mask (the full mask: none skipped) and quantized copies, or not."""

    mask: LayerMask
    recipe: QuantRecipe | None
    view: View

    @classmethod
    def make(
        cls,
        mask: LayerMask,
        recipe: QuantRecipe | None,
        target: LoadedModel,
        quantized: Quantizer,
        base: QuantizedLinears | None = None,
    ) -> SlimCandidate:
        """The mask over `recipe`'s copies of the target, else over the target's view `base` (None: as loaded)."""
        return cls(mask, recipe, View(mask=mask, linears=quantized(target, recipe) if recipe else base))

    def describe(self) -> dict[str, Any]:
        """The view as records keys and profiles name it (a bare mask as it always was)."""
        return self.mask.to_dict() if self.recipe is None else {**self.mask.to_dict(), "quant": self.recipe.name}

    @property
    def label(self) -> str:
        return self.view.describe()
