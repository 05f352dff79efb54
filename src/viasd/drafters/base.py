"""The drafter interface (given the committed tokens, propose the next few) and the per-round draft length rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from viasd.verify.gates import draft_confidence
from viasd.verify.sampling import SamplingParams

if TYPE_CHECKING:
    from viasd.passes.session import KVSession


def stops_after(confidence: float, stop: float) -> bool:
    """Whether drafting ends after a draft token whose drafter confidence (its top probability) is `confidence`.

    The one rule of the per-round draft length: a model drafter stops at its first token under the threshold
    `stop` (0: never), that token included. Including it costs no drafter step (its distribution is already
    computed) and barely any verification (a target pass over one more token costs about the same), and it is
    still kept often. The decoders' drafters and the calibration replay both decide with this function.
    """
    return confidence < stop


def stopped_length(confidences: Sequence[float], stop: float) -> int:
    """How many drafts a drafter proposes when its confidences would be these: up to the first under `stop`."""
    for i, confidence in enumerate(confidences):
        if stops_after(confidence, stop):
            return i + 1
    return len(confidences)


@dataclass
class Proposal:
    """Draft tokens with the distributions they were drawn from, and which drafter proposed them.

    probs: [k, V] sampling distributions p_i (None: the tokens are deterministic, one-hot p_i).
    soft: [k, V] smooth distributions for confidence gates (None when the drafter has none).
    source: the name of the drafter that proposed them (a hybrid drafter names the part it used), for the
    per-source statistics.
    tops: the drafter's top probability (of `soft`) per draft token, on the host (a model drafter reads them from
    the device with its tokens, in the same transfer); None: read from `soft` when needed.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    soft: torch.Tensor | None = None
    source: str = ""
    tops: list[float] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def confidence(self) -> float | None:
        """The drafter's least top probability over the block (what the pre-gate judges); None without
        distributions or drafts."""
        if self.tops is not None:
            return min(self.tops) if self.tops else None
        return draft_confidence(self.soft)

    def after(self, forced: Sequence[int]) -> Proposal:
        """`forced` (deterministic drafts: one-hot distributions, top probability 1) followed by these drafts; named
        after the drafter when it drafted any, else `grammar`."""
        if not forced:
            return self
        count = len(forced)

        def joined(rows: torch.Tensor | None) -> torch.Tensor | None:
            if rows is None:
                return None
            ones = torch.zeros(count, rows.shape[1], device=rows.device, dtype=rows.dtype)
            ones[torch.arange(count), torch.tensor(list(forced))] = 1.0
            return torch.cat([ones, rows])

        if self.tops is not None:
            tops: list[float] | None = [1.0] * count + list(self.tops)
        else:  # read from `soft` where it exists; forced drafts alone are sure
            tops = None if self.tokens else [1.0] * count
        source = self.source if self.tokens else "grammar"
        return Proposal([*forced, *self.tokens], joined(self.probs), joined(self.soft), source, tops)

    def within(self, params: SamplingParams, context: list[int]) -> Proposal:
        """These drafts up to the first the grammar forbids after `context` (all of them without a grammar): a
        forbidden draft would be rejected anyway, so it is cut before verification costs anything."""
        if params.grammar is None:
            return self
        kept = params.grammar.allowed_length(context, self.tokens)
        if kept == len(self.tokens):
            return self
        return Proposal(
            self.tokens[:kept],
            None if self.probs is None else self.probs[:kept],
            None if self.soft is None else self.soft[:kept],
            self.source,
            None if self.tops is None else self.tops[:kept],
        )


class SessionCounts:
    """The counts of a drafter whose model passes all run on its KV sessions (`sessions`): theirs, summed."""

    @property
    def sessions(self) -> tuple[KVSession, ...]:
        raise NotImplementedError

    @property
    def forward_passes(self) -> int:
        return sum(session.forward_passes for session in self.sessions)

    @property
    def pass_seconds(self) -> float:
        return sum((session.pass_seconds for session in self.sessions), 0.0)


class Drafter(Protocol):
    """Proposes draft tokens. Implementations keep whatever state they need between calls."""

    name: str
    forward_passes: int
    pass_seconds: float  # what its model passes cost (a pass merged with other generations' counts whole)

    @property
    def sessions(self) -> tuple[KVSession, ...]:
        """The KV sessions its model passes run on (none for a drafter without a model of its own)."""
        ...

    def reset(self, prompt_length: int | None = None, budget: int | None = None) -> None:
        """Start a new generation of at most `budget` tokens after a prompt of `prompt_length` (None: unknown)."""

    def describe(self) -> str:
        """What drafts, in a few words (statistics and run records name it so)."""
        ...

    def follow(self, target: KVSession) -> None:
        """The decoder's KV session of the target, whose passes a draft head drafts from (others ignore it)."""

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator, stop: float = 0.0
    ) -> Proposal:
        """Up to k tokens that follow `context` (prompt plus committed tokens); a drafter with distributions
        stops early after its first token whose top probability is under `stop` (`stops_after`)."""
        ...


def reach_of(drafter: Drafter, context: Sequence[int], params: SamplingParams) -> int:
    """How many tokens `drafter` would draft this round past the decoder's gamma: a copy drafter's long, sure match
    (drafters/suffix.py, `reach`); 0 for the others, which draft at most gamma."""
    reach = getattr(drafter, "reach", None)
    return int(reach(context, params)) if callable(reach) else 0
