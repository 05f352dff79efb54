"""Routing profiles: the calibrated slim-verifier masks, gate, draft length rules and measured costs of a model pair.

A profile is a small JSON file. It names the models it was made for by fingerprint (config plus a
sample of the weights), so a profile made for other models is refused instead of silently misrouting.
A profile file is input like any other: its size and nesting are bounded before it is parsed deeply, and every
field is checked by type and range before anything is built from it (no layer count allocates memory before it
is bounded, no threshold lets tokens through unchecked); each failure is one `ViasdError` line.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from torch import nn

from viasd.decode.round import RoundPolicy
from viasd.errors import ViasdError
from viasd.fileio import write_atomic
from viasd.jsonio import JSONFault, parse_json
from viasd.models.fingerprint import model_fingerprint
from viasd.speculation import DEFAULT_GAMMA, MAX_GAMMA
from viasd.task_kind import TASK_KINDS
from viasd.verify.gates import SIGNALS, Gate
from viasd.views.layer_skip import LayerMask
from viasd.views.recipe import QuantRecipe

FORMAT = "viasd-routing-profile/1"
DEFAULT_PROFILE = "qwen2.5-coder-0.5b__qwen2.5-coder-1.5b.json"
# The default pair's profile for CPUs where viasd's int4a8 kernel runs: int4a8 views as slim verifier and drafter.
INT4A8_PROFILE = "qwen2.5-coder-0.5b__qwen2.5-coder-1.5b.int4a8.json"
# The default target's profile on its GGUF file's blocks (`viasd calibrate --quant gguf`, then `--reselect P --drafters
# head`): via verifies against the file's blocks, its slim verifier those blocks with layers skipped, and drafts with
# the target's shipped draft head (and prompt lookup). The one it was re-selected from, with the 0.5B drafter
# (qwen2.5-coder-0.5b__qwen2.5-coder-1.5b.gguf.json), stays shipped beside it for `via:profile=` its path.
GGUF_PROFILE = "head__qwen2.5-coder-1.5b.gguf.json"
MAX_PROFILE_BYTES = 4 * 1024 * 1024  # the shipped profiles are 11-22 kB
MAX_DEPTH = 32  # nesting of JSON objects and lists (the shipped profiles: 8)
MAX_LAYERS = 4096  # decoder layers of a mask (a mask holds two flags per layer)
MAX_CAP = 1 << 20  # tokens committed without the full target (beyond any generation: no cap)
# Gate thresholds: signals are >= 0, so a negative threshold only sends tokens up (calibration writes -1 for "no
# accept tier"); an infinite one would accept every token unchecked.
MIN_THRESHOLD = -1.0
EXACT = "exact"  # a gate, as a profile file names it, that sends every drafted token to the full target


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
    gamma: int = DEFAULT_GAMMA
    cap: int = 32  # max tokens committed without the full target before a full pass is forced
    pregate: float = 0.0  # drafter confidence under which a round skips the slim pass (0: off)
    stop: float = 0.0  # drafter confidence under which drafting stops for the round (0: off; older profiles)
    search: dict[str, Any] = field(default_factory=dict)  # how the masks were found
    # Round policies for requests of one task kind (viasd.task_kind), each a full set of round settings ({"gate",
    # "gamma", "cap", "pregate", "stop"}) used instead of the ones above: code may need a stricter gate than prose.
    # An entry may also name its own slim views' quantization ("quant", one recipe per mask, parsed to recipes):
    # a view that agrees with the target more often, for the kind that needs it.
    kinds: dict[str, dict[str, Any]] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)  # costs, gate statistics, quality budget
    created: str = ""
    format: str = FORMAT
    source: str | None = field(default=None, compare=False)  # the file it was read from (not written to one)

    def __post_init__(self) -> None:
        self.quant = [_recipe(q) for q in self.quant]
        for kind, own in self.kinds.items():
            if "quant" in own:
                own["quant"] = [_recipe(q) for q in own["quant"]]
                if len(own["quant"]) != len(self.masks):
                    raise ViasdError(
                        f"routing profile: kinds.{kind}.quant has {len(own['quant'])} entries for "
                        f"{len(self.masks)} slim view(s)"
                    )
        self.policy()  # refuses a bad gamma, cap, pre-gate or stop threshold with one line
        for kind in self.kinds:
            self.policy(kind)
        if not self.gate.always_full and len(self.gate.thresholds) != len(self.masks) + 1:
            raise ViasdError(
                f"routing profile: {len(self.masks)} slim mask(s) need {len(self.masks) + 1} gate thresholds, "
                f"got {len(self.gate.thresholds)}"
            )
        if self.quant and len(self.quant) != len(self.masks):
            raise ViasdError(f"routing profile: {len(self.masks)} slim view(s) but {len(self.quant)} quantizations")

    def slim_quant(self, tier: int, kind: str | None = None) -> QuantRecipe | None:
        """The quantization recipe of slim view `tier` (0-based) for requests of task kind `kind` (that kind's own
        where its entry names one, else the profile's), or None."""
        own = self.kinds.get(kind or "", {})
        if "quant" in own:
            return own["quant"][tier]
        return self.quant[tier] if self.quant else None

    def own_views(self) -> list[str]:
        """The task kinds whose slim views differ from the profile's own (their entry names a quantization)."""
        return [kind for kind, own in self.kinds.items() if "quant" in own]

    @property
    def target_quant(self) -> QuantRecipe | None:
        """The view of the target the profile was calibrated on, which `via` verifies against (`gguf`: its file's
        blocks), or None: the target as loaded, its dense copy (every profile before such views)."""
        return _recipe(self.target.get("quant"))

    @property
    def drafter_quant(self) -> QuantRecipe | None:
        """The quantization of the drafter's view the profile was calibrated with, or None."""
        return _recipe((self.drafter or {}).get("quant"))

    @property
    def self_drafter(self) -> bool:
        """Whether the drafter is the target's own view (no second model)."""
        return bool(self.drafter and self.drafter.get("self"))

    @property
    def head_drafter(self) -> str | None:
        """The digest of the target's draft head the profile was calibrated with (no second model), or None."""
        return (self.drafter or {}).get("head")

    def policy(self, kind: str | None = None, **overrides: Any) -> RoundPolicy:
        """The round policy the profile describes for requests of task kind `kind` (its `kinds` entry, or the
        profile's own settings where it has none), with some settings overridden (gamma=, cap=, pregate=, stop=;
        None leaves the profile's)."""
        own = self.kinds.get(kind or "")
        gate = own["gate"] if own else self.gate
        settings = {"gamma": self.gamma, "cap": self.cap, "pregate": self.pregate, "stop": self.stop}
        if own:
            settings.update({k: own[k] for k in settings})
        settings.update({k: v for k, v in overrides.items() if v is not None})
        policy = RoundPolicy(gate, **settings)
        if not gate.always_full and len(gate.thresholds) != len(self.masks) + 1:
            raise ViasdError(
                f"routing profile: {len(self.masks)} slim mask(s) need {len(self.masks) + 1} gate thresholds, "
                f"got {len(gate.thresholds)}" + (f" (kinds.{kind})" if own else "")
            )
        return policy

    def policies(self, **overrides: Any) -> dict[str, RoundPolicy]:
        """The round policy of every task kind the profile has its own settings for (`policy(kind, ...)`)."""
        return {kind: self.policy(kind, **overrides) for kind in self.kinds}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["source"]
        data["masks"] = [m.to_dict() for m in self.masks]
        data["gate"] = _gate_dict(self.gate)
        data["quant"] = [None if q is None else q.name for q in self.quant]
        data["kinds"] = {kind: _policy_dict(own) for kind, own in self.kinds.items()}
        if not data["kinds"]:
            del data["kinds"]  # profiles without per-kind policies stay as they were written
        return data

    @classmethod
    def from_dict(cls, data: Any) -> RoutingProfile:
        """A profile from its JSON form; every field is checked by type and range first (one ViasdError line)."""
        if not isinstance(data, dict):
            raise ViasdError("routing profile: not a JSON object")
        if data.get("format") != FORMAT:
            raise ViasdError(f"not a routing profile (format {_shown(data.get('format'))}, expected {FORMAT!r})")
        _check_depth(data)
        masks = _masks(data.get("masks"))
        return cls(
            target=_model_entry(data.get("target"), "target"),
            drafter=_model_entry(data["drafter"], "drafter") if data.get("drafter") is not None else None,
            masks=masks,
            quant=_list(data.get("quant", []), "quant", len(masks)),
            gate=_gate(data.get("gate", {})),
            gamma=_integer(data.get("gamma", DEFAULT_GAMMA), "the draft length gamma", 1, MAX_GAMMA),
            cap=_integer(data.get("cap", 32), "the cap on tokens committed without the full target", 1, MAX_CAP),
            pregate=_probability(data.get("pregate", 0.0), "the pre-gate"),
            stop=_probability(data.get("stop", 0.0), "the draft stop threshold"),
            kinds=_kinds(data.get("kinds", {})),
            search=_object(data.get("search", {}), "search"),
            calibration=_object(data.get("calibration", {}), "calibration"),
            created=_text(data.get("created", ""), "created"),
        )

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
        if self.self_drafter or self.head_drafter:
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


def _shown(value: Any) -> str:
    """A rejected value for a one-line message: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_depth(data: Any) -> None:
    """Refuse JSON nested deeper than MAX_DEPTH (walked without recursion)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ViasdError(f"routing profile: nested deeper than {MAX_DEPTH} levels")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))


