"""What an engine loads and the settings every method shares, parsed once from the command line (or a caller)."""

from __future__ import annotations

from dataclasses import dataclass

from viasd.errors import ViasdError
from viasd.models.catalog import DEFAULT_DRAFTER, DEFAULT_TARGET
from viasd.speculation import DEFAULT_SUFFIX_CACHE, check_gamma, check_suffix_cache
from viasd.views.recipe import AS_STORED, DENSE, QuantRecipe, TargetQuant


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
    # What the target runs as: AS_STORED (default: a model from a GGUF file as the file stores it, its gguf view;
    # any other model as loaded), DENSE (as loaded: the dense bf16 copy), or a quantized view by this recipe.
    quant: TargetQuant = AS_STORED
    drafter_quant: QuantRecipe | None = None  # run the drafter as its quantized view
    # Tokens of finished generations the suffix drafters also copy from (0: off; drafters/suffix.py).
    suffix_cache: int = DEFAULT_SUFFIX_CACHE
    # One suffix store per method (the bench: a method never drafts from another's answer to the same task).
    suffix_per_method: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.quant, QuantRecipe) and self.quant not in (AS_STORED, DENSE):
            raise ViasdError(
                f"the target runs as {AS_STORED!r}, {DENSE!r} or a quantization recipe, not {self.quant!r}"
            )
        if self.gamma is not None:
            check_gamma(self.gamma, "--gamma")
        check_suffix_cache(self.suffix_cache, "--suffix-cache")
