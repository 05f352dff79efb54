"""Per-generation statistics shared by every decoding method."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TierStats:
    """What one verification tier did with the draft tokens routed to it."""

    decided: int = 0  # draft tokens whose fate this tier settled
    accepted: int = 0  # of those, kept
    rejected: int = 0  # of those, rejected (the tier then supplied a replacement token)
    calls: int = 0  # forward passes of this tier's model view


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
    slim_calls: int = 0  # forward passes of the slim verifier
    unchecked_tokens: int = 0  # committed tokens that the full target never verified (lossy tiers)
    draft_seconds: float = 0.0
    slim_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    finish_reason: str = ""
    tiers: dict[str, TierStats] = field(default_factory=dict)

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

    def tier(self, name: str) -> TierStats:
        return self.tiers.setdefault(name, TierStats())

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            rejection_rate=self.rejection_rate,
            tokens_per_target_call=self.tokens_per_target_call if self.target_calls else None,
            target_calls_per_token=self.target_calls_per_token,
            tokens_per_second=self.tokens_per_second,
        )
        return data
