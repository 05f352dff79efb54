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
gate for that kind.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from viasd.drafters.hybrid import HybridDrafter
from viasd.passes.session import KVSession
from viasd.task_kind import prompt_kind
from viasd.verify.gates import Gate
from viasd.verify.sampling import soft_probs
from viasd.vllm.proposer import DEFAULT_DRAFTER, HybridProposer, _setting


@dataclass
class CascadeSession:
    """One request's drafter and its slim view's KV session, and the gate of its task kind."""

    drafter: HybridDrafter
    slim: KVSession
    gate: Gate | None = None  # chosen at the request's first draft, from its prompt


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
        self.profile = engine.routing_profile(profile_path)
        self.profile.check_models(engine.target.model, None if self.profile.self_drafter else self.drafter.model)
        self.target = engine.target
        self.slim_view = engine.quantized(engine.target, self.profile.slim_quant(0))
        self.stats["edited"] = 0

    def _new_session(self) -> Any:
        return CascadeSession(super()._new_session(), KVSession(self.target.model, base_view=self.slim_view))

    def _draft(self, session: Any, context: list[int], k: int) -> list[int]:
        proposal = self._proposal(session.drafter, context, k)
        drafts = [int(t) for t in proposal.tokens]
        if not drafts:
            return drafts
        if session.gate is None:
            session.gate = self.profile.policy(prompt_kind(self.target.tokenizer.decode(context))).gate
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
