"""VIA-SD: drafter -> slim verifier(s) (cheaper views of the target: layers skipped) -> full target.

The round itself (which tier settles which draft token) is `decode.round.play_round`; this module gives
it real model passes and keeps the caches right.

Cache design (docs/design.md, "Caches"): the slim views share the target's KVSession. They attend to
the full target's KV for the positions it has processed (the committed frontier F) and keep their own
entries only beyond F, as `pending` entries of their kept layers. Invariants:

* The full target's cache over [0, F) always equals a fresh full forward pass over those tokens:
  slim passes never write below F, and every full pass first crops the pending slim entries.
* The full target falls behind while rounds end in the lower tiers; its next pass re-processes
  (catches up on) every committed token beyond F together with the new block, so it never sees a
  slim-written entry. At most `cap` tokens are committed without it.
* The drafter keeps its own cache, resynchronised to the committed tokens each round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from viasd.decode.base import Decoder, decision_generator
from viasd.decode.output import OutputSink
from viasd.decode.round import RoundPolicy, draft_length, play_round
from viasd.decode.speculative import verify_with_target
from viasd.decode.stats import GenerationStats
from viasd.drafters.base import Drafter, Proposal
from viasd.errors import ViasdError
from viasd.passes.session import KVSession, upload_ids
from viasd.task_kind import prompt_kind
from viasd.verify.acceptance import check_token
from viasd.verify.gates import Gate
from viasd.verify.resident import STANDS, block_outcomes, host_values
from viasd.verify.sampling import SamplingParams, adjusted, checked_token, sample, soft_probs, warp_probs
from viasd.views.view import View, ViewLike, as_view


class TieredDecoder(Decoder):
    """Multi-tier speculative decoding: each draft token routed by a gate to accept, a slim view or the target."""

    method = "via"

    def __init__(
        self,
        target: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        drafter: Drafter,
        slims: Sequence[ViewLike],
        policy: RoundPolicy,
        method: str | None = None,
        profile: str | None = None,
        kinds: Mapping[str, RoundPolicy] | None = None,
        kind: str | None = None,
        kind_slims: Mapping[str, Sequence[ViewLike]] | None = None,
        view: ViewLike = None,
    ) -> None:
        """`policy` routes every request, except those of a task kind in `kinds` (viasd.task_kind), which that
        kind's policy routes (on that kind's own slim views where `kind_slims` has them); `kind` fixes the kind of
        every request (None: read from each prompt). `view` is the full target (None: the model as loaded); slim
        views run on top of the cache it writes."""
        super().__init__(target, tokenizer, as_view(view))
        self.profile = profile  # where the routing profile came from, for the record
        self.slims: list[View] = _slim_views(slims, policy)  # cheapest first
        self.kinds = dict(kinds or {})
        strays = sorted(set(kind_slims or {}) - set(self.kinds))
        if strays:
            raise ViasdError(f"slim views given for task kind(s) without a policy of their own: {', '.join(strays)}")
        self.kind_slims = {name: _slim_views(views, self.kinds[name]) for name, views in (kind_slims or {}).items()}
        for name, rules in self.kinds.items():
            if name not in self.kind_slims:
                _slim_views(slims, rules)  # checks the kind's gate against the shared views
        self.drafter = drafter
        self.policy = policy
        self.kind = kind
        self.session = KVSession(target, view)
        drafter.follow(self.session)
        if method:
            self.method = method

    def describe(self) -> dict[str, Any]:
        policy = self.policy
        return {
            **super().describe(),
            "drafter": self.drafter.describe(),
            "slim_views": [view.describe() for view in self.slims],
            **{f"slim_views_{name}": [v.describe() for v in views] for name, views in self.kind_slims.items()},
            "profile": self.profile,
            "gamma": policy.gamma,
            "cap": policy.cap,
            **({"kinds": sorted(self.kinds)} if self.kinds else {}),
            **({"kind": self.kind} if self.kind else {}),
        }

    def routing(self, prompt: list[int]) -> tuple[str | None, RoundPolicy]:
        """The task kind of a request and the round policy that routes it (the profile's own where it has none
        for that kind). The kind is read from the prompt's text only when the profile has per-kind policies."""
        if not self.kinds:
            return self.kind, self.policy
        kind = self.kind or prompt_kind(self.tokenizer.decode(prompt))
        return kind, self.kinds.get(kind, self.policy)

    def sessions(self) -> tuple[KVSession, ...]:
        return (self.session, *self.drafter.sessions)

    def reset(self, prompt_length: int, budget: int) -> None:
        super().reset(prompt_length, budget)
        self.drafter.reset(prompt_length, budget)

    def _decode(self, prompt: list[int], sink: OutputSink, params: SamplingParams, stats: GenerationStats) -> None:
        generator = decision_generator(params, self.session.device)
        drafter_before = self.drafter.forward_passes
        stats.task_kind, policy = self.routing(prompt)
        slims = self.kind_slims.get(stats.task_kind or "", self.slims)
        names = policy.tier_names
        for name in names:
            stats.tier(name)
        unchecked = 0  # committed tokens the full target has not verified since its last pass
        # The first round goes to the full target, which reads the prompt as plain decoding does (`target_rows`,
        # after the tokens a prefix cache resumed): slim passes then attend to its entries for the whole prompt
        # (a slim view never reads it), and until a token settles below the target the output is plain's, bit for bit.
        playing = policy.opening()
        while not sink.done:
            context = prompt + sink.tokens
            k = draft_length(playing.gamma, sink.remaining, len(context), self.context_limit)
            passes = _ModelPasses(self, playing, slims, context, params, generator, stats)
            played = play_round(playing, passes, k, unchecked)  # one round (see decode.round)
            playing = policy
            # A round the full target ran commits only what it verified (decode.round): its rows score them all.
            taken = sink.push(played.committed, passes.full_logits if played.full else None)
            unchecked = 0 if played.full else unchecked + taken
            stats.record(played, taken, names, passes.proposal.source)
        stats.drafter_calls = self.drafter.forward_passes - drafter_before


