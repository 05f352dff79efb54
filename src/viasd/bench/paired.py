"""Quality of two methods compared task by task: what one lost and gained against the other, and how likely so many
losses would be by chance. A 2-problem swing on 40 HumanEval tasks is read for what it is: the sign test (McNemar's
exact test, for pass/fail metrics) over the tasks whose outcomes differ."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Paired:
    """One metric of one category: tasks both methods scored, those where the method did worse (lost) and better
    (gained) than the baseline, the mean difference, and the two-sided exact p-value of that split."""

    category: str
    metric: str
    tasks: int
    lost: int
    gained: int
    mean_difference: float
    p_value: float


def sign_test(lost: int, gained: int) -> float:
    """Two-sided exact binomial p-value of `lost` against `gained` outcomes under no difference (McNemar's exact
    test when the outcomes are pass/fail): how often a split at least this uneven comes by chance."""
    n = lost + gained
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(lost, gained) + 1)) / 2**n
    return min(1.0, 2 * tail)


def _score(row: Mapping[str, Any]) -> float | None:
    quality = row.get("quality") or {}
    scores = quality.get("scores") or []
    return sum(scores) / len(scores) if scores and not row.get("error") else None


def paired(rows: Sequence[Mapping[str, Any]], method: str, baseline: str) -> list[Paired]:
    """Per category, the method's quality against the baseline's over the tasks both scored."""
    by_task: dict[tuple[str, str], dict[str, float]] = {}
    metrics: dict[str, str] = {}
    for row in rows:
        score = _score(row)
        if score is None or row["method"] not in (method, baseline):
            continue
        by_task.setdefault((row["category"], row["key"]), {})[row["method"]] = score
        metrics[row["category"]] = row["quality"]["metric"]
    out = []
    for category in sorted(metrics):
        pairs = [(s[method], s[baseline]) for (c, _), s in by_task.items() if c == category and len(s) == 2]
        if not pairs:
            continue
        lost = sum(m < b for m, b in pairs)
        gained = sum(m > b for m, b in pairs)
        difference = sum(m - b for m, b in pairs) / len(pairs)
        out.append(Paired(category, metrics[category], len(pairs), lost, gained, difference, sign_test(lost, gained)))
    return out


def describe(results: Sequence[Paired]) -> str:
    """One line per category: `humaneval (pass@1): lost 2, gained 0 of 40 tasks, mean -0.050, p = 0.50`."""
    return "\n".join(
        f"  {r.category} ({r.metric}): lost {r.lost}, gained {r.gained} of {r.tasks} tasks, "
        f"mean {r.mean_difference:+.3f}, p = {r.p_value:.2f}"
        for r in results
    )
