"""The cascade: viasd's hybrid drafts edited by a slim view of the target before vLLM verifies them
(`"model": "viasd.vllm.cascade.CascadeProposer"`).

vLLM has no hook for a verifier, so VIA-SD's relaxed tiers, which commit tokens the full target never checks,
cannot run inside it. What can: the slim view (the target's quantized view from the routing profile, run by viasd's
kernels) reads each request's draft block in one pass, and the profile's gate, per draft token, decides what the
slim view's reading is worth there. A token the gate would accept stays. Any other token the slim view does not
rank first is replaced by the slim view's token (the better guess of the target's: the int4a8 view agrees with the
target on about 98% of positions, the drafter on about 95%), which ends the block, since later drafts followed
the replaced token; a token it does rank first stays, and where the gate routes it to the full target the block
ends after it (the gate trusts nothing beyond it). A block the slim view wholly agrees with gets the slim view's
next token as one more draft. vLLM's target then
verifies the edited block exactly, so the output is the target's; what changes is how many drafts it keeps.

Settings, besides the hybrid proposer's (viasd.vllm.proposer): VIASD_PROFILE, the routing profile (default: the
shipped one for the default pair on this CPU). The task kind of each request (viasd.task_kind) picks the profile's
gate for that kind and the slim view that gate was calibrated on (the kind's own view where the profile names one,
made as `via` makes it: `viasd.methods.via.slim_views`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from viasd.drafters.hybrid import HybridDrafter
from viasd.errors import ViasdError
from viasd.methods.method import Parts
from viasd.methods.via import slim_views
from viasd.models.catalog import DEFAULT_DRAFTER
from viasd.passes.session import KVSession
from viasd.profile import RoutingProfile
from viasd.task_kind import prompt_kind
from viasd.verify.gates import Gate
from viasd.verify.sampling import soft_probs
from viasd.views.view import View
from viasd.vllm.proposer import HybridProposer, _setting, log


@dataclass(frozen=True)
class SlimRoute:
    """What edits the drafts of a task kind's requests: the slim view the kind's gate was calibrated on, and the
    gate."""

    view: View
    gate: Gate


Routes = dict[str | None, SlimRoute | None]  # by task kind; None: every kind the profile has no settings for


def slim_routes(parts: Parts, profile: RoutingProfile) -> Routes:
    """The route of every task kind the profile has settings for, and of the others (key None): the first slim view
    `via` makes for the kind (`slim_views`), with the kind's gate. A kind whose own view cannot be made here (a gguf
    view of a target not loaded from a GGUF file) routes to None: its drafts go to vLLM unedited, as `via` verifies
    such a kind by the full target rather than judge another view by a gate calibrated on its own."""
    shared = slim_views(parts, profile)[0]
    routes: Routes = {None: SlimRoute(shared, profile.policy().gate)}
    own = profile.own_views()
    for kind in profile.kinds:
        gate = profile.policy(kind).gate
        try:
            routes[kind] = SlimRoute(slim_views(parts, profile, kind)[0] if kind in own else shared, gate)
        except ViasdError as error:
            log.warning("viasd cascade: %s; %s requests get the hybrid's drafts unedited", error, kind)
            routes[kind] = None
    return routes


@dataclass
class CascadeSession:
    """One request's drafter and, once its first draft has told its task kind, its route's gate and a KV session of
    the route's slim view (None, None for a kind whose drafts go unedited)."""

    drafter: HybridDrafter
    routed: bool = False
    gate: Gate | None = None
    slim: KVSession | None = None

    def route(self, route: SlimRoute | None, model: nn.Module) -> None:
        """Take the route of the request's task kind, at its first draft."""
        self.routed = True
        if route is not None:
            self.gate, self.slim = route.gate, KVSession(model, base_view=route.view)


def edit_block(drafts: list[int], tiers: list[int], picks: list[int], full_tier: int, room: int) -> list[int]:
    """The draft block the gate and the slim view leave (see the module docstring): `tiers[i]` is the gate's tier
    for draft i (0 accept, full_tier the full target), `picks[i]` the slim view's top token at draft i's position
    (one more than the drafts: the last is the token after the block); at most `room` tokens."""
    edited: list[int] = []
    for draft, tier, pick in zip(drafts, tiers, picks, strict=False):
        if tier > 0 and pick != draft:  # the slim view disagrees: its token is the better guess, and the last
            edited.append(pick)
            return edited[:room]
        edited.append(draft)
        if tier >= full_tier:  # the slim view agrees, but the gate trusts nothing beyond this token
            return edited[:room]
    if len(picks) > len(drafts):
        edited.append(picks[len(drafts)])
    return edited[:room]


class CascadeProposer(HybridProposer):
    """Hybrid drafts, edited by the routing profile's slim view under its gate (see the module docstring)."""

    def __init__(self, vllm_config: Any) -> None:
        super().__init__(vllm_config)
        from viasd.cli_options import engine_spec
        from viasd.engine import Engine

        target = str(vllm_config.model_config.model)
        profile_path = os.environ.get("VIASD_PROFILE", "").strip() or None
        engine = Engine(
            engine_spec(target, _setting("VIASD_DRAFTER", DEFAULT_DRAFTER), device="cpu", dtype="bf16"),
            drafter=self.drafter,
        )
        self.profile = engine.routing_profile(profile_path)  # checked against the target and drafter there
        self.target = engine.target
        self.routes = slim_routes(engine, self.profile)
        self.stats["edited"] = 0

    def _new_session(self) -> Any:
        return CascadeSession(super()._new_session())

    def _draft(self, session: Any, context: list[int], k: int) -> list[int]:
        proposal = self._proposal(session.drafter, context, k)
        drafts = [int(t) for t in proposal.tokens]
        if not drafts:
            return drafts
        if not session.routed:
            kind = prompt_kind(self.target.tokenizer.decode(context))
            session.route(self.routes.get(kind, self.routes[None]), self.target.model)
        if session.slim is None or session.gate is None:  # a kind whose slim view is not here
            return drafts
        gate: Gate = session.gate
        start = time.perf_counter()
        logits = session.slim.extend_to(context + drafts, keep=len(drafts) + 1)
        slim = soft_probs(logits.float(), self.params)
        # A copied draft has no drafter distributions: the kl signal is then +inf, and the gate sends it on.
        signals = gate.signals(slim[: len(drafts)], proposal.soft, torch.tensor(drafts)).tolist()
        tiers = [gate.tier(float(v)) for v in signals]
        edited = edit_block(drafts, tiers, slim.argmax(dim=-1).tolist(), gate.full_tier, k)
        self.lengths.observe_drafter(0, time.perf_counter() - start)  # the slim pass counts as drafting cost
        self.stats["edited"] += edited != drafts
        return edited
