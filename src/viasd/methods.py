"""Decoding methods: one registry of their names, options, descriptions and how each builds its decoder.

A method is named `NAME` or `NAME:key=value[:key=value...]`, for example `sd:gamma=6`, `sd:drafter=hybrid`,
`sd:stop=0.4` or `via:gamma=4:pregate=0.5`. Variants let one benchmark or server compare settings of the same
method side by side; the name as written is what rows, tables and metrics are labelled with.

Builders import the decoding modules when they run, so that parsing a method name (the CLI does it before
loading any model) stays free of torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from viasd.errors import ViasdError

if TYPE_CHECKING:
    from viasd.decode.base import Decoder
    from viasd.drafters.base import Drafter
    from viasd.models.layer_skip import LayerMask
    from viasd.models.loading import LoadedModel
    from viasd.profile import RoutingProfile

MAX_GAMMA = 64  # as decode.round.MAX_GAMMA (kept here so that parsing stays free of torch)
DRAFTERS = ("model", "lookup", "hybrid")  # what the `drafter` option of sd and via may name
# sd's draft stop threshold, chosen from counts on the development prompts (BENCHMARKS.md, "Drafts that adapt"):
# it cuts the drafts that no verifier looks at from 21.5% to 7.3% and is estimated 1.11x faster in decoding.
DEFAULT_STOP = 0.5
# The hybrid drafter copies when the context's tail matches at least this many tokens earlier (2-token matches
# copied nothing right in HumanEval answers: 11 rounds, 0 tokens kept).
HYBRID_MATCH = 3
# Budget tokens per prompt token for the hybrid to use its model drafter (drafters.hybrid.uses_model): on the
# 2-core CPU its prefill costs about 3.3 ms per prompt token (2.6 s for 800 tokens) and it saves about 80 ms per
# generated token (a 0.24 s target step against sd's 0.16 s per token), so it pays back after 0.04 answer tokens
# per prompt token; twice that, for answers that use half their budget.
HYBRID_BUDGET = 0.08
LOOKUP_MATCH = 1  # the lookup method's shortest match (prompt lookup as published: any n-gram from 3 down to 1)


class Parts(Protocol):
    """What a method builds its decoder from; the Engine provides it."""

    @property
    def target(self) -> LoadedModel: ...

    @property
    def drafter(self) -> LoadedModel: ...

    @property
    def gamma(self) -> int | None:
        """The engine-wide draft length (--gamma), if one was given."""
        ...

    def routing_profile(self, path: str | None = None) -> RoutingProfile: ...

    def self_mask(self) -> LayerMask: ...


# ------------------------------------------------------------------------------------------ options


def _int_in(low: int, high: int) -> Callable[[str, str], int]:
    def parse(key: str, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ViasdError(f"method option {key} must be an integer, got {text!r}") from None
        if not low <= value <= high:
            raise ViasdError(f"method option {key} must be in {low}..{high}, got {value}")
        return value

    return parse


def _fraction(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ViasdError(f"method option {key} must be a number, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise ViasdError(f"method option {key} must be in [0, 1], got {value}")
    return value


def _nonnegative(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ViasdError(f"method option {key} must be a number, got {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise ViasdError(f"method option {key} must be a number >= 0, got {value}")
    return value


def _choice(*values: str) -> Callable[[str, str], str]:
    def parse(key: str, text: str) -> str:
        if text not in values:
            raise ViasdError(f"method option {key} must be one of {', '.join(values)}, got {text!r}")
        return text

    return parse


def _path(key: str, text: str) -> str:
    if not text:
        raise ViasdError(f"method option {key} needs a file path")
    return text


@dataclass(frozen=True)
class Option:
    """A setting a method variant may override."""

    name: str
    parse: Callable[[str, str], Any]
    help: str


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        Option("gamma", _int_in(1, MAX_GAMMA), "most draft tokens per round"),
        Option("cap", _int_in(1, 1 << 16), "most tokens committed without the full target (via)"),
        Option("profile", _path, "routing profile JSON (via)"),
        Option("pregate", _fraction, "drafter confidence under which a round skips the slim pass (via)"),
        Option(
            "stop",
            _fraction,
            "drafter confidence under which drafting stops for the round, that token included (0: always gamma; "
            f"sd: {DEFAULT_STOP:g}, via: the profile's)",
        ),
        Option(
            "drafter",
            _choice(*DRAFTERS),
            "model (the small drafter), lookup (prompt lookup) or hybrid (lookup when it matches, else the model)",
        ),
        Option(
            "match",
            _int_in(1, 16),
            f"shortest n-gram match that prompt lookup copies from (lookup: {LOOKUP_MATCH}, hybrid: {HYBRID_MATCH})",
        ),
        Option("copy", _int_in(1, MAX_GAMMA), "most tokens prompt lookup copies per round (default: up to gamma)"),
        Option(
            "budget",
            _nonnegative,
            f"token budget per prompt token below which the hybrid leaves its model drafter out ({HYBRID_BUDGET:g}; "
            "0: never)",
        ),
    )
}


# ------------------------------------------------------------------------------------------ methods


@dataclass(frozen=True)
class MethodSpec:
    """A parsed method name: the method and the options its variant overrides."""

    name: str  # as written, e.g. "via:gamma=4"
    method: Method
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def base(self) -> str:
        return self.method.name

    @property
    def uses_drafter(self) -> bool:
        """Whether the variant needs the small drafter model (`sd:drafter=lookup` does not)."""
        return self.method.uses_drafter and self.options.get("drafter") != "lookup"

    def get(self, key: str) -> Any:
        """An option's value, or None when the variant leaves it at the method's default."""
        return self.options.get(key)


@dataclass(frozen=True)
class Method:
    """A decoding method: what it is, which options its variants take, and how its decoder is built."""

    name: str
    description: str
    build: Callable[[Parts, MethodSpec], Decoder]
    options: tuple[str, ...] = ()
    uses_drafter: bool = False
    exact: bool = True


def _gamma(parts: Parts, spec: MethodSpec, default: int = 4) -> int:
    return spec.get("gamma") or parts.gamma or default


def _stop(spec: MethodSpec, default: float) -> float:
    stop = spec.get("stop")
    return default if stop is None else float(stop)


def _lookup_drafter(spec: MethodSpec, match: int) -> Drafter:
    from viasd.drafters.prompt_lookup import PromptLookupDrafter

    shortest = spec.get("match") or match
    return PromptLookupDrafter(max_ngram=max(3, shortest), min_ngram=shortest, copy=spec.get("copy"))


def _drafter(parts: Parts, spec: MethodSpec) -> Drafter:
    """The drafter a variant names: the small model (default), prompt lookup, or the hybrid of both."""
    from viasd.drafters.hybrid import HybridDrafter
    from viasd.drafters.model_drafter import ModelDrafter

    kind = spec.get("drafter") or "model"
    if kind == "lookup":
        return _lookup_drafter(spec, LOOKUP_MATCH)
    model = ModelDrafter(parts.drafter.model, name="model")
    if kind == "model":
        return model
    budget = spec.get("budget")
    return HybridDrafter(_lookup_drafter(spec, HYBRID_MATCH), model, HYBRID_BUDGET if budget is None else budget)


def _plain(parts: Parts, spec: MethodSpec) -> Decoder:
    from viasd.decode.plain import PlainDecoder

    return PlainDecoder(parts.target.model, parts.target.tokenizer)


def _sd(parts: Parts, spec: MethodSpec) -> Decoder:
    from viasd.decode.speculative import SpeculativeDecoder

    target = parts.target
    gamma, stop = _gamma(parts, spec), _stop(spec, DEFAULT_STOP)
    return SpeculativeDecoder(target.model, target.tokenizer, _drafter(parts, spec), gamma, spec.name, stop)


def _lookup(parts: Parts, spec: MethodSpec) -> Decoder:
    from viasd.decode.speculative import SpeculativeDecoder

    target = parts.target
    drafter = _lookup_drafter(spec, LOOKUP_MATCH)
    return SpeculativeDecoder(target.model, target.tokenizer, drafter, _gamma(parts, spec), spec.name)


def _self(parts: Parts, spec: MethodSpec) -> Decoder:
    from viasd.decode.speculative import SpeculativeDecoder
    from viasd.drafters.model_drafter import ModelDrafter

    target = parts.target
    drafter = ModelDrafter(target.model, parts.self_mask(), name="self")
    gamma, stop = _gamma(parts, spec), _stop(spec, 0.0)  # not measured for self: off unless asked
    return SpeculativeDecoder(target.model, target.tokenizer, drafter, gamma, spec.name, stop)


def _hf_assisted(parts: Parts, spec: MethodSpec) -> Decoder:
    from viasd.decode.hf_assisted import HFAssistedDecoder

    target = parts.target
    gamma = spec.get("gamma") or parts.gamma  # None keeps transformers' own draft policy
    return HFAssistedDecoder(target.model, target.tokenizer, parts.drafter.model, gamma, spec.name)


def _via(parts: Parts, spec: MethodSpec) -> Decoder:
    from viasd.decode.round import RoundPolicy
    from viasd.decode.tiered import TieredDecoder
    from viasd.verify.gates import Gate

    profile = parts.routing_profile(spec.get("profile"))
    policy = profile.policy(
        gamma=spec.get("gamma") or parts.gamma, cap=spec.get("cap"), pregate=spec.get("pregate"), stop=spec.get("stop")
    )
    if spec.base == "via-exact":
        policy = RoundPolicy(Gate.exact(), policy.gamma, policy.cap, stop=policy.stop)
    target = parts.target
    return TieredDecoder(target.model, target.tokenizer, _drafter(parts, spec), profile.masks, policy, spec.name)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("plain", "plain autoregressive decoding of the target (baseline)", _plain),
        Method(
            "sd",
            "classic speculative decoding with the small drafter model (exact)",
            _sd,
            ("gamma", "stop", "drafter", "match", "copy", "budget"),
            True,
        ),
        Method(
            "lookup",
            "speculative decoding with prompt-lookup (n-gram) drafts (exact)",
            _lookup,
            ("gamma", "match", "copy"),
        ),
        Method(
            "self",
            "self-speculative decoding: the target with layers skipped drafts (exact)",
            _self,
            ("gamma", "stop"),
        ),
        Method(
            "via",
            "VIA-SD: drafter -> slim verifier (target with layers skipped) -> full target, gated per token (relaxed)",
            _via,
            ("gamma", "cap", "profile", "pregate", "stop", "drafter", "match", "copy", "budget"),
            uses_drafter=True,
            exact=False,
        ),
        Method(
            "via-exact",
            "VIA-SD machinery with every token sent to the full target (equals sd)",
            _via,
            ("gamma", "cap", "profile", "stop", "drafter", "match", "copy", "budget"),
            uses_drafter=True,
        ),
        Method(
            "hf-assisted",
            "Hugging Face transformers' assisted generation with the small drafter (reference, exact)",
            _hf_assisted,
            ("gamma",),
            uses_drafter=True,
        ),
    )
}


def parse_method(text: str) -> MethodSpec:
    """`NAME[:key=value...]` -> MethodSpec, with a one-line error naming what is wrong."""
    name = text.strip()
    base, *parts = name.split(":")
    method = METHODS.get(base)
    if method is None:
        raise ViasdError(f"unknown method {base!r}; choose one of: {', '.join(METHODS)}")
    options: dict[str, Any] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in OPTIONS:
            raise ViasdError(
                f"bad option {part!r} in method {name!r}: write key=value with key one of {', '.join(OPTIONS)}"
            )
        if key not in method.options:
            allowed = ", ".join(method.options) or "none"
            raise ViasdError(f"method {base!r} takes no option {key!r} (it takes: {allowed})")
        if key in options:
            raise ViasdError(f"method {name!r} sets {key!r} twice")
        options[key] = OPTIONS[key].parse(key, value)
    _check_drafter_options(name, method, options)
    return MethodSpec(name=name, method=method, options=options)


def _check_drafter_options(name: str, method: Method, options: Mapping[str, Any]) -> None:
    """Refuse options that the variant's drafter would ignore: lookup settings without prompt lookup, a stop
    threshold without a drafter that has a confidence."""
    if "drafter" not in method.options:
        return
    drafter = options.get("drafter", "model")
    for key in ("match", "copy"):
        if key in options and drafter == "model":
            raise ViasdError(f"method {name!r}: option {key!r} needs drafter=lookup or drafter=hybrid")
    if "budget" in options and drafter != "hybrid":
        raise ViasdError(f"method {name!r}: option 'budget' needs drafter=hybrid")
    if "stop" in options and drafter == "lookup":
        raise ViasdError(f"method {name!r}: option 'stop' needs a model drafter (drafter=model or drafter=hybrid)")


def parse_method_list(text: str) -> list[MethodSpec]:
    """Comma-separated methods (variants allowed), each checked, duplicates refused."""
    specs = [parse_method(part) for part in text.split(",") if part.strip()]
    if not specs:
        raise ViasdError("no methods given")
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ViasdError(f"method(s) named twice: {', '.join(twice)}")
    return specs