def _slim_views(slims: Sequence[ViewLike], policy: RoundPolicy) -> list[View]:
    """The slim views a policy routes to, checked against its gate (one view per slim tier)."""
    views = [as_view(s) for s in slims]
    if not policy.gate.always_full:
        if not views or any(v is None for v in views):
            raise ViasdError("a tiered decoder needs at least one slim view")
        if policy.slim_tiers != len(views):
            raise ViasdError(
                f"{len(views)} slim tier(s) need {len(views) + 1} gate thresholds, got {len(policy.gate.thresholds)}"
            )
    return [v for v in views if v is not None]


class SlimViews:
    """The slim tiers' side of a round over one draft block: gate signals, checks and the bonus token.

    `view_logits(j)` gives slim view j's logits [k + 1, V] over the block; it is called lazily and once per
    view, so a deeper view runs only when a token reaches its tier. Where the logits live
    (`SamplingParams.on_device`), a view's checks and bonus are decided there for the whole block at once
    (verify/resident.py) and read with one transfer per view, the shallowest view's gate signals in the same one.
    """

    def __init__(
        self,
        proposal: Proposal,
        view_logits: Callable[[int], torch.Tensor],
        gate: Gate,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> None:
        self.proposal = proposal
        self.view_logits = view_logits
        self.gate = gate
        self.params = params
        self.generator = generator
        self.computed: dict[int, torch.Tensor] = {}
        self.read: dict[int, tuple[list[float], list[float]]] = {}  # per view: signals, outcomes (on the host)

    def view(self, tier: int) -> torch.Tensor:
        if tier not in self.computed:
            self.computed[tier] = self.view_logits(tier)
        return self.computed[tier]

    def outcomes(self, tier: int) -> tuple[list[float], list[float]]:
        """View `tier`'s outcomes over the block, decided on its device (and for view 1 the gate signals), read
        in one transfer."""
        if tier not in self.read:
            logits = self.view(tier)
            tokens = upload_ids(self.proposal.tokens, logits.device)
            decided = block_outcomes(tokens, self.proposal.probs, logits, self.params, self.generator)
            if tier == 1:
                slim = soft_probs(logits[: len(self.proposal)], self.params)
                signals, outcomes = host_values(self.gate.signals(slim, self.proposal.soft, tokens), decided)
            else:
                signals, (outcomes,) = [], host_values(decided)
            self.read[tier] = (signals, outcomes)
        return self.read[tier]

    def signals(self) -> list[float]:
        if self.params.on_device(self.view(1).device):
            return self.outcomes(1)[0]
        slim = soft_probs(self.view(1)[: len(self.proposal)], self.params)
        return self.gate.signals(slim, self.proposal.soft, self.proposal.tokens).tolist()

    def check(self, i: int, tier: int) -> int | None:
        if self.params.on_device(self.view(tier).device):
            outcome = self.outcomes(tier)[1][i]
            return None if outcome == STANDS else checked_token(outcome)
        verifier = warp_probs(self.view(tier)[i : i + 1], self.params)[0]  # the host path of sampling on a CPU
        draft = None if self.proposal.probs is None else self.proposal.probs[i]
        return check_token(self.proposal.tokens[i], draft, verifier, self.generator)

    def bonus(self, tier: int) -> int:
        k = len(self.proposal)
        if self.params.on_device(self.view(tier).device):
            return checked_token(self.outcomes(tier)[1][k])
        return sample(warp_probs(self.view(tier)[k : k + 1], self.params)[0], self.generator)


class _ModelPasses:
    """A round's model work for `play_round`: the drafter, the slim views on the target's session, the target."""

    def __init__(
        self,
        decoder: TieredDecoder,
        policy: RoundPolicy,
        slims: list[View],
        context: list[int],
        params: SamplingParams,
        generator: torch.Generator,
        stats: GenerationStats,
    ) -> None:
        self.decoder = decoder
        self.policy = policy
        self.slims = slims
        self.context = context
        self.params = params
        self.generator = generator
        self.stats = stats
        self.proposal = Proposal([])
        self.slim: SlimViews | None = None
        self.full_logits: torch.Tensor | None = None  # the full target's raw rows over the block, once it ran

    def draft(self, k: int) -> tuple[list[int], float | None]:
        with self.stats.timed("draft"):
            proposal = self.decoder.drafter.propose(self.context, k, self.params, self.generator, self.policy.stop)
            self.proposal = proposal.within(self.params, self.context)
        block, keep, session = self.context + self.proposal.tokens, len(self.proposal) + 1, self.decoder.session
        slims, context, drafts, params = self.slims, self.context, self.proposal.tokens, self.params
        self.slim = SlimViews(
            self.proposal,
            lambda tier: adjusted(session.extend_slim_to(block, slims[tier - 1], keep=keep), params, context, drafts),
            self.policy.gate,
            self.params,
            self.generator,
        )
        return self.proposal.tokens, self.proposal.confidence

    def judged(self) -> bool:
        return self.policy.gate.judges(self.proposal.soft)

    def signals(self) -> list[float]:
        assert self.slim is not None
        with self.stats.timed("slim"):
            return self.slim.signals()

    def check(self, i: int, tier: int) -> int | None:
        assert self.slim is not None
        with self.stats.timed("slim"):
            return self.slim.check(i, tier)

    def bonus(self, tier: int) -> int:
        assert self.slim is not None
        with self.stats.timed("slim"):
            return self.slim.bonus(tier)

    def verify(self) -> tuple[list[int], int]:
        with self.stats.timed("verify"):
            committed, kept, self.full_logits = verify_with_target(
                self.decoder.session, self.context, self.proposal, self.params, self.generator
            )
            return committed, kept
