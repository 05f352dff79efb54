"""How the exact methods on viasd's own passes build their decoders: plain, sd, lookup, self and auto.

Builders import the decoding modules when they run, so that parsing a method name (the CLI does it before loading
any model) stays free of torch.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from viasd.errors import ViasdError
from viasd.methods.drafting import (
    drafter_recipe,
    lookup_drafter,
    model_drafter,
    round_gamma,
    variant_drafter,
)
from viasd.methods.method import MethodSpec, Parts, first_set
from viasd.speculation import DEFAULT_STOP

if TYPE_CHECKING:
    from viasd.decode.base import Decoder
    from viasd.drafters.base import Drafter
    from viasd.views.view import View


def target_view(parts: Parts, spec: MethodSpec) -> View | None:
    """The target's view for a method: its quantized view when the variant or --quant asks for one, or by default
    where it comes from a GGUF file (the file's own blocks)."""
    return parts.quantized(parts.target, parts.target_recipe(spec.get("quant")))


def plain(parts: Parts, spec: MethodSpec) -> Decoder:
    from viasd.decode.plain import PlainDecoder

    return PlainDecoder(parts.target.model, parts.target.tokenizer, target_view(parts, spec))


def _speculative(parts: Parts, spec: MethodSpec, drafter: Drafter, stop: float = 0.0) -> Decoder:
    from viasd.decode.speculative import SpeculativeDecoder

    target, view = parts.target, target_view(parts, spec)
    gamma = round_gamma(parts, spec, view)
    return SpeculativeDecoder(target.model, target.tokenizer, drafter, gamma, spec.name, view, stop)


def sd(parts: Parts, spec: MethodSpec) -> Decoder:
    return _speculative(parts, spec, variant_drafter(parts, spec), first_set(spec.get("stop"), DEFAULT_STOP))


def lookup(parts: Parts, spec: MethodSpec) -> Decoder:
    return _speculative(parts, spec, lookup_drafter(spec.get("match"), spec.get("copy")))


def self_speculative(parts: Parts, spec: MethodSpec) -> Decoder:
    """The target drafts for itself: its quantized view when `drafter_quant` is set, else with layers skipped (of
    the view it runs as, when it runs as a quantized one: the 4-bit target drafts with fewer of its own layers)."""
    from viasd.views.view import View

    target = parts.target
    own, recipe = target_view(parts, spec), drafter_recipe(parts, spec)
    # Layers skipped of the view the target runs as: a target run from its file's blocks needs no dense copy for it.
    view = parts.quantized(target, recipe) if recipe is not None else None
    view = view or View(mask=parts.self_mask(), linears=own.linears if own is not None else None)
    drafter = model_drafter(target.model, view, name="self")
    return _speculative(parts, spec, drafter, first_set(spec.get("stop"), 0.0))  # stop not measured for self


def _profile_fits(parts: Parts) -> bool:
    """Whether the routing profile `via` would use (--profile, else the shipped one for where the target runs) was
    calibrated for this target as it runs: its fingerprint and view; known without loading the drafter."""
    from viasd.models.fingerprint import model_fingerprint

    try:
        profile = parts.profile_as_read()
    except ViasdError:
        return False
    target = parts.target
    if profile.target.get("fingerprint") != model_fingerprint(target.model):
        return False
    return profile.target_quant == parts.target_recipe()


def auto(parts: Parts, spec: MethodSpec) -> Decoder:
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
                       drafter_gguf=drafter_gguf, via=fits is not False and _profile_fits(parts))  # fmt: skip
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
