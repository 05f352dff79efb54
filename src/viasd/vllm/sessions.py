"""Per-request drafter sessions for a proposer that vLLM calls with token rows only, no request ids.

vLLM hands a proposer each running request's committed tokens (prompt and output, no drafts). A request's
committed tokens only grow, so the session a request used last step is the one whose last context is a prefix of
the row now; rows are matched to sessions that way, a row with none starts a new session (a request that joined),
and a session no row matched is dropped (its request finished, was cancelled, or was preempted: then it starts
again from its prompt). Two rows with the same tokens get two sessions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

S = TypeVar("S")


@dataclass
class Session(Generic[S]):
    """A drafter state and the committed tokens it last drafted after."""

    state: S
    context: list[int]


def _extends(row: Sequence[int], context: list[int]) -> bool:
    """Whether `row` starts with `context` (its last token compared first: the cheap, telling check)."""
    n = len(context)
    return n <= len(row) and (n == 0 or row[n - 1] == context[-1]) and list(row[:n]) == context


class SessionPool(Generic[S]):
    """Drafter sessions matched to vLLM's rows by context prefix; `make` builds a new session's state."""

    def __init__(self, make: Callable[[], S]) -> None:
        self.make = make
        self.sessions: list[Session[S]] = []
        self.started = 0  # sessions made so far
        self.dropped = 0  # sessions dropped because no row matched them

    def __len__(self) -> int:
        return len(self.sessions)

    def assign(self, rows: Sequence[Sequence[int] | None]) -> tuple[list[S | None], int]:
        """The session state of every row (None for a row given as None: not drafting this step), each row's
        context recorded as its session's; every session no row matched is dropped. Also returns how many rows
        started a new session."""
        free = list(self.sessions)
        matched: list[Session[S]] = []
        states: list[S | None] = []
        new = 0
        for row in rows:
            if row is None:
                states.append(None)
                continue
            best = max((s for s in free if _extends(row, s.context)), key=lambda s: len(s.context), default=None)
            if best is None:
                best = Session(self.make(), [])
                self.started += 1
                new += 1
            else:
                free.remove(best)
            best.context = list(row)
            matched.append(best)
            states.append(best.state)
        self.dropped += len(free)
        self.sessions = matched
        return states, new
