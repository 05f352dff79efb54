"""The options a method variant may set (`sd:gamma=6:stop=0.4`): each parsed from its text once, where the name
is read, and checked by the one check its setting has (viasd.speculation)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from viasd.errors import ViasdError
from viasd.speculation import (
    DEFAULT_REACH,
    DEFAULT_STOP,
    HYBRID_BUDGET,
    HYBRID_MATCH,
    LOOKUP_MATCH,
    MAX_GAMMA,
    NGRAM_TYPES,
    check_budget,
    check_gamma,
    check_match,
    check_reach,
    check_stop,
)
from viasd.views.recipe import QuantRecipe, TargetQuant, parse_target_quant

# What the `drafter` option of sd and via may name; the head ones need no drafter model (heads/, drafters/head.py).
DRAFTERS = ("model", "lookup", "hybrid", "head", "lookup+head", "suffix", "suffix+head")
HEAD_DRAFTERS = ("head", "lookup+head", "suffix+head")
SUFFIX_DRAFTERS = ("suffix", "suffix+head")
# The options of a method that drafts (sd, via, via-exact), in the order messages list them.
DRAFTING_OPTIONS = ("stop", "drafter", "match", "copy", "budget", "reach", "head", "head_compute", "head_vocab")


def _number(key: str, text: str, kind: type[int] | type[float]) -> Any:
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ViasdError(f"method option {key} must be {what}, got {text!r}") from None


def _checked(kind: type[int] | type[float], check: Callable[[Any, str], Any]) -> Callable[[str, str], Any]:
    """A parser of an option whose setting has its own check: the number, then that check (naming the option)."""

    def parse(key: str, text: str) -> Any:
        return check(_number(key, text, kind), f"method option {key}")

    return parse


def _int_in(low: int, high: int) -> Callable[[str, str], int]:
    def parse(key: str, text: str) -> int:
        value = _number(key, text, int)
        if not low <= value <= high:
            raise ViasdError(f"method option {key} must be in {low}..{high}, got {value}")
        return value

    return parse


def _fraction(key: str, text: str) -> float:
    value = _number(key, text, float)
    if not 0.0 <= value <= 1.0:
        raise ViasdError(f"method option {key} must be in [0, 1], got {value}")
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


def _recipe(key: str, text: str) -> QuantRecipe:
    """A quantization recipe (`int8`, `int4`, `int8:smooth=0.5`, `gguf`, ...), parsed here, once."""
    try:
        return QuantRecipe.parse(text)
    except ViasdError as error:
        raise ViasdError(f"method option {key}: {error}") from None


def _target_quant(key: str, text: str) -> TargetQuant:
    """What the target runs as: `none` (as loaded: the dense copy) or a quantization recipe."""
    try:
        return parse_target_quant(text)
    except ViasdError as error:
        raise ViasdError(f"method option {key}: {error} (or none: the target as loaded, its dense copy)") from None


def _task_kind(key: str, text: str) -> str | None:
    from viasd.task_kind import parse_kind

    try:
        return parse_kind(text)
    except ViasdError as error:
        raise ViasdError(f"method option {key}: {error}") from None


@dataclass(frozen=True)
class Option:
    """A setting a method variant may override."""

    name: str
    parse: Callable[[str, str], Any]
    help: str


OPTIONS: dict[str, Option] = {
    o.name: o
    for o in (
        Option("gamma", _checked(int, check_gamma), "most draft tokens per round"),
        Option("cap", _int_in(1, 1 << 16), "most tokens committed without the full target (via)"),
        Option("profile", _path, "routing profile JSON (via)"),
        Option("pregate", _fraction, "drafter confidence under which a round skips the slim pass (via)"),
        Option(
            "kind",
            _task_kind,
            "task kind whose round policy routes every request: code, prose, or auto (read from each prompt; via)",
        ),
        Option(
            "quant",
            _target_quant,
            "what the target runs as: a quantized view (int8, int8wo, int4, int4a8, gguf) or none (as loaded: the "
            "dense bf16 copy of a GGUF file); default: as its file stores it (a GGUF file's gguf view)",
        ),
        Option("drafter_quant", _recipe, "run the drafter as its quantized view (self: the target's own view)"),
        Option("lookup", _int_in(0, MAX_GAMMA), "prompt-lookup draft tokens per round, 0 = off (llama.cpp)"),
        Option(
            "stop",
            _checked(float, check_stop),
            "drafter confidence under which drafting stops for the round, that token included (0: always gamma; "
            f"sd: {DEFAULT_STOP:g}, via: the profile's)",
        ),
        Option(
            "drafter",
            _choice(*DRAFTERS),
            "model (the small drafter), lookup (prompt lookup), hybrid (lookup when it matches, else the model), head "
            "(the target's draft head: viasd train-drafter), lookup+head (lookup when it matches, else the head), "
            "suffix (the longest earlier match, in this request and recent ones, copied past gamma when long) or "
            "suffix+head (suffix when it matches 3 tokens, else the head)",
        ),
        Option("head", _path, "the draft head file of drafter=head (default: the one trained here, or shipped)"),
        Option(
            "head_compute",
            _choice("int8", "bfloat16", "float32"),
            "what the draft head computes in (default on a CPU: int8 where viasd's 8-bit kernel runs, else bfloat16 "
            "where the CPU multiplies it natively, else float32)",
        ),
        Option(
            "head_vocab",
            _choice("context", "own"),
            "the tokens the draft head scores: context (default: its own and the context's it lacks) or own",
        ),
        Option(
            "match",
            _checked(int, check_match),
            f"shortest n-gram match that prompt lookup copies from (lookup: {LOOKUP_MATCH}, hybrid: {HYBRID_MATCH})",
        ),
        Option("copy", _checked(int, check_gamma), "most tokens prompt lookup copies per round (default: up to gamma)"),
        Option(
            "reach",
            _checked(int, check_reach),
            f"most tokens a suffix drafter copies in a round from a long match, past gamma (at most and by default "
            f"{DEFAULT_REACH}: its verification then stays on viasd's exact fused passes)",
        ),
        Option(
            "budget",
            _checked(float, check_budget),
            f"token budget per prompt token below which the hybrid leaves its model drafter out ({HYBRID_BUDGET:g}; "
            "0: never)",
        ),
        Option(
            "draft",
            _choice("none", "model", *NGRAM_TYPES),
            "llama-server's own speculation: model (the drafter's GGUF file as its draft model, -md), one of its "
            f"n-gram drafters ({', '.join(NGRAM_TYPES)}), or none",
        ),
    )
}


def check_drafter_options(name: str, options: Mapping[str, Any]) -> None:
    """Refuse options that the variant's drafter would ignore: lookup settings without prompt lookup, a stop
    threshold without a drafter that has a confidence (for methods that take a `drafter`)."""
    drafter = options.get("drafter", "model")
    for key in ("match", "copy"):
        if key in options and drafter in ("model", "head", *SUFFIX_DRAFTERS):
            raise ViasdError(f"method {name!r}: option {key!r} needs drafter=lookup, hybrid or lookup+head")
    if "reach" in options and drafter not in SUFFIX_DRAFTERS:
        raise ViasdError(f"method {name!r}: option 'reach' needs drafter=suffix or drafter=suffix+head")
    if "budget" in options and drafter != "hybrid":
        raise ViasdError(f"method {name!r}: option 'budget' needs drafter=hybrid")
    for key in ("head", "head_compute", "head_vocab"):
        if key in options and drafter not in HEAD_DRAFTERS:
            raise ViasdError(f"method {name!r}: option {key!r} needs drafter=head or drafter=lookup+head")
    if "drafter_quant" in options and drafter in HEAD_DRAFTERS:
        raise ViasdError(f"method {name!r}: option 'drafter_quant' needs a drafter model (a head has none)")
    if "stop" in options and drafter in ("lookup", "suffix"):
        raise ViasdError(f"method {name!r}: option 'stop' needs a model drafter (drafter=model or drafter=hybrid)")
