"""How VIA-SD builds its decoder (`via`, and `via-exact` on the same machinery): the full view its routing profile
was calibrated on, the slim views of its tiers, its drafter and its round policies."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from viasd.errors import ViasdError
from viasd.methods.drafting import drafter_recipe, model_drafter, variant_drafter
from viasd.methods.method import MethodSpec, Parts, first_set
from viasd.views.recipe import QuantRecipe

if TYPE_CHECKING:
    from viasd.decode.base import Decoder
    from viasd.drafters.base import Drafter
    from viasd.profile import RoutingProfile
    from viasd.views.view import View


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


def via(parts: Parts, spec: MethodSpec) -> Decoder:
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
    read = parts.profile_as_read(spec.get("profile"))
    recipe = first_set(drafter_recipe(parts, spec), read.drafter_quant)
    drafter: Drafter
    if read.self_drafter:  # the profile's drafter is the target's own view
        drafter = model_drafter(parts.target.model, parts.quantized(parts.target, recipe), name="self")
    elif read.head_drafter:  # the target's draft head, with prompt lookup where it matches (as `auto` drafts)
        drafter = variant_drafter(parts, spec, recipe, default="lookup+head")
    else:  # built first: the profile checks the small drafter only where this drafts with it (loaded by then)
        drafter = variant_drafter(parts, spec, recipe)
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
