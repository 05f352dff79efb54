"""What an engine loads and the settings every method shares, parsed once from the command line (or a caller)."""

from __future__ import annotations

from dataclasses import dataclass

from viasd.decode import check_gamma
from viasd.models.catalog import DEFAULT_DRAFTER, DEFAULT_TARGET
from viasd.views.recipe import QuantRecipe


@dataclass(frozen=True)
class EngineSpec:
    """Which models to load and how, and the settings every method shares."""

    target: str = DEFAULT_TARGET
    drafter: str = DEFAULT_DRAFTER
    device: str | None = None
    dtype: str = "auto"
    device_map: str | None = None
    gamma: int | None = None  # draft tokens per round; None: the method's default (the profile's for via)
    self_skip_ratio: float = 0.25
    profile: str | None = None  # a routing profile's path; None: the shipped one that suits the machine
    quant: QuantRecipe | None = None  # run the target as its quantized view: another model
    drafter_quant: QuantRecipe | None = None  # run the drafter as its quantized view

    def __post_init__(self) -> None:
        if self.gamma is not None:
            check_gamma(self.gamma, "--gamma")
