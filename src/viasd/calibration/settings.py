"""What a calibration does, with its defaults (`CalibrationSettings`), checked before any model runs so a bad
option fails in one line."""

from __future__ import annotations

from dataclasses import dataclass

from viasd.calibration.candidates import parse_drafter
from viasd.calibration.objectives import DEFAULT_MARGIN, OBJECTIVES
from viasd.calibration.prompts import CALIBRATION_PROMPTS, HELD_OUT_PROMPTS
from viasd.errors import ViasdError
from viasd.speculation import check_gamma
from viasd.views.recipe import QuantRecipe


@dataclass
class CalibrationSettings:
    """Everything `calibrate_pair` does, with defaults."""

    objective: str = "margin"
    skip_ratios: tuple[float, ...] = (0.18, 0.21, 0.25)
    iterations: int = 60  # search trials per skip ratio
    time_budget: float | None = None  # seconds for all mask searches together
    quality_budget: float = 0.02
    gammas: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
    caps: tuple[int, ...] = (8, 16, 32)
    prompts: int = 8  # calibration prompts (gate records); the first `search_prompts` also drive the search
    search_prompts: int = 4
    held_out: int = 4
    new_tokens: int = 64
    chunk: int = 8
    margin: float = DEFAULT_MARGIN
    sampler: str = "tpe"
    bo_every: int = 2
    seed: int = 0
    random_masks: int = 4
    cost_repeats: int = 5
    preference: bool = True  # seed the search with the layers that are cheapest to skip one at a time
    min_tier_share: float = 0.0  # > 0: each tier must decide at least this share of draft tokens
    pregates: tuple[float, ...] = (0.0, 0.3, 0.5)  # pre-gate thresholds to try (0: off)
    stops: tuple[float, ...] = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6)  # draft stop thresholds to try (0: off)
    # Slim views beyond the searched layer masks: quantized views of the target (recipes, e.g. int8), alone and on
    # the best searched mask. With no skip ratios there is no mask search: quantized views only.
    slim_quants: tuple[QuantRecipe, ...] = ()
    # Drafter candidates: `model` (the drafter as loaded), `model:RECIPE` (its quantized view), `self:RECIPE`
    # (the target's own quantized view: no second model).
    drafters: tuple[str, ...] = ("model",)
    # The view of the target to calibrate on, which `via` then verifies against (e.g. gguf: its file's blocks), its
    # slim views that view with layers skipped; None: the target as loaded (its dense copy).
    target_quant: QuantRecipe | None = None

    def check(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ViasdError(f"unknown objective {self.objective!r}; choose one of {', '.join(OBJECTIVES)}")
        if not 1 <= self.prompts <= len(CALIBRATION_PROMPTS):
            raise ViasdError(f"--prompts must be between 1 and {len(CALIBRATION_PROMPTS)}, got {self.prompts}")
        if not 0 <= self.held_out <= len(HELD_OUT_PROMPTS):
            raise ViasdError(f"held-out prompts must be between 0 and {len(HELD_OUT_PROMPTS)}")
        if not all(0.0 < r < 1.0 for r in self.skip_ratios):
            raise ViasdError(f"skip ratios must be in (0, 1), got {list(self.skip_ratios)}")
        if not self.skip_ratios and not self.slim_quants:
            raise ViasdError("no slim view to calibrate: give --skip-ratio values, --slim-quants, or both")
        if not self.drafters:
            raise ViasdError("--drafters: no drafter candidate given")
        for name in self.drafters:
            parse_drafter(name)
        if self.iterations < 1:
            raise ViasdError(f"--iterations must be >= 1, got {self.iterations}")
        if self.time_budget is not None and self.time_budget <= 0:
            raise ViasdError(f"--time-budget must be > 0 seconds, got {self.time_budget}")
        if not self.gammas:
            raise ViasdError("--gammas: no draft length given")
        for gamma in self.gammas:
            check_gamma(gamma, "--gammas")
        if not self.caps or min(self.caps) < 2:
            raise ViasdError(f"--caps must be >= 2, got {list(self.caps)}")
        if not 0.0 <= self.quality_budget < 1.0:
            raise ViasdError(f"--quality-budget must be in [0, 1), got {self.quality_budget}")
        if not 0.0 <= self.min_tier_share <= 1.0 / 3.0:
            raise ViasdError(f"--min-tier-share must be in [0, 1/3], got {self.min_tier_share}")
        if not self.pregates or not all(0.0 <= v <= 1.0 for v in self.pregates):
            raise ViasdError(f"--pregates must be in [0, 1], got {list(self.pregates)}")
        if not self.stops or not all(0.0 <= v <= 1.0 for v in self.stops):
            raise ViasdError(f"--stops must be in [0, 1], got {list(self.stops)}")
        if self.new_tokens < 8:
            raise ViasdError(f"--new-tokens must be >= 8, got {self.new_tokens}")
