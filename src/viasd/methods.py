"""Decoding methods: one registry of their names, options, descriptions and how each builds its decoder.

A method is named `NAME` or `NAME:key=value[:key=value...]`, for example `sd:gamma=6`, `sd:drafter=hybrid`,
`sd:stop=0.4` or `via:gamma=4:pregate=0.5`. Variants let one benchmark or server compare settings of the same
method side by side; the name as written is what rows, tables and metrics are labelled with.

Builders import the decoding modules when they run, so that parsing a method name (the CLI does it before
loading any model) stays free of torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from viasd.decode import MAX_GAMMA
from viasd.errors import ViasdError
from viasd.views.recipe import QuantRecipe, TargetQuant, parse_target_quant

if TYPE_CHECKING:
    from viasd.decode.base import Decoder
    from viasd.drafters.base import Drafter
    from viasd.heads.file import HeadFile
    from viasd.models.loading import LoadedModel
    from viasd.profile import RoutingProfile
    from viasd.spec import EngineSpec
    from viasd.views.layer_skip import LayerMask
    from viasd.views.view import View
# What the `drafter` option of sd and via may name; the head ones need no drafter model (heads/, drafters/head.py).
DRAFTERS = ("model", "lookup", "hybrid", "head", "lookup+head")
HEAD_DRAFTERS = ("head", "lookup+head")
# The options of a method that drafts (sd, via, via-exact), in the order messages list them.
DRAFTING_OPTIONS = ("stop", "drafter", "match", "copy", "budget", "head", "head_compute", "head_vocab")
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
    def spec(self) -> EngineSpec:
        """The engine's settings: models, and what every method shares (--gamma, --quant, --drafter-quant)."""
        ...

    def target_recipe(self, asked: TargetQuant | None = None) -> QuantRecipe | None:
        """The recipe of the view the target runs as (None: as loaded): `asked` (a variant's quant), else --quant,
        else as its file stores it."""
        ...

    @property
    def target(self) -> LoadedModel: ...

    @property
    def drafter(self) -> LoadedModel: ...

    def routing_profile(self, path: str | None = None) -> RoutingProfile: ...

    def profile_as_read(self, path: str | None = None) -> RoutingProfile: ...

    def self_mask(self) -> LayerMask: ...

    def gguf(self) -> Path:
        """The target's GGUF file (for runtimes that read GGUF)."""
        ...

    def decoder(self, method: str) -> Decoder:
        """The decoder of another method (built once)."""
        ...

    def drafter_fits(self) -> bool | None:
        """Whether the drafter shares the target's tokenizer (None: unknown without loading it)."""
        ...

    def quantized(self, model: LoadedModel, recipe: QuantRecipe | None) -> View | None:
        """The quantized view of `model` by `recipe` (None: no view), made once and cached."""
        ...

    def draft_head(self, path: str | None = None) -> HeadFile:
        """The target's draft head (`path`, else the one trained here, else a shipped one), read once."""
        ...


