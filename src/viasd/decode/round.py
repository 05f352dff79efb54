"""One VIA-SD round, the single place where its routing rules live.

A round: the drafter proposes up to k tokens (fewer when it stops at a token it is unsure of: the policy's
`stop`). Unless the round goes straight to the full target (nothing was drafted, the cap leaves no room, or
the pre-gate doubts the draft), the shallowest slim view scores the block and the gate sends each draft
token, left to right, to a tier:

* accept (tier 0): the token is kept unchecked;
* slim tier j (1..m): the token is checked against slim view j; a rejected token is replaced by that
  view's choice and the round ends;
* full (m + 1): the full target verifies the whole block (classic speculative sampling) and the lower
  tiers' decisions of this round are dropped.

If every token stood, the round closes with a bonus token from the deepest slim view that ran.

`play_round` decides and never runs a model: the parts it is given do. The tiered decoder gives it real
passes (drafter, slim views, full target); the calibration replay gives it recorded outcomes along a
teacher-forced sequence. Both therefore follow the same rules, token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Generic, Protocol, TypeVar

from viasd.errors import ViasdError
from viasd.speculation import DEFAULT_GAMMA
from viasd.verify.gates import Gate

T = TypeVar("T")


def draft_length(gamma: int, remaining: int, context_len: int = 0, context_limit: int | None = None) -> int:
    """Draft tokens worth proposing this round: a round commits at most k + 1 tokens, within the context."""
    k = min(gamma, remaining - 1)
    if context_limit is not None:
        k = min(k, context_limit - context_len - 1)
    return max(k, 0)


def tier_names(slim_tiers: int) -> list[str]:
    """Names of the tiers in order: accept, slim (or slim1..slimN), full."""
    slims = ["slim"] if slim_tiers == 1 else [f"slim{j}" for j in range(1, slim_tiers + 1)]
    return ["accept", *slims, "full"]


@dataclass(frozen=True)
class RoundPolicy:
    """The rules of a round: the gate, the draft length, the cap and the pre-gate.

    gamma: most draft tokens per round. stop: the drafter stops drafting after a token whose top probability
    is under it (0: off; `drafters.base.stops_after`), so a round drafts between 1 and gamma tokens.
    cap: most tokens committed without the full target before a full pass is forced (bounds the catch-up
    cost and the drift from the target). pregate: a round whose least confident draft token has a drafter
    probability under it goes straight to the full target (0: off); such rounds mostly escalate anyway,
    so their slim pass would be wasted. gamma and stop come checked where they entered (viasd.speculation).
    """

    gate: Gate
    gamma: int = DEFAULT_GAMMA
    cap: int = 32
    pregate: float = 0.0
    stop: float = 0.0

    def __post_init__(self) -> None:
        if self.cap < 1:
            raise ViasdError(f"the cap on tokens committed without the full target must be >= 1, got {self.cap}")
        if not 0.0 <= self.pregate <= 1.0:
            raise ViasdError(f"the pre-gate must be a probability in [0, 1], got {self.pregate}")

    @property
    def slim_tiers(self) -> int:
        """Number of slim tiers the gate routes to (0 in exact mode)."""
        return 0 if self.gate.always_full else self.gate.full_tier - 1

    @property
    def tier_names(self) -> list[str]:
        return ["accept", "full"] if self.gate.always_full else tier_names(self.slim_tiers)

    def opening(self) -> RoundPolicy:
        """The policy of a generation's first round: every draft to the full target, which reads the prompt then as
        plain decoding reads it (its cache entries and rows are plain's, bit for bit, and slim views attend to them
        after); the draft length, cap and stop threshold stay."""
        return self if self.gate.always_full else replace(self, gate=Gate.exact(), pregate=0.0)

    def tries_lower_tiers(self, drafted: int, unchecked: int, confidence: float | None, judged: bool = True) -> bool:
        """Whether a round runs the slim views at all; otherwise it goes straight to the full target.

        unchecked: tokens committed since the full target's last pass. confidence: the drafter's least top
        probability over the block (None: the drafter has no distributions, so the pre-gate cannot judge it).
        judged: whether the gate's signal can judge the drafts at all (`Gate.judges`); if not, every token
        would reach the full target and a slim pass would be wasted.
        """
        if not judged or drafted == 0 or self.gate.always_full or self.cap - unchecked < 2:
            return False
        return not (self.pregate > 0.0 and confidence is not None and confidence < self.pregate)


class RoundParts(Protocol[T]):
    """What a round needs from the models (or from records of them); T is what a committed token is."""

    def draft(self, k: int) -> tuple[Sequence[T], float | None]:
        """Up to k draft tokens (fewer where the drafter stopped under the policy's `stop`), and the drafter's
        least top probability over them (None: unknown)."""
        ...

    def judged(self) -> bool:
        """Whether the gate's signal can judge the drafts (a KL gate cannot without the drafter's distributions)."""
        ...

    def signals(self) -> Sequence[float]:
        """The gate signal of each draft token (runs the shallowest slim view)."""
        ...

    def check(self, i: int, tier: int) -> T | None:
        """Check draft token i against slim view `tier`: None if it stands, else the view's replacement."""
        ...

    def bonus(self, tier: int) -> T:
        """The token after the whole block, from slim view `tier`."""
        ...

    def verify(self) -> tuple[list[T], int]:
        """The full target verifies the block: the committed tokens and how many drafts it kept."""
        ...


