"""Layer skipping: a mask of which decoder sub-layers run, and running one loaded model under it.

This is the paper's "intra-model routing": the slim verifier is the target with some layers skipped.
A layer-skipped pass never copies weights. For the duration of a forward pass the skipped pieces of the
model's own decoder are swapped for parameter-free stand-ins (identity for a whole layer, zeros for an
attention or MLP sub-layer, so the residual stream passes through unchanged), then restored. Indices
of the remaining layers are untouched, so per-layer attention types (sliding or full) and KV-cache
slots keep their meaning.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from viasd.errors import ViasdError


@dataclass(frozen=True)
class LayerMask:
    """Which sub-layers of each decoder layer run: `attention[i]` and `mlp[i]` for layer i."""

    attention: tuple[bool, ...]
    mlp: tuple[bool, ...]

    def __post_init__(self) -> None:
        if len(self.attention) != len(self.mlp):
            raise ViasdError("layer mask: attention and mlp entries differ in length")
        if not self.attention:
            raise ViasdError("layer mask: the model has no layers")
        # The KV cache reports its length from layer 0, so layer 0's attention must always run.
        if not self.attention[0]:
            raise ViasdError("layer mask: the attention of layer 0 must run (the cache length is read from it)")

    @classmethod
    def full(cls, num_layers: int) -> LayerMask:
        """The mask that runs every sub-layer: the full model."""
        return cls((True,) * num_layers, (True,) * num_layers)

    @classmethod
    def skipping(cls, num_layers: int, skipped_layers: Sequence[int]) -> LayerMask:
        """A mask that skips whole decoder layers."""
        skip = set(skipped_layers)
        bad = [i for i in skip if not 0 <= i < num_layers]
        if bad:
            raise ViasdError(f"layer mask: layer indices {sorted(bad)} outside 0..{num_layers - 1}")
        keep = tuple(i not in skip for i in range(num_layers))
        return cls(keep, keep)

    @property
    def num_layers(self) -> int:
        return len(self.attention)

    @property
    def is_full(self) -> bool:
        return all(self.attention) and all(self.mlp)

    @property
    def skipped_layers(self) -> list[int]:
        """Layers whose attention and MLP are both skipped."""
        return [i for i, (a, m) in enumerate(zip(self.attention, self.mlp, strict=True)) if not a and not m]

    @property
    def skip_ratio(self) -> float:
        """Fraction of sub-layers (attention and MLP counted separately) that are skipped."""
        skipped = self.attention.count(False) + self.mlp.count(False)
        return skipped / (2 * self.num_layers)

    def contains(self, other: LayerMask) -> bool:
        """True when every sub-layer that `other` runs also runs here (other is a sub-view of self)."""
        pairs = zip(self.attention + self.mlp, other.attention + other.mlp, strict=True)
        return self.num_layers == other.num_layers and all(mine or not theirs for mine, theirs in pairs)

    def to_dict(self) -> dict[str, Any]:
        attn_only = [i for i in range(self.num_layers) if not self.attention[i] and self.mlp[i]]
        mlp_only = [i for i in range(self.num_layers) if self.attention[i] and not self.mlp[i]]
        return {
            "num_layers": self.num_layers,
            "skip_layers": self.skipped_layers,
            "skip_attention": attn_only,
            "skip_mlp": mlp_only,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerMask:
        """The mask a profile describes; layer indices must be integers in 0..num_layers-1."""
        try:
            n = int(data["num_layers"])
            attention = [True] * n
            mlp = [True] * n
            for key, parts in (
                ("skip_layers", (attention, mlp)),
                ("skip_attention", (attention,)),
                ("skip_mlp", (mlp,)),
            ):
                for i in data.get(key, []):
                    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
                        raise ViasdError(f"layer mask: {key} holds {i!r}, not a layer index in 0..{n - 1}")
                    for part in parts:
                        part[i] = False
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ViasdError(f"layer mask: malformed description {data!r}") from exc
        return cls(tuple(attention), tuple(mlp))

    def describe(self) -> str:
        """A short human-readable summary, e.g. 'skip 8/28 layers [3, 5, ...]'."""
        parts = [f"skip {len(self.skipped_layers)}/{self.num_layers} layers {self.skipped_layers}"]
        d = self.to_dict()
        if d["skip_attention"]:
            parts.append(f"attention only {d['skip_attention']}")
        if d["skip_mlp"]:
            parts.append(f"mlp only {d['skip_mlp']}")
        return "; ".join(parts)


class _SkippedLayer(nn.Module):
    """Stands in for a whole decoder layer: the hidden states pass through unchanged."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


class _SkippedAttention(nn.Module):
    """Stands in for an attention sub-layer: contributes zeros to the residual and writes no KV."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return torch.zeros_like(hidden_states), None


class _SkippedMLP(nn.Module):
    """Stands in for an MLP sub-layer: contributes zeros to the residual."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's list of transformer layers (Llama, Qwen2, Gemma, Mistral and most HF causal LMs)."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ViasdError(f"{type(model).__name__}: cannot find the decoder layers to skip")
    return layers


def num_decoder_layers(model: nn.Module) -> int:
    return len(decoder_layers(model))


@contextmanager
def skipping(model: nn.Module, mask: LayerMask | None) -> Iterator[None]:
    """Run `model` under `mask` inside the block; the model is restored on exit (also on error).

    Not re-entrant and not thread-safe: one forward pass per model at a time.
    """
    if mask is None or mask.is_full:
        yield
        return
    layers = decoder_layers(model)
    if mask.num_layers != len(layers):
        raise ViasdError(f"the layer mask is for {mask.num_layers} layers, the model has {len(layers)}")
    swapped_layers: list[tuple[int, nn.Module]] = []
    swapped_parts: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for i, (attn, mlp) in enumerate(zip(mask.attention, mask.mlp, strict=True)):
            layer = layers[i]
            if not attn and not mlp:
                swapped_layers.append((i, layer))
                layers[i] = _SkippedLayer()
                continue
            if not attn:
                swapped_parts.append((layer, "self_attn", layer.self_attn))
                layer.self_attn = _SkippedAttention()
            if not mlp:
                swapped_parts.append((layer, "mlp", layer.mlp))
                layer.mlp = _SkippedMLP()
        yield
    finally:
        for i, layer in swapped_layers:
            layers[i] = layer
        for layer, name, module in swapped_parts:
            setattr(layer, name, module)


# ------------------------------------------------------------------------ masks that need no search


def layers_to_skip(num_layers: int, skip_ratio: float) -> int:
    """How many whole layers a skip ratio removes; first and last layers always stay."""
    if not 0.0 <= skip_ratio < 1.0:
        raise ViasdError(f"skip ratio must be in [0, 1), got {skip_ratio}")
    return min(round(skip_ratio * num_layers), max(num_layers - 2, 0))


def spread_mask(num_layers: int, skip_ratio: float) -> LayerMask:
    """Skip layers evenly spread over the middle of the stack (a reasonable unsearched default)."""
    count = layers_to_skip(num_layers, skip_ratio)
    middle = list(range(1, num_layers - 1))
    if count == 0:
        return LayerMask.full(num_layers)
    step = len(middle) / count
    skipped = sorted({middle[int((i + 0.5) * step)] for i in range(count)})
    return LayerMask.skipping(num_layers, skipped)


def random_mask(num_layers: int, skip_ratio: float, rng: random.Random) -> LayerMask:
    """Skip a random set of middle layers of the given ratio (the baseline a searched mask must beat)."""
    count = layers_to_skip(num_layers, skip_ratio)
    return LayerMask.skipping(num_layers, rng.sample(range(1, num_layers - 1), count))
