"""What a pass costs on this machine: drafter steps, slim views and the full target, by tokens per pass.

Median seconds of a pass over L new tokens after a ~100-token prefix, for several L, with the measurements
of every kind and length interleaved in a shuffled order, so drift in machine load spreads evenly over them.
"""

from __future__ import annotations

import bisect
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from viasd.errors import ViasdError
from viasd.models.session import KVSession
from viasd.models.views import ViewLike


@dataclass(frozen=True)
class Costs:
    """Median seconds of a pass over L new tokens, per length in `lengths`; one `slim` series per slim tier."""

    lengths: tuple[int, ...]
    drafter: tuple[float, ...]
    full: tuple[float, ...]
    slim: tuple[tuple[float, ...], ...] = ()

    def _at(self, values: Sequence[float], n: int) -> float:
        """Linear interpolation between measured lengths; beyond the ends the end segments continue."""
        xs = self.lengths
        if len(xs) == 1:
            return values[0]
        i = min(max(bisect.bisect_left(xs, n), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], values[i - 1], values[i]
        return max(y0 + (y1 - y0) * (n - x0) / (x1 - x0), 0.0)

    @property
    def step(self) -> float:
        """One drafter step (one new token)."""
        return self._at(self.drafter, 1)

    def slim_pass(self, n: int, tier: int = 1) -> float:
        return self._at(self.slim[tier - 1], n)

    def full_pass(self, n: int) -> float:
        return self._at(self.full, n)


@dataclass
class CostTable:
    """Measured medians: 'drafter', 'full' and one 'slim:<i>' entry per mask, over `lengths`."""

    lengths: list[int]
    seconds: dict[str, list[float]]
    prefix: int
    repeats: int

    def costs(self, *slims: int) -> Costs:
        """Costs with the given masks (indices into the measured ones) as slim tiers 1, 2, ..."""
        return Costs(
            tuple(self.lengths),
            tuple(self.seconds["drafter"]),
            tuple(self.seconds["full"]),
            tuple(tuple(self.seconds[f"slim:{i}"]) for i in slims),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "lengths": self.lengths,
            "seconds": {k: [round(v, 5) for v in vs] for k, vs in self.seconds.items()},
            "prefix_tokens": self.prefix,
            "repeats": self.repeats,
            "statistic": "median, interleaved shuffled repeats",
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostTable:
        """The table a routing profile recorded (`calibration.costs`)."""
        try:
            return cls(
                [int(n) for n in data["lengths"]],
                {k: [float(v) for v in vs] for k, vs in data["seconds"].items()},
                int(data.get("prefix_tokens", 0)),
                int(data.get("repeats", 0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ViasdError(f"the profile's measured costs are malformed: {exc}") from exc


def measure_costs(
    target: nn.Module,
    drafter: nn.Module,
    slims: Sequence[ViewLike],
    tokens: Sequence[int],
    lengths: Sequence[int],
    prefix: int = 100,
    repeats: int = 5,
    seed: int = 0,
) -> CostTable:
    """Time drafter, full and slim-view passes over L new tokens after `prefix` tokens of `tokens`.

    The slim pass runs as in decoding: on the full target's session, attending to its KV of the prefix.
    """
    lengths = sorted(set(lengths))
    if not lengths or lengths[0] < 1:
        raise ViasdError("cost measurement: lengths must be >= 1")
    need = prefix + lengths[-1]
    if len(tokens) < need:
        tokens = (list(tokens) * (need // max(len(tokens), 1) + 1))[:need]
    head, tail = list(tokens[:prefix]), list(tokens[prefix:need])
    full_session, draft_session = KVSession(target), KVSession(drafter)
    full_session.forward(head)
    draft_session.forward(head)

    def run(kind: str, n: int) -> float:
        ids = tail[:n]
        t0 = time.perf_counter()
        if kind == "drafter":
            draft_session.forward(ids, keep=1)
            elapsed = time.perf_counter() - t0
            draft_session.truncate(prefix)
        elif kind == "full":
            full_session.forward(ids, keep=n)
            elapsed = time.perf_counter() - t0
            full_session.truncate(prefix)
        else:
            full_session.forward_slim(ids, slims[int(kind.split(":")[1])], keep=n)
            elapsed = time.perf_counter() - t0
            full_session.truncate_pending(0)
        return elapsed

    kinds = ["drafter", "full", *(f"slim:{i}" for i in range(len(slims)))]
    jobs = [(kind, n) for kind in kinds for n in lengths]
    for kind in kinds:  # warm-up
        run(kind, lengths[0])
    samples: dict[tuple[str, int], list[float]] = {job: [] for job in jobs}
    rng = random.Random(seed)
    for _ in range(repeats):
        rng.shuffle(jobs)
        for job in jobs:
            samples[job].append(run(*job))
    seconds = {kind: [float(torch.tensor(samples[(kind, n)]).median()) for n in lengths] for kind in kinds}
    return CostTable(list(lengths), seconds, prefix, repeats)
