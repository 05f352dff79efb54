"""Prompt lookup drafting (Saxena 2023): copy what followed the latest earlier match of the last n-gram."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from viasd.drafters.base import Proposal
from viasd.verify.sampling import SamplingParams

if TYPE_CHECKING:
    from viasd.passes.session import KVSession


def lookup_continuation(context: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens following the most recent earlier occurrence of the context's last n-gram.

    Longer n-grams are tried first; an empty list means no match.
    """
    n_ctx = len(context)
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        tail = context[n_ctx - n :]
        # Search right to left, excluding the tail itself.
        for start in range(n_ctx - n - 1, -1, -1):
            if context[start : start + n] == tail:
                follow = context[start + n : start + n + k]
                if follow:
                    return follow
    return []


class PromptLookupDrafter:
    """A drafter without a model: its proposals are deterministic (one-hot p) and carry no confidence.

    min_ngram: the shortest n-gram of the context's tail whose earlier occurrence counts as a match (longer
    ones, up to max_ngram, are tried first). copy: the most tokens copied per round (None: as many as the
    round may draft).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, copy: int | None = None, name: str = "lookup") -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if copy is not None and copy < 1:
            raise ValueError("need copy >= 1")
        self.name = name
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.copy = copy
        self.forward_passes = 0
        self.pass_seconds = 0.0

    @property
    def sessions(self) -> tuple[KVSession, ...]:
        """None: it runs no model."""
        return ()

    def reset(self, prompt_length: int | None = None, budget: int | None = None) -> None:
        """Stateless between rounds."""

    def describe(self) -> str:
        return f"prompt lookup ({self.min_ngram}-{self.max_ngram}-grams)"

    def follow(self, target: object) -> None:
        """Prompt lookup reads the tokens, not the target's passes."""

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator, stop: float = 0.0
    ) -> Proposal:
        """What followed the latest match, up to k (and `copy`) tokens; `stop` has nothing to judge here."""
        k = k if self.copy is None else min(k, self.copy)
        return Proposal(lookup_continuation(context, k, self.max_ngram, self.min_ngram), source=self.name)
