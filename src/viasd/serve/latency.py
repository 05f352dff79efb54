"""Request latencies as vLLM's server measures them, and the Prometheus histograms that count them.

The bucket boundaries are vLLM's, so that dashboards and alerts written for vLLM read viasd's histograms unchanged
(with the `viasd:` prefix for `vllm:`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

# Seconds. Time to first token: dense below a second, up to very long prompts.
TIME_TO_FIRST_TOKEN_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# Seconds per output token: from fast decoding to stalls of several seconds.
TIME_PER_OUTPUT_TOKEN_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# Seconds a whole request (or its wait in the queue) takes.
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclass(frozen=True)
class RequestTimes:
    """Seconds of one finished request, each from its arrival (when the server queued it) but `per_output_token`."""

    queue: float  # waiting for a free generation slot
    first_token: float  # until its first token was committed
    per_output_token: float  # mean time per token after the first (0 with fewer than two tokens)
    end_to_end: float  # until its generation ended


def request_times(
    arrived: float, started: float, ended: float, first_token: float | None, generating: float, tokens: int
) -> RequestTimes:
    """The times of a request from clock readings (`arrived`, `started` generating, `ended`, in seconds of one
    clock) and what its generation measured: seconds from its start to its first token (None: it committed
    none) and to its end, and the tokens it kept. Time per output token is vLLM's: the time from the first
    token to the end, over the tokens after the first."""
    queue = max(started - arrived, 0.0)
    end_to_end = max(ended - arrived, 0.0)
    if first_token is None:
        return RequestTimes(queue, end_to_end, 0.0, end_to_end)
    per_token = max(generating - first_token, 0.0) / (tokens - 1) if tokens > 1 else 0.0
    return RequestTimes(queue, min(queue + first_token, end_to_end), per_token, end_to_end)


@dataclass
class Histogram:
    """Observations counted into buckets by upper bound (`value <= bound`), with their count and sum."""

    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)  # per bucket, the last one past every bound (+Inf)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> Iterator[tuple[str, int]]:
        """(le, observations <= le) for every bound, then ("+Inf", all), as Prometheus exposes a histogram."""
        running = 0
        for bound, count in zip([*map(_le, self.bounds), "+Inf"], self.counts, strict=True):
            running += count
            yield bound, running


def _le(bound: float) -> str:
    return repr(float(bound))
