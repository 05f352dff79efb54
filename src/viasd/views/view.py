"""Views of one loaded model: cheaper ways to run it for a pass, without touching or copying its weights.

A view combines a layer mask (some decoder layers skipped: views/layer_skip.py) and quantized copies of its
Linear layers (views/quantize.py), either or both. The same model object serves every view: for the length
of a pass the view swaps its pieces in, and puts the model's own back afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from torch import nn

from viasd.views.layer_skip import LayerMask, skipping
from viasd.views.quantize import QuantizedLinears


@dataclass(frozen=True)
class View:
    """Skip `mask`'s layers and use `linears` (quantized copies) in place of the model's own Linear layers.

    Views are equal when they skip the same layers with the same quantized copies (copies compare by
    identity), so a KV cache written under one view is reused only by that view.
    """

    mask: LayerMask | None = None
    linears: QuantizedLinears | None = None

    @property
    def is_full(self) -> bool:
        """The model as it is."""
        return (self.mask is None or self.mask.is_full) and self.linears is None

    def describe(self) -> str:
        parts = []
        if self.mask is not None and not self.mask.is_full:
            parts.append(self.mask.describe())
        if self.linears is not None:
            parts.append(self.linears.recipe.name)
        return ", ".join(parts) or "full model"


ViewLike = View | LayerMask | None


def as_view(view: ViewLike) -> View | None:
    """A View for a view, a bare layer mask, or None (the model as it is)."""
    return View(mask=view) if isinstance(view, LayerMask) else view


@contextmanager
def applied(model: nn.Module, view: ViewLike) -> Iterator[None]:
    """Run `model` as `view` inside the block; everything is restored on exit (also on error)."""
    view = as_view(view)
    if view is None or view.is_full:
        yield
        return
    with ExitStack() as stack:
        # Quantized copies first: they are found by module name, which skipped layers would hide.
        if view.linears is not None:
            stack.enter_context(view.linears.applied(model))
        if view.mask is not None:
            stack.enter_context(skipping(model, view.mask))
        yield
