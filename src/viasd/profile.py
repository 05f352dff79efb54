"""Routing profiles: the calibrated slim-verifier masks, gate, draft length rules and measured costs of a model pair.

A profile is a small JSON file. It names the models it was made for by fingerprint (config plus a
sample of the weights), so a profile made for other models is refused instead of silently misrouting.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from torch import nn

from viasd.decode.round import RoundPolicy
from viasd.errors import ViasdError
from viasd.fileio import write_atomic
from viasd.models.fingerprint import model_fingerprint
from viasd.verify.gates import Gate
from viasd.views.layer_skip import LayerMask
from viasd.views.recipe import QuantRecipe

FORMAT = "viasd-routing-profile/1"
DEFAULT_PROFILE = "qwen2.5-coder-0.5b__qwen2.5-coder-1.5b.json"
# The default pair's profile for CPUs where viasd's int4a8 kernel runs: int4a8 views as slim verifier and drafter.
INT4A8_PROFILE = "qwen2.5-coder-0.5b__qwen2.5-coder-1.5b.int4a8.json"


@dataclass
class RoutingProfile:
    """What `viasd calibrate` produces and `--method via` consumes."""

    target: dict[str, str]  # {"name", "fingerprint"}
    drafter: dict[str, str] | None  # None: the profile works with any drafter of the target
    masks: list[LayerMask]  # the slim views' layer masks, cheapest first
    # Per slim view, the quantization of its Linear layers, or None: bf16. Empty: none. (Recipe names, as in the
    # file, are parsed once, when the profile is made.)
    quant: list[QuantRecipe | None] = field(default_factory=list)
    gate: Gate = field(default_factory=Gate)
    gamma: int = 4
    cap: int = 32  # max tokens committed without the full target before a full pass is forced
    pregate: float = 0.0  # drafter confidence under which a round skips the slim pass (0: off)
    stop: float = 0.0  # drafter confidence under which drafting stops for the round (0: off; older profiles)
    search: dict[str, Any] = field(default_factory=dict)  # how the masks were found
    calibration: dict[str, Any] = field(default_factory=dict)  # costs, gate statistics, quality budget
    created: str = ""
    format: str = FORMAT
    source: str | None = field(default=None, compare=False)  # the file it was read from (not written to one)

    def __post_init__(self) -> None:
        self.quant = [_recipe(q) for q in self.quant]
        self.policy()  # refuses a bad gamma, cap, pre-gate or stop threshold with one line
        if not self.gate.always_full and len(self.gate.thresholds) != len(self.masks) + 1:
            raise ViasdError(
                f"routing profile: {len(self.masks)} slim mask(s) need {len(self.masks) + 1} gate thresholds, "
                f"got {len(self.gate.thresholds)}"
            )
        if self.quant and len(self.quant) != len(self.masks):
            raise ViasdError(f"routing profile: {len(self.masks)} slim view(s) but {len(self.quant)} quantizations")

    def slim_quant(self, tier: int) -> QuantRecipe | None:
        """The quantization recipe of slim view `tier` (0-based), or None."""
        return self.quant[tier] if self.quant else None

    @property
    def drafter_quant(self) -> QuantRecipe | None:
        """The quantization of the drafter's view the profile was calibrated with, or None."""
        return _recipe((self.drafter or {}).get("quant"))

    @property
    def self_drafter(self) -> bool:
        """Whether the drafter is the target's own view (no second model)."""
        return bool(self.drafter and self.drafter.get("self"))

    def policy(self, **overrides: Any) -> RoundPolicy:
        """The round policy the profile describes, with some settings overridden (gamma=, cap=, pregate=, stop=;
        None leaves the profile's)."""
        settings = {"gamma": self.gamma, "cap": self.cap, "pregate": self.pregate, "stop": self.stop}
        settings.update({k: v for k, v in overrides.items() if v is not None})
        return RoundPolicy(self.gate, **settings)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["source"]
        data["masks"] = [m.to_dict() for m in self.masks]
        data["gate"] = {"signal": self.gate.signal, "thresholds": list(self.gate.thresholds)}
        data["quant"] = [None if q is None else q.name for q in self.quant]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoutingProfile:
        if data.get("format") != FORMAT:
            raise ViasdError(f"not a routing profile (format {data.get('format')!r}, expected {FORMAT!r})")
        try:
            gate = data.get("gate") or {}
            return cls(
                target=dict(data["target"]),
                drafter=dict(data["drafter"]) if data.get("drafter") else None,
                masks=[LayerMask.from_dict(m) for m in data["masks"]],
                quant=list(data.get("quant", [])),
                gate=Gate(gate.get("signal", "kl"), tuple(float(t) for t in gate.get("thresholds", (0.05, 1.0)))),
                gamma=_integer(data.get("gamma", 4), "gamma"),
                cap=_integer(data.get("cap", 32), "cap"),
                pregate=float(data.get("pregate", 0.0)),
                stop=float(data.get("stop", 0.0)),
                search=dict(data.get("search", {})),
                calibration=dict(data.get("calibration", {})),
                created=str(data.get("created", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ViasdError(f"malformed routing profile: {exc}") from exc

    def check_models(self, target: nn.Module, drafter: nn.Module | None = None) -> None:
        """Refuse a profile made for other models."""
        got = model_fingerprint(target)
        if self.target.get("fingerprint") != got:
            raise ViasdError(
                f"the routing profile was made for target {self.target.get('name')!r} "
                f"(fingerprint {self.target.get('fingerprint')}), not this target (fingerprint {got}); "
                "run `viasd calibrate` for this model pair"
            )
        for mask in self.masks:
            if mask.num_layers != len(target.get_decoder().layers):
                raise ViasdError("the routing profile's masks do not match the target's layer count")
        if self.self_drafter:
            return
        if drafter is not None and self.drafter and self.drafter.get("fingerprint") != model_fingerprint(drafter):
            raise ViasdError(
                f"the routing profile was calibrated with drafter {self.drafter.get('name')!r}, not this drafter; "
                "run `viasd calibrate` for this model pair"
            )


def _recipe(value: Any) -> QuantRecipe | None:
    """A view's quantization as a profile holds it: None, a recipe, or a recipe name (parsed here, once)."""
    if value is None or isinstance(value, QuantRecipe):
        return value
    if not isinstance(value, str):
        raise ViasdError(f"routing profile: a quantization must be a recipe name like int4a8, got {value!r}")
    return QuantRecipe.parse(value)


def _integer(value: Any, name: str) -> int:
    """An integer field of a profile (JSON numbers like 4.0 pass; 4.5, booleans and text do not)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """Write JSON atomically (see viasd.fileio.write_atomic)."""
    write_atomic(path, json.dumps(data, indent=2) + "\n")


def save_profile(profile: RoutingProfile, path: str | os.PathLike[str]) -> None:
    write_json_atomic(path, profile.to_dict())


def load_profile(path: str | os.PathLike[str]) -> RoutingProfile:
    """Read a profile file; a missing, unreadable or malformed file gives a one-line ViasdError."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise ViasdError(f"routing profile not found: {path}") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ViasdError(f"cannot read routing profile {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ViasdError(f"cannot read routing profile {path}: not a JSON object")
    profile = RoutingProfile.from_dict(data)
    profile.source = shipped_place(path) or str(path)
    return profile


def shipped_place(path: str | Path) -> str | None:
    """`viasd/profiles/<file>` when `path` names a profile inside the package (wherever the package lives: a
    checkout or an installation hold the same file), else None."""
    parts = Path(path).parts
    return "/".join(parts[-3:]) if len(parts) >= 3 and parts[-3:-1] == ("viasd", "profiles") else None


def shipped_profile_path(name: str = DEFAULT_PROFILE) -> Path | None:
    """The profile shipped inside the package for a default model pair, if there is one."""
    candidate = resources.files("viasd") / "profiles" / name
    return Path(str(candidate)) if candidate.is_file() else None


def default_profile_path(int4a8: bool) -> Path | None:
    """The shipped profile `via` uses unless told otherwise: the int4a8 one where that kernel runs (`int4a8`),
    else the one whose views (int8 slim verifier, int4 drafter) run well on any x86 CPU."""
    return (shipped_profile_path(INT4A8_PROFILE) if int4a8 else None) or shipped_profile_path()
