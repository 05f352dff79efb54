"""Gates: turn a per-token disagreement signal into a verification tier.

A signal is "lower is more confident". Tiers are numbered 0 (accept without checking), 1..m (slim
verifiers of increasing depth) and m+1 (the full target). Thresholds t_0 <= ... <= t_m split the
signal's range: g <= t_0 -> tier 0; t_{j-1} < g <= t_j -> tier j; g > t_m -> full.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from viasd.errors import ViasdError

SIGNALS = ("kl", "confidence")


Tokens = Sequence[int] | torch.Tensor  # draft token ids, on the host or as a LongTensor where the rows are


def kl_signal(slim: torch.Tensor, draft: torch.Tensor | None, tokens: Tokens) -> torch.Tensor:
    """KL(s_i || p_i) per row (nats), where the rows are; a drafter without distributions (None) gives +inf
    (unknown)."""
    if draft is None:
        return torch.full((slim.shape[0],), math.inf, device=slim.device)
    width = min(slim.shape[-1], draft.shape[-1])
    s = slim[:, :width].float().clamp_min(1e-30)
    p = draft[:, :width].float().to(s.device).clamp_min(1e-30)
    return (s * (s.log() - p.log())).sum(dim=-1).clamp_min(0.0)


def confidence_signal(slim: torch.Tensor, draft: torch.Tensor | None, tokens: Tokens) -> torch.Tensor:
    """1 - s_i(x_i) / max_v s_i(v): 0 when the slim verifier's top choice is the draft token (1 for a token
    beyond the slim view's width)."""
    idx = torch.as_tensor(tokens, dtype=torch.long, device=slim.device)
    chosen = slim.gather(-1, idx.clamp(0, slim.shape[-1] - 1)[:, None])[:, 0] * (idx < slim.shape[-1])
    return 1.0 - chosen / slim.max(dim=-1).values


def draft_confidence(soft: torch.Tensor | None) -> float | None:
    """The drafter's least top probability over a draft block: what the pre-gate judges a round by.

    None when the drafter has no distributions (prompt lookup) or drafted nothing.
    """
    if soft is None or not soft.shape[0]:
        return None
    return float(soft.float().max(dim=-1).values.min())


@dataclass(frozen=True)
class Gate:
    """A signal and its tier thresholds (one per boundary; len = number of slim tiers + 1)."""

    signal: str = "kl"
    thresholds: tuple[float, ...] = (0.05, 1.0)

    def __post_init__(self) -> None:
        if self.signal not in SIGNALS:
            raise ViasdError(f"unknown gate signal {self.signal!r}; choose one of {', '.join(SIGNALS)}")
        if not self.thresholds:
            raise ViasdError("a gate needs at least one threshold")
        if any(math.isnan(t) for t in self.thresholds):
            raise ViasdError(f"gate thresholds must be numbers, got {list(self.thresholds)}")
        if any(b < a for a, b in zip(self.thresholds, self.thresholds[1:], strict=False)):
            raise ViasdError(f"gate thresholds must not decrease: {list(self.thresholds)}")

    @property
    def full_tier(self) -> int:
        return len(self.thresholds)

    def signals(self, slim: torch.Tensor, draft: torch.Tensor | None, tokens: Tokens) -> torch.Tensor:
        fn = kl_signal if self.signal == "kl" else confidence_signal
        return fn(slim, draft, tokens)

    def tier(self, value: float) -> int:
        """Tier index for one signal value (NaN goes to the full tier)."""
        if math.isnan(value):
            return self.full_tier
        return bisect.bisect_left(self.thresholds, value)

    @classmethod
    def exact(cls) -> Gate:
        """Every token goes to the full target: classic speculative decoding."""
        return cls("kl", (-math.inf,))

    @property
    def always_full(self) -> bool:
        return self.thresholds[-1] == -math.inf

    def judges(self, draft: torch.Tensor | None) -> bool:
        """Whether the signal can say anything of drafts with these distributions: KL needs the drafter's (prompt
        lookup has none, so every copied token would go to the full target), confidence only the slim view's."""
        return draft is not None or self.signal != "kl"
