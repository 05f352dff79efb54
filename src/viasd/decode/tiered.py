"""VIA-SD: drafter -> slim verifier(s) (the target under routing masks) -> full target.

Cache design (DESIGN.md section 4, option b): the slim verifiers share the target's KVSession. They
attend to the full target's KV for the positions it has processed (the committed frontier F) and keep
their own entries only beyond F, as `pending` entries of their kept layers. Invariants:

* The full target's cache over [0, F) always equals a fresh full forward pass over those tokens:
  slim passes never write below F, and every full pass first crops the pending slim entries.
* The full target falls behind while rounds end in the lower tiers; its next pass re-processes
  (catches up on) every committed token beyond F together with the new block, so it never sees a
  slim-written entry. At most `cap` tokens are committed without it.
* The drafter keeps its own cache, resynchronised to the committed tokens each round.

Optional pre-gate (`pregate`): a round whose least confident draft token has a drafter top probability
under the pre-gate skips the slim pass and goes straight to the full target (a lossless round). It only
moves rounds from the relaxed tiers to the exact one, and saves the slim pass of rounds that would have
escalated anyway.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from viasd.decode.base import Decoder
from viasd.decode.output import OutputSink
from viasd.decode.round import route_block
from viasd.decode.speculative import draft_length
from viasd.decode.stats import GenerationStats
from viasd.drafters.base import Drafter, Proposal
from viasd.errors import ViasdError
from viasd.models.routing import RoutingMask
from viasd.models.session import KVSession
from viasd.verify.acceptance import verify_block
from viasd.verify.gates import Gate, drafter_doubts
from viasd.verify.sampling import SamplingParams, sample, warp_probs


def tier_names(slim_tiers: int) -> list[str]:
    """Names of the tiers in order: accept, slim (or slim1..slimN), full."""
    slims = ["slim"] if slim_tiers == 1 else [f"slim{j}" for j in range(1, slim_tiers + 1)]
    return ["accept", *slims, "full"]


class TieredDecoder(Decoder):
    """Multi-tier speculative decoding with gated routing of each draft token."""

    method = "via"

    def __init__(
        self,
        target: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        drafter: Drafter,
        masks: Sequence[RoutingMask],
        gate: Gate,
        gamma: int = 4,
        cap: int = 32,
        method: str | None = None,
        pregate: float = 0.0,
    ) -> None:
        super().__init__(target, tokenizer)
        if gamma < 1:
            raise ViasdError(f"the draft length gamma must be >= 1, got {gamma}")
        if cap < 1:
            raise ViasdError(f"the cap on tokens committed without the full target must be >= 1, got {cap}")
        if not 0.0 <= pregate <= 1.0:
            raise ViasdError(f"the pre-gate must be a probability in [0, 1], got {pregate}")
        if not gate.always_full:
            if not masks:
                raise ViasdError("a tiered decoder needs at least one slim routing mask")
            if len(gate.thresholds) != len(masks) + 1:
                raise ViasdError(
                    f"{len(masks)} slim tier(s) need {len(masks) + 1} gate thresholds, got {len(gate.thresholds)}"
                )
        self.drafter = drafter
        self.masks = list(masks)
        self.gate = gate
        self.gamma = gamma
        self.cap = cap
        self.pregate = pregate  # drafter confidence under which a round goes straight to the full target
        self.session = KVSession(target)
        self.names = tier_names(len(self.masks)) if not gate.always_full else ["accept", "full"]
        if method:
            self.method = method

    def _view_logits(
        self, block: list[int], k: int, computed: dict[int, torch.Tensor], stats: GenerationStats, tier: int
    ) -> torch.Tensor:
        """Logits [k + 1, V] of slim view `tier` over the block, computed once per round."""
        if tier not in computed:
            computed[tier] = self.session.extend_routed_to(block, self.masks[tier - 1], keep=k + 1)
            stats.slim_calls += 1
            stats.tier(self.names[tier]).calls += 1
        return computed[tier]

    def _full_round(
        self,
        context: list[int],
        proposal: Proposal,
        params: SamplingParams,
        generator: torch.Generator,
        stats: GenerationStats,
    ) -> list[int]:
        """Classic speculative sampling of the whole block against the full target (lossless round)."""
        logits = self.session.extend_to(context + proposal.tokens, keep=len(proposal) + 1)
        stats.target_calls += 1
        full = stats.tier("full")
        full.calls += 1
        if not len(proposal):
            return [sample(warp_probs(logits, params)[-1], generator)]
        verdict = verify_block(proposal.tokens, proposal.probs, warp_probs(logits, params), generator)
        evaluated = min(verdict.accepted + 1, len(proposal))
        stats.evaluated += evaluated
        stats.accepted += verdict.accepted
        full.decided += evaluated
        full.accepted += verdict.accepted
        full.rejected += int(verdict.rejected)
        return [*proposal.tokens[: verdict.accepted], verdict.next_token]

    def _decode(self, prompt: list[int], sink: OutputSink, params: SamplingParams, stats: GenerationStats) -> None:
        generator = params.generator()
        self.session.reset()
        self.drafter.reset()
        drafter_before = self.drafter.forward_passes
        for name in self.names:
            stats.tier(name)
        unchecked = 0  # committed tokens the full target has not verified since its last pass
        if len(prompt) > 1 and not self.gate.always_full:
            # Prefill the prompt with the full target first: slim passes then attend to full-model KV for
            # the whole prompt instead of re-reading it themselves (a slim prefill would be thrown away by
            # the first full pass). The last prompt token stays out so the first round has a position to score.
            t0 = time.perf_counter()
            self.session.forward(prompt[:-1], keep=1)
            stats.target_calls += 1
            stats.tier("full").calls += 1
            stats.verify_seconds += time.perf_counter() - t0
        while not sink.done:
            context = prompt + sink.tokens
            k = draft_length(self.gamma, sink.remaining, len(context), self.context_limit)
            t0 = time.perf_counter()
            proposal = self.drafter.propose(context, k, params, generator)
            t1 = time.perf_counter()
            stats.draft_seconds += t1 - t0
            stats.drafted += len(proposal)
            stats.rounds += 1
            outcome = None
            lower_tiers = not self.gate.always_full and self.cap - unchecked >= 2
            if len(proposal) and lower_tiers and not drafter_doubts(proposal.soft, self.pregate):
                views = partial(self._view_logits, context + proposal.tokens, len(proposal), {}, stats)
                outcome = route_block(proposal, views, self.gate, params, generator, self.cap - unchecked)
                t2 = time.perf_counter()
                stats.slim_seconds += t2 - t1
                t1 = t2
            if outcome is not None and outcome.committed is not None:
                stats.evaluated += outcome.evaluated
                stats.accepted += outcome.accepted
                for tier, n in outcome.decided.items():
                    record = stats.tier(self.names[tier])
                    record.decided += n
                    record.accepted += outcome.kept.get(tier, 0)
                    record.rejected += outcome.rejected.get(tier, 0)
                taken = sink.push(outcome.committed)
                unchecked += taken
                stats.unchecked_tokens += taken
            else:
                committed = self._full_round(context, proposal, params, generator, stats)
                stats.verify_seconds += time.perf_counter() - t1
                unchecked = 0
                sink.push(committed)
        stats.drafter_calls = self.drafter.forward_passes - drafter_before
