"""`viasd calibrate --by-tasks RUN`: pick, among candidate profiles that a benchmark run measured with `via` on the
calibration split, the fastest within a quality budget in task-metric points, and write it with what was measured.

No model is loaded: everything comes from the run's rows. The run is made with
`viasd bench --split calibration --methods auto,via:profile=A.json,via:profile=B.json,...`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from viasd.bench.report import RESULTS_JSONL
from viasd.bench.runner import read_rows
from viasd.bench.splits import in_split
from viasd.calibration.provenance import utc_now
from viasd.calibration.task_check import QualityBudget, choose, describe, judge, record
from viasd.errors import ViasdError
from viasd.fileio import file_sha256
from viasd.methods import parse_method
from viasd.profile import load_profile, save_profile


def candidate_profiles(methods: list[str]) -> dict[str, Path]:
    """The run's `via` variants that name a profile file, by method name."""
    out: dict[str, Path] = {}
    for name in methods:
        spec = parse_method(name)
        if spec.base == "via" and spec.get("profile"):
            out[name] = Path(spec.get("profile"))
    return out


def choose_by_tasks(
    run: Path,
    reference: str,
    budget: QualityBudget,
    output: Path,
    say: Callable[[str], None] = print,
) -> Path:
    """Judge every candidate of the run against `reference` on its calibration-split rows, write the fastest within
    the budget to `output` (with `calibration.task_outcomes`), and return the path written."""
    budget.check()
    path = run / RESULTS_JSONL
    if not path.is_file():
        raise ViasdError(f"{run} holds no benchmark run ({path.name} missing): make one with bench --split calibration")
    rows, damaged = read_rows(path)
    if damaged:
        say(f"warning: {len(damaged)} damaged line(s) of {path} left out (the first: {damaged[0]})")
    rows = [r for r in rows if in_split(str(r.get("key", "")), "calibration")]
    methods = list(dict.fromkeys(str(r["method"]) for r in rows))
    if reference not in methods:
        raise ViasdError(f"the run has no calibration-split rows of {reference!r}; its methods: {', '.join(methods)}")
    profiles = candidate_profiles(methods)
    if not profiles:
        raise ViasdError("the run has no candidate: bench via:profile=FILE variants beside the reference")
    facts: dict[str, dict[str, Any]] = {}
    for method, file in profiles.items():
        if not file.is_file():
            raise ViasdError(f"{method}: its profile {file} is gone; the choice needs the file the run measured")
        calibration = load_profile(file).calibration
        facts[method] = {
            "profile_sha256": file_sha256(file),
            "agreement_budget": calibration.get("quality_budget"),
            "predicted_error_rate": calibration.get("predicted", {}).get("via", {}).get("error_rate"),
        }
    verdicts = [judge(rows, method, reference, budget) for method in profiles]
    for verdict in verdicts:
        say(describe(verdict))
    chosen = choose(verdicts)
    if chosen is None:
        raise ViasdError(
            f"no candidate is within {budget.points:g} points of {reference} on every category; "
            "add stricter candidates (calibrate --reselect with a lower --quality-budget)"
        )
    source = profiles[chosen.method]
    profile = load_profile(source)
    outcomes = record(verdicts, chosen, reference, budget, str(run), "calibration", facts)
    outcomes["date"] = utc_now()
    calibration = {**profile.calibration, "task_outcomes": outcomes}
    save_profile(dataclasses.replace(profile, calibration=calibration), output)
    for category in outcomes["unresolvable_categories"]:
        needed = next(c.tasks_needed for v in verdicts for c in v.categories if c.category == category)
        say(
            f"warning: {category} has too few tasks to show a loss of {budget.points:g} points (~{needed} needed): "
            "a candidate within budget there may still lose at that rate on other tasks"
        )
    bound = outcomes["binding_categories"]
    say(
        f"chose {chosen.method} ({chosen.speedup:.2f}x {reference} on the calibration split)"
        + (f"; faster candidates failed on {', '.join(bound)}" if bound else "")
        + f"; wrote {output}"
    )
    return output
