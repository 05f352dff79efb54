"""The target's features: the final hidden states its output head reads, recorded from the passes that compute them.

A draft head (viasd.heads) drafts from these features instead of reading the prompt with a model of its own. They
are taken where every route of a pass meets: the input of the model's output head (its own forward with
`logits_to_keep`, viasd's loop, the fused stack, a quantized view's head), so a pass yields the features of exactly
the positions whose logits it computes, and no route has to know about them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def head_inputs(model: nn.Module, record: bool = True) -> Iterator[list[torch.Tensor]]:
    """Record the rows the model's output head reads in the block: one tensor [rows, hidden] per head call; where
    not `record` (no draft head follows the pass: its route's legs say so), nothing, and no hook is installed.

    Enter it after a view is applied (a quantized view swaps the head for its own copy)."""
    seen: list[torch.Tensor] = []
    if not record:
        yield seen
        return
    head = model.get_output_embeddings()  # type: ignore[operator]

    def record(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen.append(args[0].detach().reshape(-1, args[0].shape[-1]))

    handle = head.register_forward_pre_hook(record)
    try:
        yield seen
    finally:
        handle.remove()


class FeatureStore:
    """The features of one sequence by position, as its passes computed them.

    Invariant: the row at position j was computed from the tokens at positions 0..j that the session holds; a
    session that drops positions from `length` on (`cut`) drops their rows, so every row `known` is valid for the
    session's current tokens (committed, then pending).
    """

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None  # [capacity, hidden]
        self.known = 0  # rows [0, known) may hold features; `have` says which do
        self.have: list[bool] = []

    def reset(self) -> None:
        self.known = 0
        self.have = []

    def write(self, start: int, rows: torch.Tensor) -> None:
        """The features of positions [start, start + len(rows))."""
        end = start + rows.shape[0]
        # In inference mode whoever calls: a buffer grown inside it (a session's own pass) is an inference tensor,
        # which a write outside it (a batched pass's rows) may not update.
        with torch.inference_mode():
            if self.rows is None or self.rows.shape[0] < end or self.rows.shape[1] != rows.shape[1]:
                grown = rows.new_empty((max(2 * end, 256), rows.shape[1]))
                if self.rows is not None and self.rows.shape[1] == rows.shape[1]:
                    grown[: self.known] = self.rows[: self.known]
                self.rows = grown
            self.rows[start:end] = rows
        if len(self.have) < end:
            self.have.extend([False] * (end - len(self.have)))
        self.have[start:end] = [True] * (end - start)
        self.known = max(self.known, end)

    def cut(self, length: int) -> None:
        """Forget the features of positions from `length` on (the session dropped those tokens)."""
        if length < self.known:
            del self.have[length:]
            self.known = length

    def latest(self, upto: int) -> int | None:
        """The last position <= `upto` with a feature, or None."""
        for position in range(min(upto, self.known - 1), -1, -1):
            if self.have[position]:
                return position
        return None

    def row(self, position: int) -> torch.Tensor:
        assert self.rows is not None and position < self.known and self.have[position]
        return self.rows[position]
