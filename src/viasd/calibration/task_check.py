"""Choosing among candidate routing profiles by task outcomes: each candidate ran `via` on the calibration split of
the benchmark beside an exact reference (which stands for the target), and the fastest whose quality stays within a
budget in task-metric points on every category wins.

Agreement with the target's greedy tokens (what the replay selects by) is a proxy: on code a single unchecked
token can break a program. The budget here is stated in the metrics users judge by (pass@1, ROUGE-L, BLEU,
accuracy), task by task: a category fails when its mean loss exceeds the budget, or when the paired sign test
(McNemar's for pass/fail) says the losses are significant. All functions are pure: they read benchmark rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from viasd.bench.metrics import geometric_mean, per_prompt_speedups
from viasd.bench.paired import Paired, paired
from viasd.errors import ViasdError

# Metrics scored 0/1 per task; their points are percentage points (x 100). The others are already 0..100.
FRACTION_METRICS = frozenset({"pass@1", "math_accuracy", "reference_match"})


@dataclass(frozen=True)
class QualityBudget:
    """How much quality a candidate may cost: `points` of each category's metric (mean over paired tasks), and no
    loss significant at level `alpha` (two-sided exact sign test)."""

    points: float = 1.0
    alpha: float = 0.05

    def check(self) -> QualityBudget:
        if not self.points >= 0:
            raise ViasdError(f"the quality budget in points must be >= 0, got {self.points}")
        if not 0 < self.alpha < 1:
            raise ViasdError(f"the significance level must be in (0, 1), got {self.alpha}")
        return self


@dataclass(frozen=True)
class CategoryVerdict:
    """One category of one candidate against the reference: the paired counts, the mean difference in points
    (negative: the candidate is worse) and whether it is within the budget."""

    category: str
    metric: str
    tasks: int
    lost: int
    gained: int
    difference_points: float
    p_value: float
    within: bool
    tasks_needed: int | None = None  # pass/fail metrics: tasks that could show a loss the size of the budget

    @property
    def resolvable(self) -> bool:
        """Whether this many tasks could have shown a loss as large as the budget (None: not a pass/fail metric)."""
        return self.tasks_needed is None or self.tasks >= self.tasks_needed


@dataclass(frozen=True)
class CandidateVerdict:
    """A candidate's speed against the reference (geometric mean of per-task ratios) and its categories."""

    method: str
    speedup: float | None
    tasks: int
    categories: tuple[CategoryVerdict, ...]

    @property
    def within(self) -> bool:
        return all(c.within for c in self.categories)

    def failing(self) -> list[str]:
        return [c.category for c in self.categories if not c.within]


def points(result: Paired) -> float:
    """The mean difference of a paired comparison in points of its metric."""
    scale = 100.0 if result.metric in FRACTION_METRICS else 1.0
    return result.mean_difference * scale


def tasks_needed(points: float, alpha: float) -> int | None:
    """Tasks a pass/fail category needs before a loss of `points` percentage points would show at all: with a
    per-task loss rate of points/100, n tasks show no loss with probability (1 - rate)^n; below `alpha` takes
    n >= log(alpha) / log(1 - rate). 1 point at 5%: 299 tasks (HumanEval has 164). None when points is 0 or >= 100."""
    rate = points / 100.0
    if not 0 < rate < 1:
        return None
    return math.ceil(math.log(alpha) / math.log1p(-rate))


def category_verdict(result: Paired, budget: QualityBudget) -> CategoryVerdict:
    """Whether one category's paired result is within the budget."""
    difference = points(result)
    significant_loss = result.lost > result.gained and result.p_value < budget.alpha
    return CategoryVerdict(
        category=result.category,
        metric=result.metric,
        tasks=result.tasks,
        lost=result.lost,
        gained=result.gained,
        difference_points=difference,
        p_value=result.p_value,
        within=difference >= -budget.points and not significant_loss,
        tasks_needed=tasks_needed(budget.points, budget.alpha) if result.metric in FRACTION_METRICS else None,
    )


def judge(rows: Sequence[Mapping[str, Any]], method: str, reference: str, budget: QualityBudget) -> CandidateVerdict:
    """One candidate method of a benchmark run against the reference method, over the tasks both finished."""
    good = [r for r in rows if not r.get("error") and r["method"] in (method, reference)]
    ratios = [v for (m, _), v in per_prompt_speedups(good, reference).items() if m == method]
    results = paired(good, method, reference)
    return CandidateVerdict(
        method=method,
        speedup=geometric_mean(ratios),
        tasks=len(ratios),
        categories=tuple(category_verdict(r, budget) for r in results),
    )


def choose(verdicts: Sequence[CandidateVerdict]) -> CandidateVerdict | None:
    """The fastest candidate within the budget on every category (None when none is)."""
    passing = [v for v in verdicts if v.within and v.speedup is not None]
    return max(passing, key=lambda v: v.speedup or 0.0, default=None)


def binding_categories(verdicts: Sequence[CandidateVerdict], chosen: CandidateVerdict | None) -> list[str]:
    """Categories that ruled out a faster candidate than the chosen one: where a kind of task (code, say) needs a
    tighter gate than the others."""
    floor = chosen.speedup if chosen is not None and chosen.speedup is not None else float("-inf")
    faster = [v for v in verdicts if v.speedup is not None and v.speedup > floor]
    return sorted({c for v in faster for c in v.failing()})


def record(
    verdicts: Sequence[CandidateVerdict],
    chosen: CandidateVerdict | None,
    reference: str,
    budget: QualityBudget,
    run: str,
    split: str,
    profiles: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """What a profile stores of its task-outcome check (`calibration.task_outcomes`): the run and split it was
    measured on, the budget, every candidate's verdict (with the agreement budget it was selected under) and which
    categories bound the choice."""
    return {
        "run": run,
        "split": split,
        "reference": reference,
        "budget_points": budget.points,
        "alpha": budget.alpha,
        "chosen": chosen.method if chosen else None,
        "binding_categories": binding_categories(verdicts, chosen),
        "candidates": [{**asdict(v), "within": v.within, **dict(profiles.get(v.method, {}))} for v in verdicts],
        "unresolvable_categories": unresolvable(verdicts),
    }


def unresolvable(verdicts: Sequence[CandidateVerdict]) -> list[str]:
    """Pass/fail categories with too few tasks to show a loss the size of the budget: there a candidate that lost
    nothing may still lose at the budget's rate (the choice rests on luck; say so rather than call it checked)."""
    return sorted({c.category for v in verdicts for c in v.categories if not c.resolvable})


def describe(verdict: CandidateVerdict) -> str:
    """One line per candidate, then one per category: what a user reads to see why a candidate was (not) chosen."""
    speed = f"{verdict.speedup:.2f}x" if verdict.speedup is not None else "-"
    state = "within" if verdict.within else "OVER"
    lines = [f"{verdict.method}: {speed} the reference over {verdict.tasks} tasks, {state} budget"]
    for c in verdict.categories:
        lines.append(
            f"  {c.category} ({c.metric}): {c.difference_points:+.1f} points, lost {c.lost}, gained {c.gained} "
            f"of {c.tasks}, p = {c.p_value:.2f}{'' if c.within else '  <- over budget'}"
            + ("" if c.resolvable else f"  (too few to show a {c.metric} loss this small: ~{c.tasks_needed} needed)")
        )
    return "\n".join(lines)