def _as_float(value: Any) -> float | None:
    """A JSON number as a float, or None for anything else (a boolean, text, an integer too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def _integer(value: Any, name: str, low: int, high: int) -> int:
    """An integer field of a profile (JSON numbers like 4.0 pass; 4.5, booleans and text do not), in low..high."""
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())  # NaN, inf: not integral
    if isinstance(value, bool) or not integral:
        raise ViasdError(f"routing profile: {name} must be an integer, got {_shown(value)}")
    if not low <= value <= high:
        raise ViasdError(f"routing profile: {name} must be in {low}..{high}, got {_shown(value)}")
    return int(value)


def _probability(value: Any, name: str) -> float:
    """A probability field of a profile: a finite number (not a boolean or text) in [0, 1]."""
    number = _as_float(value)
    if number is None or not 0.0 <= number <= 1.0:  # NaN fails too
        raise ViasdError(f"routing profile: {name} must be a probability in [0, 1], got {_shown(value)}")
    return number


def _text(value: Any, name: str) -> str:
    """A text field of a profile."""
    if not isinstance(value, str):
        raise ViasdError(f"routing profile: {name} must be text, got {_shown(value)}")
    return value


def _object(value: Any, name: str) -> dict[str, Any]:
    """A JSON object field of a profile (a shallow copy)."""
    if not isinstance(value, dict):
        raise ViasdError(f"routing profile: {name} must be a JSON object, got {_shown(value)}")
    return dict(value)


def _list(value: Any, name: str, length: int | None = None) -> list[Any]:
    """A list field (never a string read letter by letter), of `length` items when given (or empty for `quant`)."""
    if not isinstance(value, list):
        raise ViasdError(f"routing profile: {name} must be a list, got {_shown(value)}")
    if length is not None and value and len(value) != length:
        raise ViasdError(f"routing profile: {name} has {len(value)} entries for {length} slim view(s)")
    return value


def _model_entry(value: Any, role: str) -> dict[str, Any]:
    """The target or drafter entry: name and fingerprint as text, the drafter's quant a recipe name, self a flag."""
    if not isinstance(value, dict):
        raise ViasdError(f"routing profile: {role} must be a JSON object, got {_shown(value)}")
    for key in ("name", "fingerprint", "head"):
        if key in value and not isinstance(value[key], str):
            raise ViasdError(f"routing profile: {role}.{key} must be text, got {_shown(value[key])}")
    if role == "target" and not isinstance(value.get("fingerprint"), str):
        raise ViasdError("routing profile: target.fingerprint is missing")
    if value.get("quant") is not None:
        _recipe(value["quant"])  # refused now, not when the drafter is built
    if not isinstance(value.get("self", False), bool):
        raise ViasdError(f"routing profile: {role}.self must be true or false, got {_shown(value['self'])}")
    return dict(value)


