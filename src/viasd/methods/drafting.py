"""Drafters, built in one place: what a variant's drafting options name (`sd:drafter=hybrid:match=4`), and the
hybrid that viasd's vLLM proposers draft with, from the same constructors and defaults (viasd.speculation), so that
no setting differs between them."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from viasd.errors import ViasdError
from viasd.methods.method import MethodSpec, Parts, first_set
from viasd.methods.options import HEAD_DRAFTERS, SUFFIX_DRAFTERS
from viasd.speculation import DEFAULT_GAMMA, DEFAULT_REACH, HYBRID_BUDGET, HYBRID_MATCH, LOOKUP_MATCH, longest_match

if TYPE_CHECKING:
    from torch import nn

    from viasd.drafters.base import Drafter
    from viasd.drafters.hybrid import HybridDrafter
    from viasd.drafters.prompt_lookup import PromptLookupDrafter
    from viasd.drafters.suffix import SuffixDrafter
    from viasd.views.recipe import QuantRecipe
    from viasd.views.view import View


def lookup_drafter(shortest: int | None = None, copy: int | None = None) -> PromptLookupDrafter:
    """Prompt lookup copying from matches of at least `shortest` tokens (default: the lookup method's), at most
    `copy` tokens a round (None: up to gamma)."""
    from viasd.drafters.prompt_lookup import PromptLookupDrafter

    shortest = shortest or LOOKUP_MATCH
    return PromptLookupDrafter(max_ngram=longest_match(shortest), min_ngram=shortest, copy=copy)


def suffix_drafter(parts: Parts, spec: MethodSpec, short: bool = True) -> SuffixDrafter:
    """Copies from the longest match in this request and the engine's recent ones (`Parts.suffix_store`), up to
    the variant's reach a round; `short`: prompt lookup's 1- and 2-gram matches where there is none."""
    from viasd.drafters.suffix import SuffixDrafter

    return SuffixDrafter(first_set(spec.get("reach"), DEFAULT_REACH), parts.suffix_store(spec.name), short=short)


def hybrid_drafter(
    model: Drafter,
    match: int | None = None,
    copy: int | None = None,
    budget: float | None = None,
    copier: PromptLookupDrafter | SuffixDrafter | None = None,
) -> HybridDrafter:
    """Prompt lookup where the context repeats (matches of at least `match` tokens, default HYBRID_MATCH; or
    `copier`), else `model` (the small drafter or the draft head), which it leaves out of generations whose token
    budget is under `budget` tokens per prompt token (default HYBRID_BUDGET; a caller that knows no budget never
    leaves it out)."""
    from viasd.drafters.hybrid import HybridDrafter

    ratio = HYBRID_BUDGET if budget is None else budget
    return HybridDrafter(copier or lookup_drafter(match or HYBRID_MATCH, copy), model, ratio)


def model_drafter(model: nn.Module, view: View | None, name: str = "model") -> Drafter:
    """A model that drafts with its own KV session: the small drafter, or the target's own view (`self`)."""
    from viasd.drafters.model_drafter import ModelDrafter

    return ModelDrafter(model, view, name=name)


def drafter_recipe(parts: Parts, spec: MethodSpec) -> QuantRecipe | None:
    """The quantized view the small drafter runs as: the variant's drafter_quant, else --drafter-quant."""
    return first_set(spec.get("drafter_quant"), parts.spec.drafter_quant)


def variant_drafter(
    parts: Parts, spec: MethodSpec, recipe: QuantRecipe | None = None, default: str = "model"
) -> Drafter:
    """The drafter a variant names (else `default`): the small model (as its quantized view by `recipe`), prompt
    lookup, the hybrid of both, the target's draft head, or lookup with the head. Without a head that fits, the
    next-best drafter, said in one line."""
    kind = spec.get("drafter") or default
    match, copy, budget = spec.get("match"), spec.get("copy"), spec.get("budget")
    # The suffix drafter's seed match (3 tokens) is a hybrid's shortest; without one its other part drafts.
    copier = suffix_drafter(parts, spec, short=False) if kind in SUFFIX_DRAFTERS else None
    if kind == "lookup":
        return lookup_drafter(match, copy)
    if kind == "suffix":
        return suffix_drafter(parts, spec)
    if kind in HEAD_DRAFTERS:
        head = head_drafter(parts, spec)
        if head is not None:
            # The head costs no prefill of its own, so the hybrid never leaves it out.
            return head if kind == "head" else hybrid_drafter(head, match, copy, budget=0.0, copier=copier)
        kind = "model" if kind == "head" else "hybrid"
        if parts.drafter_fits() is False:
            return suffix_drafter(parts, spec) if copier else lookup_drafter(match, copy)
    small = parts.drafter
    model = model_drafter(small.model, parts.quantized(small, first_set(recipe, drafter_recipe(parts, spec))))
    return model if kind == "model" else hybrid_drafter(model, match, copy, budget, copier)


def head_drafter(parts: Parts, spec: MethodSpec) -> Drafter | None:
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


def round_gamma(parts: Parts, spec: MethodSpec, view: View | None) -> int:
    """Draft tokens per round: the variant's gamma, else --gamma, else DEFAULT_GAMMA, or one fewer than the tokens a
    pass of the target as run costs about one step for, where that is known and larger (the dense target on the
    native bf16 kernel: drafts of 7 ran 1.09x drafts of 4 with the 0.5B drafter's int4a8 view and 1.00-1.01x with
    the others, Zen 4)."""
    from viasd.kernels.bf16_linear import cheap_block

    block = cheap_block(parts.target.model) if view is None else None
    default = max(DEFAULT_GAMMA, block - 1) if block else DEFAULT_GAMMA
    return first_set(spec.get("gamma"), parts.spec.gamma, default)
