"""Simple routing masks that need no search: evenly spread skips and random skips of a given ratio."""

from __future__ import annotations

import random

from viasd.errors import ViasdError
from viasd.models.routing import RoutingMask


def layers_to_skip(num_layers: int, skip_ratio: float) -> int:
    """How many whole layers a skip ratio removes; first and last layers always stay."""
    if not 0.0 <= skip_ratio < 1.0:
        raise ViasdError(f"skip ratio must be in [0, 1), got {skip_ratio}")
    return min(round(skip_ratio * num_layers), max(num_layers - 2, 0))


def spread_mask(num_layers: int, skip_ratio: float) -> RoutingMask:
    """Skip layers evenly spread over the middle of the stack (a reasonable unsearched default)."""
    count = layers_to_skip(num_layers, skip_ratio)
    middle = list(range(1, num_layers - 1))
    if count == 0:
        return RoutingMask.full(num_layers)
    step = len(middle) / count
    skipped = sorted({middle[int((i + 0.5) * step)] for i in range(count)})
    return RoutingMask.skipping(num_layers, skipped)


def random_mask(num_layers: int, skip_ratio: float, rng: random.Random) -> RoutingMask:
    """Skip a random set of middle layers of the given ratio (the baseline a searched mask must beat)."""
    count = layers_to_skip(num_layers, skip_ratio)
    return RoutingMask.skipping(num_layers, rng.sample(range(1, num_layers - 1), count))
