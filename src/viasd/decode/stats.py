"""Per-generation statistics shared by every decoding method, counted from the rounds they play."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from viasd.decode.round import Round


@dataclass
class TierStats:
    """What one verification tier did with the draft tokens routed to it."""

    decided: int = 0  # draft tokens whose fate this tier settled
    accepted: int = 0  # of those, kept
    rejected: int = 0  # of those, rejected (the tier then supplied a replacement token)
    calls: int = 0  # forward passes of this tier's model view


@dataclass
class SourceStats:
    """What the drafts of one draft source (a drafter, or one part of a hybrid drafter) came to."""

    rounds: int = 0  # rounds whose draft this source proposed (rounds with an empty draft count for none)
    drafted: int = 0
    evaluated: int = 0
    accepted: int = 0


@dataclass
class GenerationStats:
    """Counters and timings of one generation; derived ratios are properties."""

    method: str
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0  # draft tokens proposed
    evaluated: int = 0  # draft tokens that some verifier looked at (the rest were cut by an earlier rejection)
    accepted: int = 0  # draft tokens kept
    target_calls: int = 0  # forward passes of the full target
    drafter_calls: int = 0  # forward passes of the drafter model (0 for model-free drafters)
    unchecked_tokens: int = 0  # committed tokens that the full target never verified (lossy tiers)
    draft_seconds: float = 0.0
    slim_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    # Until the first committed token (the prompt read and the first round), and the tokens that round committed:
    # what follows is decoding proper (decode_tokens_per_second).
    first_token_seconds: float = 0.0
    first_tokens: int = 0
    finish_reason: str = ""
    tiers: dict[str, TierStats] = field(default_factory=dict)
    choice: dict[str, Any] | None = None  # what the `auto` method chose, and why
    task_kind: str | None = None  # the task kind whose round policy routed a `via` request (viasd.task_kind)
    sources: dict[str, SourceStats] = field(default_factory=dict)  # per draft source, for drafting methods
    # Model passes of every session the generation ran (target, its views, a model drafter) by the route they took
    # (passes/route.py: model, loop, fused, batched, queued, chunked, split).
    routes: dict[str, int] = field(default_factory=dict)

    @property
    def rejection_rate(self) -> float:
        """Evaluated draft tokens that were not kept, over evaluated draft tokens."""
        return (self.evaluated - self.accepted) / self.evaluated if self.evaluated else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        """Mean committed tokens per full-target forward pass (plain decoding: 1)."""
        return self.new_tokens / self.target_calls if self.target_calls else float("inf")

    @property
    def target_calls_per_token(self) -> float:
        return self.target_calls / self.new_tokens if self.new_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens/s after the first committed token (None: nothing came after it): decoding without the prompt's
        read, which every method pays alike."""
        seconds = self.total_seconds - self.first_token_seconds
        tokens = self.new_tokens - self.first_tokens
        return tokens / seconds if tokens > 0 and seconds > 0 else None

    @property
    def slim_calls(self) -> int:
        """Forward passes of the slim views, all tiers together."""
        return sum(t.calls for name, t in self.tiers.items() if name not in ("accept", "full"))

    def tier(self, name: str) -> TierStats:
        return self.tiers.setdefault(name, TierStats())

    def source(self, name: str) -> SourceStats:
        return self.sources.setdefault(name, SourceStats())

    def record(self, played: Round[Any], taken: int, tiers: Sequence[str] = (), source: str = "") -> None:
        """Count one round. `taken`: how many of its committed tokens the output kept (a stop may cut the
        rest). `tiers`: the tier names of a tiered method (accept, slim..., full), whose tiers are counted.
        `source`: the draft source that proposed the round's draft, counted when it drafted anything."""
        self.rounds += 1
        self.drafted += played.drafted
        self.evaluated += played.evaluated
        self.accepted += played.accepted
        if source and played.drafted:
            counts = self.source(source)
            counts.rounds += 1
            counts.drafted += played.drafted
            counts.evaluated += played.evaluated
            counts.accepted += played.accepted
        if played.full:
            self.target_calls += 1
        else:
            self.unchecked_tokens += taken
        if not tiers:
            return
        for name in tiers:
            self.tier(name)
        for view in played.views:
            self.tier(tiers[view]).calls += 1
        if played.full:
            full = self.tier("full")
            full.calls += 1
            full.decided += played.evaluated
            full.accepted += played.accepted
            full.rejected += played.evaluated - played.accepted
            return
        for i, index in enumerate(played.settled):
            record = self.tier(tiers[index])
            record.decided += 1
            if played.slim_rejected and i == len(played.settled) - 1:
                record.rejected += 1
            else:
                record.accepted += 1

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Add the block's wall-clock time to `<part>_seconds` (draft, slim or verify)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            name = f"{part}_seconds"
            setattr(self, name, getattr(self, name) + time.perf_counter() - start)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            rejection_rate=self.rejection_rate,
            tokens_per_target_call=self.tokens_per_target_call if self.target_calls else None,
            target_calls_per_token=self.target_calls_per_token,
            tokens_per_second=self.tokens_per_second,
            decode_tokens_per_second=self.decode_tokens_per_second,
            slim_calls=self.slim_calls,
        )
        return data
