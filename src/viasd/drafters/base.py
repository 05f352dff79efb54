"""The drafter interface: given the committed tokens, propose the next few."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from viasd.verify.sampling import SamplingParams


@dataclass
class Proposal:
    """Draft tokens with the distributions they were drawn from.

    probs: [k, V] sampling distributions p_i (None: the tokens are deterministic, one-hot p_i).
    soft: [k, V] smooth distributions for confidence gates (None when the drafter has none).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    soft: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, k: int) -> Proposal:
        """The first k draft tokens."""
        return Proposal(
            self.tokens[:k],
            None if self.probs is None else self.probs[:k],
            None if self.soft is None else self.soft[:k],
        )


class Drafter(Protocol):
    """Proposes draft tokens. Implementations keep whatever state they need between calls."""

    name: str
    forward_passes: int

    def reset(self) -> None:
        """Start a new generation."""

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator) -> Proposal:
        """Up to k tokens that follow `context` (prompt plus committed tokens)."""
        ...
