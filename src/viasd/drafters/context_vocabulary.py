"""A draft head's vocabulary widened by the context: its own tokens, then the context's tokens it lacks.

A head reads its logits through the target's own output head, restricted to the tokens the target writes most
(heads/network.py); a name, a word of another language or an identifier that the prompt holds is then out of its
reach, though the answer often repeats it. Any token's logit costs one more row of the target's output head, so a
proposal also scores the context's tokens that the head's vocabulary lacks: a few hundred rows beside 8,192, no
training (benchmarks/2026-12-05-head-context-vocab-zen4: 16.7% of the report tasks' next tokens lay outside the
head's vocabulary, 4.9% outside this one). Proposals stay proper distributions, zero outside the vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from viasd.models.stored import OutputRows

MOST_ADDED = 4096  # the most context tokens a vocabulary adds (a long context's rarest stay out of reach)


class ContextVocabulary:
    """The extra tokens a head scores for one context, and their rows of the target's output head, kept up to
    date as the context grows. Invariant: `ids` is the head's ids followed by the tokens of `scanned` (the context
    seen so far, in first-seen order) that the head lacks, at most MOST_ADDED of them; `rows` holds their rows."""

    def __init__(self, own: torch.Tensor, output: torch.Tensor | OutputRows, dtype: torch.dtype) -> None:
        self.own = own
        self.output = output  # [V, hidden]: the target's output head (shared, not copied; a stored one's rows read)
        self.dtype = dtype
        self._own = set(own.tolist())
        self.clear()

    def clear(self) -> None:
        self.scanned: list[int] = []
        self.added: list[int] = []
        self._added: set[int] = set()
        self.ids = self.own
        self.rows = torch.empty((0, self.output.shape[1]), dtype=self.dtype, device=self.output.device)

    def follow(self, context: list[int]) -> None:
        """Take in the tokens of `context` not seen yet; another context (not a continuation) starts over."""
        seen = len(self.scanned)
        if len(context) < seen or context[:seen] != self.scanned:
            self.clear()
            seen = 0
        new = []
        for token in context[seen:]:
            if len(self.added) + len(new) >= MOST_ADDED:
                break
            if token not in self._own and token not in self._added and 0 <= token < self.output.shape[0]:
                self._added.add(token)
                new.append(token)
        self.scanned.extend(context[seen:])
        if new:
            self.added += new
            ids = torch.tensor(new, dtype=torch.long, device=self.own.device)
            self.rows = torch.cat([self.rows, self.output[ids].detach().to(self.dtype)])
            self.ids = torch.cat([self.own, torch.tensor(self.added, dtype=torch.long, device=self.own.device)])

    def logits(self, own: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Logits [1, len(ids)]: the head's own ([1, vocab], already computed) and the added tokens'."""
        if not self.added:
            return own
        return torch.cat([own, (self.rows @ state.reshape(-1).to(self.dtype)).float()[None]], dim=-1)
