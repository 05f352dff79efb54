"""Replay of greedy rounds along gate records, with the decoder's own round code and a cost model.

`replay` plays `decode.round.play_round` along each sequence's records (records.py) instead of running
models: a committed token is True when it is the target's greedy choice at its position, so the replay
counts errors as well as rounds, passes and tiers, exactly as the decoder would on that sequence.

The first round goes to the full target (`RoundPolicy.opening`), as in the decoder. Cost model of one round with k
draft tokens (reading the prompt is left to the projection's prompt terms):
    drafter: k steps; k is where the drafter stops under the policy's `stop`, at most the round's draft length.
             Each step feeds one token, c_d(1), except the first after a round that kept every draft: the last
             draft was never fed, so that step feeds it with the bonus token, c_d(2) (a quantized drafter's
             one-token kernels make that step dearer)
    slim:    one pass of each slim view that ran over k + 1 tokens, c_s(k + 1)
    full:    when the full target runs, one pass over every token it has not processed, c_f(1 + unchecked + k)
Records follow the committed sequence. They are exactly what the decoder saw as long as every token a lower tier
keeps is the target's choice (tests/test_round.py checks that rounds, passes and tiers then match the decoder's).
Elsewhere they approximate it: after a wrong token is committed the records cannot follow the drift, a wrong
token kept and then corrected by a full pass in the same round conditioned the gate's later signals on drafts
the records never see, and the pre-gate and the draft stop threshold judge drafts that follow earlier, possibly
wrong ones (the drafter's confidence after a wrong draft is not recorded: where a round drafts on past a wrong
draft, the replay may draft a different number of tokens after it, though it commits the same ones).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from viasd.calibration.costs import Costs
from viasd.calibration.records import GateRecords
from viasd.decode.round import Round, RoundPolicy, draft_length, play_round
from viasd.decode.stats import GenerationStats
from viasd.drafters.base import stopped_length

PARTS = ("draft", "slim", "verify")  # where a decoder's time goes, as `GenerationStats` times it


class RecordedPasses:
    """A round's outcomes read from one sequence's records at position `at` (see `decode.round.RoundParts`).

    stop: the policy's draft stop threshold; the drafts end where the drafter's recorded confidence says the
    model drafter would stop (`drafters.base.stopped_length`, the rule the drafter itself follows). Draft i of a
    round reads the records of depth i + 1 (a draft head's chain; a model drafter's are the same at every depth).
    """

    def __init__(self, records: GateRecords, signal: str, stop: float = 0.0) -> None:
        self.records = records
        self.by_depth = [records.at_depth(d) for d in range(1, len(records.depths) + 2)]
        self.values = [r.signal(signal) for r in self.by_depth]
        self.stop = stop
        self.at = 0
        self.k = 0

    def _depth(self, i: int) -> int:
        """Index into `by_depth` of draft i of the round."""
        return min(i, len(self.by_depth) - 1)

    def draft(self, k: int) -> tuple[list[bool], float | None]:
        j = self.at
        k = min(k, len(self.records) - j)
        own = [self.by_depth[self._depth(i)] for i in range(k)]
        # older records may lack the drafter's confidence (then no stop applies)
        tops = [r.draft_top[j + i] for i, r in enumerate(own) if j + i < len(r.draft_top)]
        if len(tops) == k:
            k = stopped_length(tops, self.stop)
            tops = tops[:k]
        self.k = k
        return [own[i].draft_ok[j + i] for i in range(k)], (min(tops) if tops else None)

    def judged(self) -> bool:
        return True  # the records are a model drafter's, with its distributions

    def signals(self) -> list[float]:
        return [self.values[self._depth(i)][self.at + i] for i in range(self.k)]

    def check(self, i: int, tier: int) -> bool | None:
        # Greedy: the draft stands when it is the view's top token, else the view's top token replaces it.
        at = self.at + i
        agrees = self.by_depth[self._depth(i)].slim_agrees[tier - 1][at]
        return None if agrees else self.records.slim_ok[tier - 1][at]

    def bonus(self, tier: int) -> bool:
        return self.records.slim_ok[tier - 1][self.at + self.k]

    def verify(self) -> tuple[list[bool], int]:
        kept = 0
        while kept < self.k and self.by_depth[self._depth(kept)].draft_ok[self.at + kept]:
            kept += 1
        return [True] * (kept + 1), kept  # the full target's own token is its choice by definition


@dataclass
class Prediction:
    """Replayed counts (as the decoder's statistics), predicted seconds and errors of a policy."""

    stats: GenerationStats
    seconds: float = 0.0
    errors: int = 0  # committed tokens that differ from the target's greedy choice
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))  # seconds by part

    @property
    def tokens(self) -> int:
        return self.stats.new_tokens

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def error_rate(self) -> float:
        return self.errors / self.tokens if self.tokens else 0.0

    @property
    def decided(self) -> dict[str, int]:
        """Draft tokens settled per tier: accept, slim (all slim tiers together), full."""
        tiers = self.stats.tiers
        slim = sum(t.decided for name, t in tiers.items() if name not in ("accept", "full"))
        full = tiers["full"].decided if "full" in tiers else self.stats.evaluated
        return {"accept": tiers["accept"].decided if "accept" in tiers else 0, "slim": slim, "full": full}

    def to_dict(self) -> dict[str, Any]:
        s = self.stats
        return {
            "tokens": self.tokens,
            "seconds": self.seconds,
            "seconds_by_part": dict(self.parts),
            "errors": self.errors,
            "rounds": s.rounds,
            "target_calls": s.target_calls,
            "slim_calls": s.slim_calls,
            "drafter_steps": s.drafted,
            "evaluated": s.evaluated,
            "accepted": s.accepted,
            "decided": self.decided,
            "tokens_per_second": self.tokens_per_second,
            "error_rate": self.error_rate,
            "rejection_rate": s.rejection_rate,
            "tokens_per_target_call": s.tokens_per_target_call if s.target_calls else None,
        }


