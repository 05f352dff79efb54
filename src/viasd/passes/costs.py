"""The measured cost of a model's passes by rows, kept as they run: what a pass of R rows costs on this machine,
under this load (decoding steps, verification blocks and prompt chunks of concurrent generations alike)."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

EMA = 0.2  # weight of a new pass in a row count's running cost


@dataclass(eq=False)
class PassCosts:
    """Seconds per pass by rows, a running average per row count, shared by the threads of one model's batcher."""

    _seconds: dict[int, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, rows: int, seconds: float) -> None:
        with self._lock:
            old = self._seconds.get(rows)
            self._seconds[rows] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def table(self) -> dict[int, float]:
        with self._lock:
            return dict(self._seconds)

    def estimate(self, rows: int) -> float | None:
        """The cost of a pass of `rows` rows from the ones measured (None: nothing measured yet)."""
        return interpolated_cost(self.table(), rows)


def interpolated_cost(table: dict[int, float], rows: int) -> float | None:
    """Cost of `rows` rows from measured (rows -> seconds): linear between measured neighbours; below the
    smallest measured, that one's cost (a pass is never cheaper for fewer rows than it costs at one); beyond the
    largest, proportional to rows (the pessimistic guess, until such passes have been measured)."""
    if not table:
        return None
    sizes = sorted(table)
    if rows in table:
        return table[rows]
    if rows < sizes[0]:
        return table[sizes[0]]
    if rows > sizes[-1]:
        return table[sizes[-1]] * rows / sizes[-1]
    above = bisect.bisect_left(sizes, rows)
    low, high = sizes[above - 1], sizes[above]
    share = (rows - low) / (high - low)
    return table[low] + share * (table[high] - table[low])
