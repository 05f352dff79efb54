"""The decoding methods by name, and the one parser of a method name (`NAME[:key=value...]`) into a MethodSpec.

A method is named `NAME` or `NAME:key=value[:key=value...]`, for example `sd:gamma=6`, `sd:drafter=hybrid`,
`sd:stop=0.4` or `via:gamma=4:pregate=0.5`. Variants let one benchmark or server compare settings of the same
method side by side; the name as written is what rows, tables and metrics are labelled with. Each edge (the CLI,
the server's settings, the bench) parses its names once, here, and hands the MethodSpec on.
"""

from __future__ import annotations

from typing import Any

from viasd.errors import ViasdError
from viasd.methods.baselines import hf_assisted, llama_cpp, llama_server
from viasd.methods.builders import auto, lookup, plain, sd, self_speculative
from viasd.methods.method import Method, MethodSpec
from viasd.methods.options import DRAFTING_OPTIONS, OPTIONS, check_drafter_options
from viasd.methods.via import via

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "auto",
            "the fastest exact method here (plain, lookup, sd, quantized and hybrid drafters): probed once, cached",
            auto,
        ),
        Method("plain", "plain autoregressive decoding of the target (baseline)", plain, ("quant",)),
        Method(
            "sd",
            "classic speculative decoding with the small drafter model (exact)",
            sd,
            ("gamma", *DRAFTING_OPTIONS, "quant", "drafter_quant"),
            uses_drafter=True,
        ),
        Method(
            "lookup",
            "speculative decoding with prompt-lookup (n-gram) drafts (exact)",
            lookup,
            ("gamma", "match", "copy", "quant"),
        ),
        Method(
            "self",
            "self-speculative decoding: a cheaper view of the target drafts (layers skipped, or drafter_quant) (exact)",
            self_speculative,
            ("gamma", "stop", "quant", "drafter_quant"),
        ),
        Method(
            "via",
            "VIA-SD: drafter -> slim verifier (target with layers skipped) -> full target, gated per token (relaxed)",
            via,
            ("gamma", "cap", "profile", "pregate", "kind", *DRAFTING_OPTIONS, "drafter_quant"),
            uses_drafter=True,
            exact=False,
            target="profile",
        ),
        Method(
            "via-exact",
            "VIA-SD machinery with every token sent to the full target (equals sd on the same view)",
            via,
            ("gamma", "cap", "profile", *DRAFTING_OPTIONS, "drafter_quant"),
            uses_drafter=True,
            target="profile",
        ),
        Method(
            "hf-assisted",
            "Hugging Face transformers' assisted generation with the small drafter (reference, exact)",
            hf_assisted,
            ("gamma",),
            uses_drafter=True,
            target="dense",
            penalties=False,
            logprobs=False,
        ),
        Method(
            "llama.cpp",
            "llama.cpp on the target's GGUF file (baseline; lookup=N: its prompt-lookup speculation; needs "
            "viasd[llamacpp])",
            llama_cpp,
            ("lookup",),
            exact=False,
            target="file",
            penalties=False,
            logprobs=False,
        ),
        Method(
            "llama-server",
            "llama.cpp's own server on the target's GGUF file (baseline; draft=model: its speculative decoding with "
            "the drafter's GGUF file, gamma=N its most draft tokens; needs the llama-server binary)",
            llama_server,
            ("draft", "gamma"),
            exact=False,
            target="file",
            logprobs=False,
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
    if "drafter" in method.options:
        check_drafter_options(name, options)
    return MethodSpec(name=name, method=method, options=options)


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