def first_set(*values: Any) -> Any:
    """The first of `values` that is set (not None): a variant's option, then the engine's, then a default. (Not
    `or`: 0 and 0.0 are settings.)"""
    return next((value for value in values if value is not None), None)


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
        Option("gamma", _int_in(1, MAX_GAMMA), "most draft tokens per round"),
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
            _fraction,
            "drafter confidence under which drafting stops for the round, that token included (0: always gamma; "
            f"sd: {DEFAULT_STOP:g}, via: the profile's)",
        ),
        Option(
            "drafter",
            _choice(*DRAFTERS),
            "model (the small drafter), lookup (prompt lookup), hybrid (lookup when it matches, else the model), head "
            "(the target's draft head: viasd train-drafter) or lookup+head (lookup when it matches, else the head)",
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
        Option(
            "draft",
            _choice("none", "model"),
            "llama-server's own speculation: model (the drafter's GGUF file as its draft model, -md) or none",
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
        return self.method.uses_drafter and self.options.get("drafter") not in ("lookup", *HEAD_DRAFTERS)

    @property
    def exact(self) -> bool:
        """Exact with respect to the target as run (its view: a quantized target is another model; `target_as_run`
        in `Engine.describe` names it)."""
        return self.method.exact

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
    # Which target it runs: "view" (the target as --quant or its quant= says, by default as its file stores it),
    # "dense" (the model as loaded, whatever the default), "profile" (the view its routing profile was calibrated on:
    # via's) or "file" (llama.cpp).
    target: str = "view"
    # Whether it applies min_p, the penalties, logit_bias and min_tokens (verify/penalties.py); else it refuses them.
    penalties: bool = True
    # Whether it reports the target's log-probabilities (decode/logprobs.py); else a request for them is refused.
    logprobs: bool = True


DEFAULT_GAMMA = 4


def _gamma(parts: Parts, spec: MethodSpec, default: int = DEFAULT_GAMMA) -> int:
    return first_set(spec.get("gamma"), parts.spec.gamma, default)


def _round_gamma(parts: Parts, view: View | None) -> int:
    """Draft tokens per round unless asked: DEFAULT_GAMMA, or one fewer than the tokens a pass of the target as run
    costs about one step for, where that is known and larger (the dense target on the native bf16 kernel: drafts of
    7 ran 1.09x drafts of 4 with the 0.5B drafter's int4a8 view and 1.00-1.01x with the others, Zen 4)."""
    from viasd.passes.bf16_linear import cheap_block

    block = cheap_block(parts.target.model) if view is None else None
    return max(DEFAULT_GAMMA, block - 1) if block else DEFAULT_GAMMA


def _target_recipe(parts: Parts, spec: MethodSpec) -> QuantRecipe | None:
    return parts.target_recipe(spec.get("quant"))


def _target_view(parts: Parts, spec: MethodSpec) -> View | None:
    """The target's view for a method: its quantized view when the variant or --quant asks for one, or by default
    where it comes from a GGUF file (the file's own blocks)."""
    return parts.quantized(parts.target, _target_recipe(parts, spec))


def _drafter_recipe(parts: Parts, spec: MethodSpec) -> QuantRecipe | None:
    return first_set(spec.get("drafter_quant"), parts.spec.drafter_quant)


def _stop(spec: MethodSpec, default: float) -> float:
    return first_set(spec.get("stop"), default)


def _lookup_drafter(spec: MethodSpec, match: int) -> Drafter:
    from viasd.drafters.prompt_lookup import PromptLookupDrafter

    shortest = spec.get("match") or match
    return PromptLookupDrafter(max_ngram=max(3, shortest), min_ngram=shortest, copy=spec.get("copy"))


def _drafter(parts: Parts, spec: MethodSpec, recipe: QuantRecipe | None = None) -> Drafter:
    """The drafter a variant names: the small model (default; as its quantized view by `recipe`), prompt lookup,
    or the hybrid of both."""
    from viasd.drafters.hybrid import HybridDrafter
    from viasd.drafters.model_drafter import ModelDrafter

    kind = spec.get("drafter") or "model"
    if kind == "lookup":
        return _lookup_drafter(spec, LOOKUP_MATCH)
    if kind in HEAD_DRAFTERS:
        head = _head_drafter(parts, spec)
        if head is not None:
            return head if kind == "head" else HybridDrafter(_lookup_drafter(spec, HYBRID_MATCH), head, 0.0)
        kind = "model" if kind == "head" else "hybrid"  # the next-best drafter, said in one line
        if parts.drafter_fits() is False:
            return _lookup_drafter(spec, LOOKUP_MATCH)
    small = parts.drafter
    view = parts.quantized(small, first_set(recipe, _drafter_recipe(parts, spec)))
    model = ModelDrafter(small.model, view, name="model")
    if kind == "model":
        return model
    budget = spec.get("budget")
    return HybridDrafter(_lookup_drafter(spec, HYBRID_MATCH), model, HYBRID_BUDGET if budget is None else budget)


def _head_drafter(parts: Parts, spec: MethodSpec) -> Drafter | None:
    """The target's draft head as a drafter, or None (said in one line on stderr) when it has none that fits."""
    from viasd.drafters.head import HeadDrafter

    try:
        found = parts.draft_head(spec.get("head"))
    except ViasdError as error:
        print(f"{spec.name}: {error}; drafting with the next-best drafter instead", file=sys.stderr)
        return None
    try:
        vocabulary = spec.get("head_vocab") or "context"
        return HeadDrafter(found.head, parts.target.model, compute=spec.get("head_compute"), vocabulary=vocabulary)
    except ValueError as error:  # head_compute=int8 where the head or device cannot take it
        raise ViasdError(f"method {spec.name!r}: option 'head_compute': {error}") from None


def _plain(parts: Parts, spec: MethodSpec) -> Decoder:
    from viasd.decode.plain import PlainDecoder

    return PlainDecoder(parts.target.model, parts.target.tokenizer, _target_view(parts, spec))


def _speculative(parts: Parts, spec: MethodSpec, drafter: Drafter, stop: float = 0.0) -> Decoder:
    from viasd.decode.speculative import SpeculativeDecoder

    target, view = parts.target, _target_view(parts, spec)
    gamma = _gamma(parts, spec, _round_gamma(parts, view))
    return SpeculativeDecoder(target.model, target.tokenizer, drafter, gamma, spec.name, view, stop)


def _sd(parts: Parts, spec: MethodSpec) -> Decoder:
    return _speculative(parts, spec, _drafter(parts, spec), _stop(spec, DEFAULT_STOP))


def _lookup(parts: Parts, spec: MethodSpec) -> Decoder:
    return _speculative(parts, spec, _lookup_drafter(spec, LOOKUP_MATCH))


def _self(parts: Parts, spec: MethodSpec) -> Decoder:
    """The target drafts for itself: its quantized view when `drafter_quant` is set, else with layers skipped (of
    the view it runs as, when it runs as a quantized one: the 4-bit target drafts with fewer of its own layers)."""
    from viasd.drafters.model_drafter import ModelDrafter
    from viasd.views.view import View

    target = parts.target
    own, recipe = _target_view(parts, spec), _drafter_recipe(parts, spec)
    # Layers skipped of the view the target runs as: a target run from its file's blocks needs no dense copy for it.
    view = parts.quantized(target, recipe) if recipe is not None else None
    view = view or View(mask=parts.self_mask(), linears=own.linears if own is not None else None)
    drafter = ModelDrafter(target.model, view, name="self")
    return _speculative(parts, spec, drafter, _stop(spec, 0.0))  # stop not measured for self: off unless asked


def _hf_assisted(parts: Parts, spec: MethodSpec) -> Decoder:
    from viasd.decode.hf_assisted import HFAssistedDecoder

    if isinstance(parts.spec.quant, QuantRecipe) or parts.spec.drafter_quant:
        raise ViasdError("hf-assisted runs transformers' own models: it takes no quantized view (--quant)")
    target = parts.target
    gamma = first_set(spec.get("gamma"), parts.spec.gamma)  # None keeps transformers' own draft policy
    return HFAssistedDecoder(target.model, target.tokenizer, parts.drafter.model, gamma, spec.name)


def _llama_cpp(parts: Parts, spec: MethodSpec) -> Decoder:
    """llama.cpp on the target's GGUF file, with the threads torch uses, so both runtimes get the same cores."""
    import torch

    from viasd.decode.base import context_limit
    from viasd.decode.llama_cpp import LlamaCppDecoder, load_llama

    if isinstance(parts.spec.quant, QuantRecipe) or parts.spec.drafter_quant:  # none: it runs the file all the same
        raise ViasdError("llama.cpp runs the GGUF file's own quantization: it takes no --quant")
    target, lookup = parts.target, spec.get("lookup") or 0
    # With lookup, llama-cpp-python keeps context x vocabulary float logits (2.5 GB for Qwen2.5 at 4096 tokens).
    context = min(context_limit(target.model) or 8192, 4096 if lookup else 8192)
    llama = load_llama(parts.gguf(), torch.get_num_threads(), context, lookup)
    return LlamaCppDecoder(target.model, target.tokenizer, llama, lookup, spec.name)


def _llama_server(parts: Parts, spec: MethodSpec) -> Decoder:
    """llama.cpp's own server on the target's GGUF file (draft=model: with the drafter's GGUF file as its draft
    model), with the threads torch uses."""
    import torch

    from viasd.decode.base import context_limit
    from viasd.decode.llama_server import LlamaServerDecoder, start_server
    from viasd.views.gguf import source_gguf

    if isinstance(parts.spec.quant, QuantRecipe) or parts.spec.drafter_quant:
        raise ViasdError("llama-server runs the GGUF file's own quantization: it takes no --quant")
    draft = None
    if spec.get("gamma") is not None and spec.get("draft") != "model":
        raise ViasdError(f"method {spec.name!r}: option 'gamma' needs draft=model")
    if spec.get("draft") == "model":
        drafter = parts.spec.drafter
        draft = source_gguf(drafter, drafter)
        if draft is None:
            raise ViasdError(f"llama-server:draft=model reads the drafter's GGUF file: {drafter!r} is not one")
    target = parts.target
    context = min(context_limit(target.model) or 8192, 8192)
    server = start_server(parts.gguf(), torch.get_num_threads(), context, draft, spec.get("gamma"))
    return LlamaServerDecoder(target.model, target.tokenizer, server, context, draft is not None, spec.name)


def _auto(parts: Parts, spec: MethodSpec) -> Decoder:
    """The fastest exact method here, by a probe at first use (cached); see viasd.auto."""
    from viasd.auto import AutoDecoder, candidates, choose, int4a8_is_fast, probe_key
    from viasd.views.gguf import has_own_blocks, source_gguf

    fits = parts.drafter_fits()
    target = parts.target
    fast = int4a8_is_fast(next(target.model.parameters()).device)
    recipe = parts.target_recipe()  # by default, as the target's file stores it
    quantized_target = recipe is not None
    try:
        head: str | None = parts.draft_head().digest
    except ViasdError:
        head = None  # no head for this target: its methods are not candidates
    gguf = fast and has_own_blocks(target.name, target.path)
    # The probe loads the drafter where it fits: a default drafter's file is fetched now, so its blocks are known.
    drafter = parts.spec.drafter
    drafter_gguf = fast and fits is not False and source_gguf(drafter, drafter) is not None
    drafter_gguf = drafter_gguf and has_own_blocks(drafter, drafter)
    names = candidates(fits, int4a8=fast, gguf=gguf, quantized_target=quantized_target, head=head is not None,
                       drafter_gguf=drafter_gguf)  # fmt: skip
    if fits is False:
        print(
            f"auto: the drafter {parts.spec.drafter!r} does not share this target's tokenizer; "
            "choosing among methods that need no drafter",
            file=sys.stderr,
        )
    engine = parts.spec
    settings = {
        "drafter": engine.drafter,
        "quant": recipe.name if recipe else None,
        "gamma": engine.gamma,
        "profile": engine.profile,
        "head": head,
    }
    record = choose(parts.decoder, names, parts.target.tokenizer, probe_key(parts.target.model, settings, names))
    return AutoDecoder(parts.decoder(record["chosen"]), record, spec.name)


def full_view(parts: Parts, profile: RoutingProfile) -> View | None:
    """The view of the target that `profile` was calibrated on and `via` verifies against: its `target_quant` (the
    file's blocks for a profile calibrated on them), else the target as loaded (None: its dense copy, made from the
    file where the target is stored in one, with one line)."""
    return parts.quantized(parts.target, profile.target_quant)


def slim_views(parts: Parts, profile: RoutingProfile, kind: str | None = None) -> list[View]:
    """The target's slim views of `profile` for requests of task kind `kind`: each tier's layer mask, with the
    quantized copies the kind's own entry names (else the profile's; else the full view's own layers). A kind's
    gate was calibrated on these views, so `via` and vLLM's cascade (viasd.vllm.cascade) both make them here."""
    from viasd.views.view import View

    full = full_view(parts, profile)
    views = []
    for tier, mask in enumerate(profile.masks):
        recipe = profile.slim_quant(tier, kind)
        quantized = parts.quantized(parts.target, recipe) if recipe is not None else full
        views.append(View(mask=mask, linears=quantized.linears if quantized else None))
    return views


def _via(parts: Parts, spec: MethodSpec) -> Decoder:
    from viasd.decode.round import RoundPolicy
    from viasd.decode.tiered import TieredDecoder
    from viasd.verify.gates import Gate

    calibrated = parts.profile_as_read(spec.get("profile")).target_quant  # refused before any model loads
    if isinstance(parts.spec.quant, QuantRecipe) and parts.spec.quant != calibrated:
        on = f"its {calibrated.name} view" if calibrated else "as loaded, its dense copy"
        raise ViasdError(
            f"{spec.base} verifies against the target its routing profile was calibrated on ({on}): it takes no "
            f"--quant {parts.spec.quant.name}"
        )
    profile = parts.routing_profile(spec.get("profile"))
    overrides = {
        "gamma": first_set(spec.get("gamma"), parts.spec.gamma),
        "cap": spec.get("cap"),
        "pregate": spec.get("pregate"),
        "stop": spec.get("stop"),
    }
    policy, kinds = profile.policy(**overrides), profile.policies(**overrides)
    if spec.base == "via-exact":
        policy, kinds = RoundPolicy(Gate.exact(), policy.gamma, policy.cap, stop=policy.stop), {}
    target = parts.target
    slims = slim_views(parts, profile)
    kind_slims = {}
    for kind in (k for k in profile.own_views() if k in kinds):
        try:
            kind_slims[kind] = slim_views(parts, profile, kind)
        except ViasdError as exc:  # e.g. no GGUF file to take a gguf view's blocks from
            own = kinds[kind]  # its gate was calibrated on that view alone: verify exactly rather than guess
            kinds[kind] = RoundPolicy(Gate.exact(), own.gamma, own.cap, stop=own.stop)
            print(f"via: {exc}; {kind} requests are verified by the full target instead", file=sys.stderr)
    recipe = first_set(_drafter_recipe(parts, spec), profile.drafter_quant)
    if profile.self_drafter:  # the profile's drafter is the target's own view
        from viasd.drafters.model_drafter import ModelDrafter

        drafter: Drafter = ModelDrafter(target.model, parts.quantized(target, recipe), name="self")
    else:
        drafter = _drafter(parts, spec, recipe)
    return TieredDecoder(
        target.model,
        target.tokenizer,
        drafter,
        slims,
        policy,
        spec.name,
        profile.source,
        kinds,
        spec.get("kind"),
        kind_slims,
        full_view(parts, profile),
    )


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "auto",
            "the fastest exact method here (plain, lookup, sd, quantized and hybrid drafters): probed once, cached",
            _auto,
        ),
        Method("plain", "plain autoregressive decoding of the target (baseline)", _plain, ("quant",)),
        Method(
            "sd",
            "classic speculative decoding with the small drafter model (exact)",
            _sd,
            ("gamma", *DRAFTING_OPTIONS, "quant", "drafter_quant"),
            uses_drafter=True,
        ),
        Method(
            "lookup",
            "speculative decoding with prompt-lookup (n-gram) drafts (exact)",
            _lookup,
            ("gamma", "match", "copy", "quant"),
        ),
        Method(
            "self",
            "self-speculative decoding: a cheaper view of the target drafts (layers skipped, or drafter_quant) (exact)",
            _self,
            ("gamma", "stop", "quant", "drafter_quant"),
        ),
        Method(
            "via",
            "VIA-SD: drafter -> slim verifier (target with layers skipped) -> full target, gated per token (relaxed)",
            _via,
            ("gamma", "cap", "profile", "pregate", "kind", *DRAFTING_OPTIONS, "drafter_quant"),
            uses_drafter=True,
            exact=False,
            target="profile",
        ),
        Method(
            "via-exact",
            "VIA-SD machinery with every token sent to the full target (equals sd on the same view)",
            _via,
            ("gamma", "cap", "profile", *DRAFTING_OPTIONS, "drafter_quant"),
            uses_drafter=True,
            target="profile",
        ),
        Method(
            "hf-assisted",
            "Hugging Face transformers' assisted generation with the small drafter (reference, exact)",
            _hf_assisted,
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
            _llama_cpp,
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
            _llama_server,
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
    _check_drafter_options(name, method, options)
    return MethodSpec(name=name, method=method, options=options)


def _check_drafter_options(name: str, method: Method, options: Mapping[str, Any]) -> None:
    """Refuse options that the variant's drafter would ignore: lookup settings without prompt lookup, a stop
    threshold without a drafter that has a confidence."""
    if "drafter" not in method.options:
        return
    drafter = options.get("drafter", "model")
    for key in ("match", "copy"):
        if key in options and drafter in ("model", "head"):
            raise ViasdError(f"method {name!r}: option {key!r} needs drafter=lookup, hybrid or lookup+head")
    if "budget" in options and drafter != "hybrid":
        raise ViasdError(f"method {name!r}: option 'budget' needs drafter=hybrid")
    for key in ("head", "head_compute", "head_vocab"):
        if key in options and drafter not in HEAD_DRAFTERS:
            raise ViasdError(f"method {name!r}: option {key!r} needs drafter=head or drafter=lookup+head")
    if "drafter_quant" in options and drafter in HEAD_DRAFTERS:
        raise ViasdError(f"method {name!r}: option 'drafter_quant' needs a drafter model (a head has none)")
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
