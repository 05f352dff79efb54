"""Task-outcome calibration (bench/splits.py, calibration/task_check.py, `viasd calibrate --by-tasks`): the split
tuned on is disjoint from the split reported, and the fastest candidate within the budget in task-metric points
wins, with the categories that ruled out faster ones named."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from viasd.bench.splits import in_split, parse_split, split_of
from viasd.bench.tasks import build_tasks, load_humaneval
from viasd.calibration.task_check import QualityBudget, binding_categories, choose, judge, tasks_needed
from viasd.calibration.task_command import choose_by_tasks
from viasd.errors import ViasdError
from viasd.profile import default_profile_path, load_profile

# The HumanEval problems of the calibration split. A profile tuned on them is reported on the others, in this run and
# in every later one: a rule that moved a problem between splits would report old profiles on what they were tuned on.
CALIBRATION_HUMANEVAL = (1, 3, 8, 15, 17, 20, 22, 29, 34, 36, 41, 43, 48, 55, 57, 60, 62, 69, 74, 76, 81, 83, 88, 95,
                         97, 104, 106, 110, 112, 119, 125, 127, 131, 133, 138, 144, 146, 150, 152, 159)  # fmt: skip


def test_the_calibration_split_is_a_fixed_quarter_disjoint_from_the_report_split():
    keys = [t.key for t in load_humaneval()]
    calibration = [k for k in keys if in_split(k, "calibration")]
    report = [k for k in keys if in_split(k, "report")]
    assert len(calibration) == 40 and len(report) == 124
    assert not set(calibration) & set(report) and all(in_split(k, "all") for k in keys)
    assert calibration == [f"humaneval/HumanEval/{i}" for i in CALIBRATION_HUMANEVAL]


def test_a_tasks_split_depends_on_its_key_alone_not_on_the_process():
    """Another process (another hash seed) and a key asked alone, out of its task list, get the same split."""
    keys = ["humaneval/HumanEval/1", "humaneval/HumanEval/2", "specbench/162", "specbench/163"]
    code = "import sys; from viasd.bench.splits import split_of; print(' '.join(split_of(k) for k in sys.argv[1:]))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, *keys], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == [split_of(k) for k in keys]
    assert "calibration" in out.stdout.split() and "report" in out.stdout.split()


def test_bench_tasks_come_from_the_split_asked_for():
    report = build_tasks(categories=["qa", "rag"], count=100, humaneval=164, split="report")
    calibration = build_tasks(categories=["qa", "rag"], count=100, humaneval=164, split="calibration")
    assert {split_of(t.key) for t in report} == {"report"} and {split_of(t.key) for t in calibration} == {"calibration"}
    assert sum(t.source == "humaneval" for t in report) == 124
    every = build_tasks(categories=["qa", "rag"], count=100, humaneval=164)
    assert len(every) == len(report) + len(calibration)
    with pytest.raises(ViasdError, match="--split must be one of"):
        parse_split("held-out")


def row(method, key, category, score, speed, metric="pass@1"):
    return {"method": method, "key": key, "category": category, "quality": {"metric": metric, "scores": [score]},
            "stats": {"tokens_per_second": speed, "new_tokens": 10, "total_seconds": 10 / speed, "target_calls": 10},
            "turns": [{"text": "x"}]}  # fmt: skip


def run_rows(losses: dict[str, int], speeds: dict[str, float], tasks: int = 40) -> list[dict]:
    """A reference that passes every problem and scores 30 ROUGE-L everywhere; each candidate fails
    `losses[method]` problems and loses nothing on prose."""
    rows = []
    for i in range(tasks):
        rows.append(row("auto", f"h{i}", "humaneval", 1.0, 10.0))
        rows.append(row("auto", f"s{i}", "summarization", 30.0, 10.0, "rougeL"))
        for method, lost in losses.items():
            rows.append(row(method, f"h{i}", "humaneval", 0.0 if i < lost else 1.0, speeds[method]))
            rows.append(row(method, f"s{i}", "summarization", 30.0, speeds[method], "rougeL"))
    return rows


def test_the_fastest_candidate_within_the_budget_wins_and_code_is_named_as_binding():
    rows = run_rows({"loose": 3, "strict": 0}, {"loose": 25.0, "strict": 15.0})
    budget = QualityBudget(points=1.0)
    verdicts = [judge(rows, m, "auto", budget) for m in ("loose", "strict")]
    loose, strict = verdicts
    assert loose.speedup == pytest.approx(2.5) and strict.speedup == pytest.approx(1.5)
    human = next(c for c in loose.categories if c.category == "humaneval")
    assert human.difference_points == pytest.approx(-7.5) and not human.within  # 3 of 40 = 7.5 points
    assert choose(verdicts) is strict
    assert binding_categories(verdicts, strict) == ["humaneval"]
    # A looser budget takes the faster one; nothing then binds.
    wide = [judge(rows, m, "auto", QualityBudget(points=10.0)) for m in ("loose", "strict")]
    assert choose(wide).method == "loose" and binding_categories(wide, choose(wide)) == []


def test_a_significant_loss_fails_even_inside_the_points():
    rows = run_rows({"lossy": 8}, {"lossy": 20.0}, tasks=200)  # 4 points, but 8 lost and none gained: p = 0.008
    verdict = judge(rows, "lossy", "auto", QualityBudget(points=5.0))
    human = next(c for c in verdict.categories if c.category == "humaneval")
    assert human.difference_points == pytest.approx(-4.0) and human.p_value < 0.05 and not verdict.within
    assert judge(rows, "lossy", "auto", QualityBudget(points=5.0, alpha=0.001)).within


def write_run(directory: Path, rows: list[dict]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return directory


def test_by_tasks_writes_the_chosen_profile_with_what_was_measured(tmp_path):
    shipped = default_profile_path(True)
    loose, strict = tmp_path / "loose.json", tmp_path / "strict.json"
    shutil.copy(shipped, loose)
    shutil.copy(shipped, strict)
    names = {"loose": f"via:profile={loose}", "strict": f"via:profile={strict}"}
    rows = run_rows({names["loose"]: 3, names["strict"]: 0}, {names["loose"]: 25.0, names["strict"]: 15.0})
    humaneval = [t.key for t in load_humaneval() if in_split(t.key, "calibration")]
    for r in rows:  # real calibration-split keys, so the split filter keeps them
        r["key"] = humaneval[int(r["key"][1:])] if r["key"][0] == "h" else r["key"]
    rows = [r for r in rows if r["category"] == "humaneval"]
    run = write_run(tmp_path / "run", rows)
    lines: list[str] = []
    out = choose_by_tasks(run, "auto", QualityBudget(1.0), tmp_path / "chosen.json", lines.append)
    outcomes = load_profile(out).calibration["task_outcomes"]
    assert outcomes["chosen"] == names["strict"] and outcomes["binding_categories"] == ["humaneval"]
    assert outcomes["split"] == "calibration" and outcomes["budget_points"] == 1.0
    assert {c["method"]: c["within"] for c in outcomes["candidates"]} == {names["loose"]: False, names["strict"]: True}
    assert any("over budget" in line for line in lines) and lines[-1].startswith(f"chose {names['strict']}")
    # 40 problems cannot show a 1-point loss rate: the profile and the output say so.
    assert outcomes["unresolvable_categories"] == ["humaneval"]
    assert any(line.startswith("warning: humaneval has too few tasks") and "~299 needed" in line for line in lines)


def test_by_tasks_refuses_runs_it_cannot_judge(tmp_path):
    with pytest.raises(ViasdError, match="holds no benchmark run"):
        choose_by_tasks(tmp_path, "auto", QualityBudget(), tmp_path / "out.json")
    key = next(t.key for t in load_humaneval() if in_split(t.key, "calibration"))
    run = write_run(tmp_path / "run", [row("plain", key, "humaneval", 1.0, 5.0)])
    with pytest.raises(ViasdError, match="no calibration-split rows of 'auto'"):
        choose_by_tasks(run, "auto", QualityBudget(), tmp_path / "out.json")
    run = write_run(tmp_path / "run2", [row("auto", key, "humaneval", 1.0, 5.0), row("sd", key, "humaneval", 1, 6)])
    with pytest.raises(ViasdError, match="no candidate"):
        choose_by_tasks(run, "auto", QualityBudget(), tmp_path / "out.json")
    with pytest.raises(ViasdError, match="points must be >= 0"):
        choose_by_tasks(run, "auto", QualityBudget(points=-1), tmp_path / "out.json")
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize(("points", "alpha"), [(1.0, 0.05), (2.5, 0.05), (5.0, 0.01), (0.5, 0.1)])
def test_tasks_needed_is_the_least_n_at_which_a_loss_at_the_budget_rate_shows_up(points, alpha):
    n = tasks_needed(points, alpha)
    miss = lambda tasks: (1 - points / 100) ** tasks  # noqa: E731  (no loss seen, though each task loses at that rate)
    assert miss(n) < alpha <= miss(n - 1)
    assert tasks_needed(0.0, alpha) is None and tasks_needed(100.0, alpha) is None


def test_a_category_is_resolvable_only_with_enough_pass_fail_tasks():
    budget = QualityBudget(points=1.0)
    few = judge(run_rows({"c": 0}, {"c": 12.0}, tasks=40), "c", "auto", budget)
    many = judge(run_rows({"c": 0}, {"c": 12.0}, tasks=300), "c", "auto", budget)
    by = lambda v: {c.category: c.resolvable for c in v.categories}  # noqa: E731
    assert by(few) == {"humaneval": False, "summarization": True}  # ROUGE-L has no such count
    assert by(many) == {"humaneval": True, "summarization": True}
