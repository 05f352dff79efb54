"""Decoding methods and their variants.

A method is named `BASE` or `BASE:key=value[:key=value...]`, for example `sd:gamma=6` or
`via:gamma=4:pregate=0.5`. Variants let one benchmark or server compare settings of the same method side
by side; the name as written is what rows, tables and metrics are labelled with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from viasd.errors import ViasdError

# method name -> what it is, for help texts and listings
METHODS: dict[str, str] = {
    "plain": "plain autoregressive decoding of the target (baseline)",
    "sd": "classic speculative decoding with the small drafter model (exact)",
    "lookup": "speculative decoding with prompt-lookup (n-gram) drafts (exact)",
    "self": "self-speculative decoding: the target under a routing mask drafts (exact)",
    "via": "VIA-SD: drafter -> slim verifier (routed target) -> full target, gated per token (relaxed)",
    "via-exact": "VIA-SD machinery with every token sent to the full target (equals sd)",
    "hf-assisted": "Hugging Face transformers' assisted generation with the small drafter (reference, exact)",
}


def _int_at_least(low: int) -> Callable[[str, str], int]:
    def parse(key: str, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ViasdError(f"method option {key} must be an integer, got {text!r}") from None
        if value < low:
            raise ViasdError(f"method option {key} must be >= {low}, got {value}")
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


def _path(key: str, text: str) -> str:
    if not text:
        raise ViasdError(f"method option {key} needs a file path")
    return text


# option -> (parser, what it sets)
OPTIONS: dict[str, tuple[Callable[[str, str], Any], str]] = {
    "gamma": (_int_at_least(1), "draft tokens per round"),
    "cap": (_int_at_least(1), "most tokens committed without the full target (via)"),
    "profile": (_path, "routing profile JSON (via)"),
    "pregate": (_fraction, "drafter confidence under which a round skips the slim pass (via)"),
}
ALLOWED: dict[str, tuple[str, ...]] = {
    "plain": (),
    "sd": ("gamma",),
    "lookup": ("gamma",),
    "self": ("gamma",),
    "hf-assisted": ("gamma",),
    "via": ("gamma", "cap", "profile", "pregate"),
    "via-exact": ("gamma", "cap", "profile"),
}


@dataclass(frozen=True)
class MethodSpec:
    """A parsed method name: the base method and the options a variant overrides (None: the default)."""

    name: str
    base: str
    gamma: int | None = None
    cap: int | None = None
    profile: str | None = None
    pregate: float | None = None

    @property
    def uses_drafter(self) -> bool:
        """Whether the method needs the small drafter model."""
        return self.base not in {"plain", "lookup", "self"}


def parse_method(text: str) -> MethodSpec:
    """`BASE[:key=value...]` -> MethodSpec, with a one-line error naming what is wrong."""
    name = text.strip()
    base, *parts = name.split(":")
    if base not in METHODS:
        raise ViasdError(f"unknown method {base!r}; choose one of: {', '.join(METHODS)}")
    options: dict[str, Any] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in OPTIONS:
            raise ViasdError(
                f"bad option {part!r} in method {name!r}: write key=value with key one of {', '.join(OPTIONS)}"
            )
        if key not in ALLOWED[base]:
            allowed = ", ".join(ALLOWED[base]) or "none"
            raise ViasdError(f"method {base!r} takes no option {key!r} (it takes: {allowed})")
        if key in options:
            raise ViasdError(f"method {name!r} sets {key!r} twice")
        options[key] = OPTIONS[key][0](key, value)
    return MethodSpec(name=name, base=base, **options)


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