def round_parts(played: Round[Any], costs: Costs, unchecked: int, feed: int = 1) -> dict[str, float]:
    """Predicted seconds of one round by part, as the bench splits a decoder's time (draft, slim, verify): the
    module docstring's cost model. `unchecked` as before the round, `feed` the tokens of its first drafter step
    (`first_feed` of the round before)."""
    k = played.drafted
    return {
        "draft": costs.drafter_pass(feed) + (k - 1) * costs.step if k else 0.0,
        "slim": sum(costs.slim_pass(k + 1, tier) for tier in played.views),
        "verify": costs.full_pass(1 + unchecked + k) if played.full else 0.0,
    }


def first_feed(played: Round[Any]) -> int:
    """Tokens the next round's first drafter step feeds: 2 after a round that kept every draft (its last
    draft and the bonus token), else 1 (the replacement token; the drafter's cache is cut back to the rest)."""
    return 2 if played.drafted and played.accepted == played.drafted else 1


def replay(records: Sequence[GateRecords], policy: RoundPolicy, costs: Costs | None = None) -> Prediction:
    """Play greedy rounds of `policy` along every sequence's records; seconds only when `costs` are given."""
    out = Prediction(GenerationStats(method="replay"))
    names = policy.tier_names
    for name in names:
        out.stats.tier(name)
    for seq in records:
        parts = RecordedPasses(seq, policy.gate.signal, policy.stop)
        unchecked, feed = 0, 1
        playing = policy.opening()  # as the decoder: the first round goes to the full target
        while parts.at < len(seq):
            k = draft_length(playing.gamma, len(seq) - parts.at)
            played = play_round(playing, parts, k, unchecked)
            playing = policy
            taken = len(played.committed)
            out.stats.record(played, taken, names)
            out.errors += taken - sum(played.committed)
            if costs is not None:
                for part, seconds in round_parts(played, costs, unchecked, feed).items():
                    out.parts[part] += seconds
                    out.seconds += seconds
            feed = first_feed(played)
            unchecked = 0 if played.full else unchecked + taken
            parts.at += taken
    out.stats.new_tokens = sum(len(seq) for seq in records)
    return out
