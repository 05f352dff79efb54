"""One VIA-SD round below the full target: route each draft token through the gate, left to right.

Pure decision logic over given distributions, so every gate and edge case can be tested on
constructed inputs; the decoder in tiered.py supplies the model passes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from viasd.drafters.base import Proposal
from viasd.verify.acceptance import check_token
from viasd.verify.gates import Gate
from viasd.verify.sampling import SamplingParams, sample, soft_probs, warp_probs


@dataclass
class RoundOutcome:
    """What the lower tiers settled. `committed` is None when some token needs the full target."""

    committed: list[int] | None
    evaluated: int = 0  # draft tokens looked at
    accepted: int = 0  # draft tokens kept
    decided: dict[int, int] = field(default_factory=dict)  # tier -> draft tokens it settled
    kept: dict[int, int] = field(default_factory=dict)  # tier -> of those, kept
    rejected: dict[int, int] = field(default_factory=dict)  # tier -> of those, rejected and regenerated
    full_at: int | None = None  # position that was routed to the full target
    signals: list[float] = field(default_factory=list)


def route_block(
    proposal: Proposal,
    view_logits: Callable[[int], torch.Tensor],
    gate: Gate,
    params: SamplingParams,
    generator: torch.Generator,
    budget: int,
) -> RoundOutcome:
    """Decide the block with the accept and slim tiers, or report that the full target is needed.

    view_logits(j) gives the logits [k + 1, V] of slim view j (1 = shallowest) over the block's positions;
    it is called lazily, so deeper views run only when a token reaches them. `budget` is how many tokens
    this round may still commit without the full target (the cap); a token whose commitment would
    exceed it goes to the full tier.
    """
    k = len(proposal)
    slim = soft_probs(view_logits(1)[:k], params)
    signals = gate.signals(slim, proposal.soft, proposal.tokens).tolist()
    out = RoundOutcome(committed=None, signals=signals)
    committed: list[int] = []
    deepest = 1
    for i, token in enumerate(proposal.tokens):
        tier = gate.tier(signals[i])
        # Keeping token i and then closing the round commits i + 2 tokens.
        if i + 2 > budget:
            tier = gate.full_tier
        if tier == gate.full_tier:
            out.full_at = i
            return out
        out.evaluated += 1
        out.decided[tier] = out.decided.get(tier, 0) + 1
        if tier > 0:
            deepest = max(deepest, tier)
            target = warp_probs(view_logits(tier)[i : i + 1], params)[0]
            draft = None if proposal.probs is None else proposal.probs[i]
            replacement = check_token(token, draft, target, generator)
            if replacement is not None:
                out.rejected[tier] = out.rejected.get(tier, 0) + 1
                out.committed = [*committed, replacement]
                return out
        out.kept[tier] = out.kept.get(tier, 0) + 1
        out.accepted += 1
        committed.append(token)
    # The whole block stood: the bonus token comes from the deepest slim view that ran.
    bonus = sample(warp_probs(view_logits(deepest)[k : k + 1], params)[0], generator)
    out.committed = [*committed, bonus]
    return out