def _masks(value: Any) -> list[LayerMask]:
    """The slim masks: each a layer count in 1..MAX_LAYERS (the same for all) and lists of layer indices in range,
    checked before a mask allocates its flags."""
    items = _list(value, "masks")
    layers: set[int] = set()
    for index, mask in enumerate(items):
        where = f"masks[{index}]"
        if not isinstance(mask, dict):
            raise ViasdError(f"routing profile: {where} must be a JSON object, got {_shown(mask)}")
        layers.add(n := _integer(mask.get("num_layers"), f"{where}.num_layers", 1, MAX_LAYERS))
        for key in ("skip_layers", "skip_attention", "skip_mlp"):
            skipped = _list(mask.get(key, []), f"{where}.{key}")
            if len(skipped) > n:
                raise ViasdError(f"routing profile: {where}.{key} lists {len(skipped)} layers of {n}")
            for i in skipped:
                if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
                    raise ViasdError(f"layer mask: {key} holds {_shown(i)}, not a layer index in 0..{n - 1}")
    if len(layers) > 1:
        raise ViasdError(f"routing profile: the masks are of different layer counts {sorted(layers)}")
    return [LayerMask.from_dict(mask) for mask in items]


def _gate(value: Any, name: str = "gate") -> Gate:
    """The gate: a known signal and a list of finite thresholds, none under MIN_THRESHOLD; or `"exact"` (EXACT):
    every drafted token goes to the full target (a kind whose relaxed gate cost too much quality, such as code)."""
    if value == EXACT:
        return Gate.exact()
    gate = _object(value, name)
    signal = gate.get("signal", "kl")
    if signal not in SIGNALS:
        raise ViasdError(f"routing profile: unknown gate signal {_shown(signal)}; choose one of {', '.join(SIGNALS)}")
    thresholds = [_as_float(t) for t in _list(gate.get("thresholds", [0.05, 1.0]), "gate.thresholds")]
    if any(t is None for t in thresholds):
        raise ViasdError(f"routing profile: gate thresholds must be numbers, got {_shown(gate['thresholds'])}")
    built = Gate(signal, tuple(t for t in thresholds if t is not None))  # refuses NaN and decreasing thresholds
    if not all(math.isfinite(t) and t >= MIN_THRESHOLD for t in built.thresholds):
        raise ViasdError(
            f"routing profile: gate thresholds must be finite numbers >= {MIN_THRESHOLD:g} (an infinite one would "
            f"let every token through unchecked), got {list(built.thresholds)}"
        )
    return built