@dataclass(frozen=True)
class Round(Generic[T]):
    """What one round did: the tokens it committed and how they were decided."""

    committed: list[T]
    drafted: int
    settled: tuple[int, ...] = ()  # tier of each draft token settled below the full target, left to right
    slim_rejected: bool = False  # the last settled token was rejected by its slim view and replaced
    views: tuple[int, ...] = ()  # slim tiers whose view ran
    full_kept: int | None = None  # drafts the full target kept; None: the full target did not run

    @property
    def full(self) -> bool:
        return self.full_kept is not None

    @property
    def evaluated(self) -> int:
        """Draft tokens some verifier looked at (those behind a rejection are cut off unchecked)."""
        if self.full_kept is not None:
            return min(self.full_kept + 1, self.drafted)
        return len(self.settled)

    @property
    def accepted(self) -> int:
        if self.full_kept is not None:
            return self.full_kept
        return len(self.settled) - int(self.slim_rejected)


def play_round(policy: RoundPolicy, parts: RoundParts[T], k: int, unchecked: int) -> Round[T]:
    """One round: draft -> slim views -> gate -> (settle below the full target | full verify)."""
    drafts, confidence = parts.draft(k)
    if policy.tries_lower_tiers(len(drafts), unchecked, confidence, parts.judged()):
        signals = parts.signals()
        room = policy.cap - unchecked  # tokens this round may still commit without the full target
        committed: list[T] = []
        tiers: list[int] = []
        views = {1}  # the shallowest view ran to give the signals
        for i, draft in enumerate(drafts):
            tier = policy.gate.tier(signals[i])
            # Keeping token i and then closing the round commits i + 2 tokens.
            if tier == policy.gate.full_tier or i + 2 > room:
                break
            tiers.append(tier)
            if tier > 0:
                views.add(tier)
                replacement = parts.check(i, tier)
                if replacement is not None:
                    return Round([*committed, replacement], len(drafts), tuple(tiers), True, tuple(sorted(views)))
            committed.append(draft)
        else:
            deepest = max(views)
            committed.append(parts.bonus(deepest))
            return Round(committed, len(drafts), tuple(tiers), False, tuple(sorted(views)))
        # A token needs the full target: it verifies the whole block, the slim passes of this round are spent.
        full, kept = parts.verify()
        return Round(full, len(drafts), views=tuple(sorted(views)), full_kept=kept)
    full, kept = parts.verify()
    return Round(full, len(drafts), full_kept=kept)
