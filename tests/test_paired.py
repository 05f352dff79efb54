"""Quality compared task by task (bench/paired.py, `viasd bench --compare`): losses and gains per category and the
exact sign test (McNemar's for pass/fail) that says how likely such a split is by chance."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from scipy.stats import binomtest

from viasd.bench.paired import paired, sign_test
from viasd.bench.report import comparison


@pytest.mark.parametrize(("lost", "gained"), [(0, 0), (2, 0), (0, 2), (5, 1), (10, 0), (7, 7), (3, 9)])
def test_the_sign_test_is_the_exact_two_sided_binomial_test(lost, gained):
    want = 1.0 if lost + gained == 0 else binomtest(lost, lost + gained, 0.5).pvalue
    assert math.isclose(sign_test(lost, gained), want, rel_tol=1e-12)


def row(method, key, category, score, metric="pass@1", seconds=1.0):
    return {"method": method, "key": key, "category": category, "quality": {"metric": metric, "scores": [score]},
            "stats": {"new_tokens": 10, "total_seconds": seconds, "prompt_tokens": 5, "target_calls": 10},
            "turns": [{"text": "x"}]}  # fmt: skip


def test_losses_and_gains_are_counted_per_category_over_tasks_both_scored():
    rows = []
    for task in range(12):  # the method fails three problems the baseline passes, passes one it fails
        rows.append(row("base", f"h{task}", "humaneval", 1.0 if task < 10 else 0.0))
        rows.append(row("new", f"h{task}", "humaneval", 0.0 if task < 3 else 1.0))
    rows.append(row("new", "only-new", "humaneval", 1.0))  # scored by one method only: not paired
    rows += [row("base", "t1", "translation", 20.0, "bleu"), row("new", "t1", "translation", 25.5, "bleu")]
    (human, translation) = paired(rows, "new", "base")
    assert (human.tasks, human.lost, human.gained) == (12, 3, 2)  # lost 0-2; gained 10 and 11
    assert math.isclose(human.p_value, binomtest(3, 5, 0.5).pvalue) and math.isclose(human.mean_difference, -1 / 12)
    assert (translation.tasks, translation.gained, translation.mean_difference) == (1, 1, 5.5)


def test_compare_prints_speed_then_quality_task_by_task():
    """On a recorded run: the lines `--compare` prints agree with the rows' own scores."""
    run = Path(__file__).parent.parent / "benchmarks" / "2026-12-02-cpu-zen5-tiles" / "results.jsonl"
    rows = [json.loads(line) for line in run.read_text().splitlines()]
    text = comparison(rows, "via", "auto")
    assert text.splitlines()[0].startswith("via over auto: 1.231x")
    scores = {(r["method"], r["key"]): r["quality"]["scores"][0] for r in rows if r["category"] == "translation"}
    keys = {key for _, key in scores}
    lost = sum(scores[("via", k)] < scores[("auto", k)] for k in keys)
    gained = sum(scores[("via", k)] > scores[("auto", k)] for k in keys)
    assert f"translation (bleu): lost {lost}, gained {gained} of {len(keys)} tasks" in text


def test_a_run_without_plain_reports_against_its_first_method_with_a_task_by_task_table():
    """A run of `auto` and `via` (no plain: too slow for 164 problems) reads as ratios to `auto`, and its summary
    says per category what `via` lost and gained against it, with the p-value `--compare` gives."""
    from viasd.bench.metrics import ALL, summarize
    from viasd.bench.report import markdown, report_baseline

    run = Path(__file__).parent.parent / "benchmarks" / "2026-12-02-cpu-zen5-tiles" / "results.jsonl"
    rows = [json.loads(line) for line in run.read_text().splitlines()]
    rows = [r for r in rows if r["method"] in ("auto", "via", "llama.cpp")]
    env = {"settings": {"methods": ["plain", "auto", "via", "llama.cpp"]}}
    assert report_baseline(rows, env) == "auto" and report_baseline(rows, {}) == rows[0]["method"]
    text = markdown(summarize(rows, "auto"), env, rows, "auto")
    via = next(s for s in summarize(rows, "auto") if s.method == "via" and s.category == ALL)
    assert math.isclose(via.speedup, 1.231, abs_tol=5e-4)  # what --compare via,auto says of the same run
    table = text[text.index("### Task by task against `auto`") :]
    row = next(line for line in table.splitlines() if line.startswith("| via |"))
    (translation,) = [p for p in paired(rows, "via", "auto") if p.category == "translation"]
    assert f"-{translation.lost} / +{translation.gained} of {translation.tasks} (p {translation.p_value:.2f})" in row
    assert "| auto |" not in table.split("## ")[0]  # the reference has no row of its own