def _kinds(value: Any) -> dict[str, dict[str, Any]]:
    """Per-kind round policies: for each known task kind, a gate, gamma, cap, pre-gate and stop threshold, checked
    like the profile's own (the gate's threshold count against the masks when the profile is built)."""
    kinds = _object(value, "kinds")
    for kind, own in kinds.items():
        if kind not in TASK_KINDS:
            raise ViasdError(
                f"routing profile: unknown task kind {_shown(kind)} in kinds; known: {', '.join(TASK_KINDS)}"
            )
        where = f"kinds.{kind}"
        own = _object(own, where)
        kinds[kind] = {
            "gate": _gate(own.get("gate"), f"{where}.gate"),
            "gamma": _integer(own.get("gamma"), f"{where}.gamma", 1, MAX_GAMMA),
            "cap": _integer(own.get("cap"), f"{where}.cap", 1, MAX_CAP),
            "pregate": _probability(own.get("pregate"), f"{where}.pregate"),
            "stop": _probability(own.get("stop"), f"{where}.stop"),
        }
        if own.get("quant") is not None:
            kinds[kind]["quant"] = [_recipe(q) for q in _list(own["quant"], f"{where}.quant")]
    return kinds


def _gate_dict(gate: Gate) -> dict[str, Any] | str:
    """A gate in its JSON form: its signal and thresholds, or EXACT (its one threshold, -inf, is not JSON)."""
    return EXACT if gate.always_full else {"signal": gate.signal, "thresholds": list(gate.thresholds)}


def _policy_dict(own: dict[str, Any]) -> dict[str, Any]:
    """A per-kind round policy in its JSON form."""
    gate: Gate = own["gate"]
    data = {**own, "gate": _gate_dict(gate)}
    if "quant" in own:
        data["quant"] = [None if q is None else q.name for q in own["quant"]]
    return data


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """Write JSON atomically (see viasd.fileio.write_atomic)."""
    write_atomic(path, json.dumps(data, indent=2) + "\n")


def save_profile(profile: RoutingProfile, path: str | os.PathLike[str]) -> None:
    write_json_atomic(path, profile.to_dict())


def _read_bounded(path: str | os.PathLike[str]) -> bytes:
    """A profile file's bytes, refused when over MAX_PROFILE_BYTES (reading one byte past it at most)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_PROFILE_BYTES + 1)
    except FileNotFoundError as exc:
        raise ViasdError(f"routing profile not found: {path}") from exc
    except OSError as exc:
        raise ViasdError(f"cannot read routing profile {path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_PROFILE_BYTES:
        raise ViasdError(f"cannot read routing profile {path}: larger than {MAX_PROFILE_BYTES // (1 << 20)} MiB")
    return data


def load_profile(path: str | os.PathLike[str]) -> RoutingProfile:
    """Read a profile file; a missing, unreadable, oversized, too deeply nested or malformed file, or one with a
    field of the wrong type or out of range, gives a one-line ViasdError."""
    try:
        data = parse_json(_read_bounded(path).decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ViasdError(f"cannot read routing profile {path}: {exc}") from exc
    except JSONFault as exc:
        raise ViasdError(f"cannot read routing profile {path}: {exc}") from None
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


def default_profile_path(int4a8: bool, stored: bool = False) -> Path | None:
    """The shipped profile `via` uses unless told otherwise: the one calibrated on the file's blocks where the target
    runs as them (`stored`), else the int4a8 one where that kernel runs (`int4a8`), else the one whose views (int8
    slim verifier, int4 drafter) run well on any x86 CPU."""
    found = shipped_profile_path(GGUF_PROFILE) if stored else None
    return found or (shipped_profile_path(INT4A8_PROFILE) if int4a8 else None) or shipped_profile_path()
