"""The edit workload (bench/edits.py): tasks made from HumanEval's solutions and the Spec-Bench questions, their
checks, their splits and their selection."""

import ast

import pytest
import torch
from typer.testing import CliRunner

from tiny import tiny_model, tiny_tokenizer
from viasd.bench import edits
from viasd.bench.metrics import summarize
from viasd.bench.runner import RunSettings, run_task, score_task
from viasd.bench.sandbox import run_program
from viasd.bench.splits import base_key, split_of
from viasd.bench.tasks import build_tasks, load_humaneval_problems, load_specbench, spread
from viasd.decode.plain import PlainDecoder
from viasd.errors import ViasdError

# bubblewrap where it works, else the guard alone (with a warning), as in test_bench.py
SANDBOX = None


@pytest.fixture(scope="module")
def problems():
    return {p["task_id"]: p for p in load_humaneval_problems()}


def _task(kind, problem):
    task = edits.edit_task(kind, problem)
    assert task is not None, (kind, problem["task_id"])
    return task


def _tests_pass(code, task):
    program = f"{code}\n\n{task.extra['test']}\n\ncheck({task.extra['entry_point']})\n"
    return run_program(program, isolate=SANDBOX).passed


def _sample(tasks, n=4):
    return spread(tasks, n)


# ------------------------------------------------------------------------------------------- generation


def test_tasks_are_made_the_same_every_time(problems):
    first = edits.edit_tasks(problems.values())
    again = edits.edit_tasks(load_humaneval_problems())
    assert [(t.key, t.turns, dict(t.extra)) for t in first] == [(t.key, t.turns, dict(t.extra)) for t in again]
    counts = {kind: sum(t.category == kind for t in first) for kind in edits.EDIT_KINDS}
    assert counts["edit_types"] == counts["edit_rename"] == 164
    assert 100 <= counts["edit_fix"] < 164 and 5 <= counts["edit_comprehension"] < 20
    chosen = build_tasks(categories=["edit_fix:3", "chat_revise:2"], count=0)
    assert [t.key for t in chosen] == [t.key for t in build_tasks(categories=["edit_fix:3", "chat_revise:2"], count=0)]


def test_an_edit_task_shows_the_whole_solution_and_asks_for_whole_code(problems):
    problem = problems["HumanEval/12"]
    task = _task("edit_rename", problem)
    assert task.key == "edit_rename:humaneval/HumanEval/12" and task.source == "edit"
    assert edits.solution_code(problem).rstrip() in task.turns[0]  # the prompt and the solution, verbatim
    assert task.extra["old"] in ("strings", "maxlen", "s") and f"`{task.extra['new']}`" in task.turns[0]
    assert task.prefix == "```python\n" and task.stop == ("\n```",)


def test_an_injected_bug_fails_the_tests_and_the_solution_fixes_it(problems):
    tasks = [t for t in edits.edit_tasks(problems.values(), ["edit_fix"])]
    for task in _sample(tasks, 6):
        problem = problems[base_key(task.key).removeprefix("humaneval/")]
        given = task.extra["given"]
        assert given != edits.solution_code(problem) and task.extra["bug"]
        assert not _tests_pass(given, task), task.key  # the bug shows: the tests fail
        assert edits.check_edit(task, edits.solution_code(problem), isolate=SANDBOX).passed  # the fix passes
        assert not edits.check_edit(task, given, isolate=SANDBOX).passed


def test_bugs_are_small_and_in_the_solution(problems):
    problem = problems["HumanEval/0"]
    source = edits.solution_code(problem)
    bugs = edits.bug_candidates(source, "has_close_elements", body_from=len(problem["prompt"]))
    assert [b.what for b in bugs] == ["`!=` became `==`", "`<` became `<=`"]
    assert all(b.start >= len(problem["prompt"]) for b in bugs)  # never in the prompt's docstring
    changed = bugs[1].apply(source)
    assert "if distance <= threshold:" in changed and len(changed) == len(source) + 1
    ranges = edits.bug_candidates("def f(n):\n    return list(range(1, n))\n", "f")
    assert ranges[0].apply("def f(n):\n    return list(range(1, n))\n").endswith("range(1, n - 1))\n")


def test_a_rename_applied_passes_and_the_given_code_does_not(problems):
    tasks = edits.edit_tasks(problems.values(), ["edit_rename"])
    for task in _sample(tasks):
        problem = problems[base_key(task.key).removeprefix("humaneval/")]
        old, new = task.extra["old"], task.extra["new"]
        renamed = edits.rename(edits.solution_code(problem), task.extra["entry_point"], old, new)
        assert edits.check_edit(task, renamed, isolate=SANDBOX).passed, task.key
        assert edits.kind_problem("edit_rename", task.extra["given"], task.extra) == f"`{old}` is still there"


def test_types_and_comprehension_references_pass_and_the_given_code_does_not(problems):
    typed = _task("edit_types", problems["HumanEval/12"])
    assert "->" not in typed.extra["given"] and '"""' not in typed.extra["given"]
    assert edits.check_edit(typed, edits.solution_code(problems["HumanEval/12"]), isolate=SANDBOX).passed
    assert edits.kind_problem("edit_types", typed.extra["given"], typed.extra) is not None
    for task in edits.edit_tasks(problems.values(), ["edit_comprehension"])[:3]:
        problem = problems[base_key(task.key).removeprefix("humaneval/")]
        reference = edits.to_comprehension(edits.solution_code(problem), task.extra["entry_point"])
        assert edits.check_edit(task, reference, isolate=SANDBOX).passed, task.key
        assert edits.kind_problem("edit_comprehension", task.extra["given"], task.extra) == "a for loop still appends"


# ------------------------------------------------------------------------------------------- checks


def test_wrong_edits_fail(problems):
    problem = problems["HumanEval/12"]
    source = edits.solution_code(problem)
    rename = _task("edit_rename", problem)
    old, new = rename.extra["old"], rename.extra["new"]
    assert not edits.check_edit(rename, edits.rename(source, "longest", old, "other"), isolate=SANDBOX).passed
    half = source.replace(f"for {old} in", f"for {new} in", 1) if old == "s" else source.replace(f"({old}:", f"({new}:")
    result = edits.check_edit(rename, half, isolate=SANDBOX)
    assert not result.passed  # renamed in one place only: either the old name is left or the tests fail

    typed = _task("edit_types", problem)
    no_return = source.replace(") -> Optional[str]:", "):")
    assert edits.check_edit(typed, no_return, isolate=SANDBOX).detail == "a parameter or the return has no annotation"
    broken = source.replace("return s\n", "return None\n")  # annotated and documented, but wrong
    assert edits.kind_problem("edit_types", broken, typed.extra) is None
    assert not edits.check_edit(typed, broken, isolate=SANDBOX).passed
    assert edits.check_edit(typed, "def longest(", isolate=SANDBOX).detail.startswith("not Python")

    fix = _task("edit_fix", problem)
    assert not edits.check_edit(fix, fix.extra["given"], isolate=SANDBOX).passed  # nothing fixed

    loop = _task("edit_comprehension", problems["HumanEval/14"])
    both = edits.solution_code(problems["HumanEval/14"]).replace("    return result", "    return [x for x in result]")
    assert edits.check_edit(loop, both, isolate=SANDBOX).detail == "a for loop still appends"
    wrong = "def all_prefixes(string):\n    return [string[:i] for i in range(len(string))]\n"
    assert edits.kind_problem("edit_comprehension", wrong, loop.extra) is None
    assert not edits.check_edit(loop, wrong, isolate=SANDBOX).passed  # off by one: the tests fail


def test_the_answer_code_ends_at_its_block():
    code = "def f():\n    return 1\n"
    assert edits.answer_code(code + "```\nThat is the code.") == code.rstrip("\n")
    assert edits.answer_code(code) == code


def test_revise_copy_measures_what_the_second_answer_copied():
    first = "Dear Ann,\nThe report is ready.\nBest, Bo"
    mark = "REVISED ANSWER"
    assert edits.revise_copy(first, f"{mark}\n{first}", mark) == 1.0
    assert edits.revise_copy(first, f"**Revised answer**\n\n{first}\n", mark) == 1.0
    assert edits.revise_copy(first, first, mark) == 0.0  # the asked-for line is missing
    assert edits.revise_copy(first, f"{mark}\nDear Ann,\nThe report", mark) == pytest.approx(4 / 8)
    assert edits.revise_copy(first, f"{mark}\nDear Ann,\nThe report", mark, second_cut=True) == 1.0
    assert edits.revise_copy(first, f"{mark}\nSomething else entirely.", mark) == 0.0
    again = "Here is my answer again:"
    assert edits.revise_copy(first, f"{again} Dear Ann,\nThe report is ready.", again) == pytest.approx(6 / 8)
    assert edits.revise_copy(first, f"Sure! {again}\n{first}", again) == 0.0  # not where it was asked for


def test_score_task_scores_edits_and_revisions(problems):
    problem = problems["HumanEval/12"]
    fix = _task("edit_fix", problem)
    good = score_task(fix, [edits.solution_code(problem) + "```"], 10.0, unsandboxed=True)
    bad = score_task(fix, [fix.extra["given"]], 10.0, unsandboxed=True)
    assert good["metric"] == bad["metric"] == "pass@1" and good["scores"] == [1.0] and bad["scores"] == [0.0]
    question = load_specbench()[0]
    chat = edits.revise_task(question)
    assert chat.key == f"chat_revise:{question.key}" and chat.turns[0] == question.turns[0]
    assert chat.extra["mark"] in chat.turns[1]
    scored = score_task(chat, ["Hello there.", f"{chat.extra['mark']}\nHello there."], 10.0)
    assert scored == {"metric": "revise_copy", "scores": [1.0]}


def test_rows_of_edit_tasks_carry_their_quality_into_the_summary(problems):
    tok = tiny_tokenizer(64)
    torch.manual_seed(0)
    decoder = PlainDecoder(tiny_model("qwen2", layers=2, seed=0), tok)
    settings = RunSettings(methods=["plain"], max_new_tokens=4, chat=False, allow_unsandboxed_code=True)
    fix = _task("edit_fix", problems["HumanEval/12"])
    chat = edits.revise_task(load_specbench()[0])
    rows = [run_task(decoder, tok, task, "plain", settings) for task in (fix, chat)]
    assert rows[0]["quality"]["metric"] == "pass@1" and rows[0]["quality"]["scores"] == [0.0]  # random model
    assert len(rows[1]["turns"]) == 2 and rows[1]["quality"]["metric"] == "revise_copy"
    by = {s.category: s for s in summarize(rows)}
    assert by["edit_fix"].quality_metric == "pass@1" and by["edit_fix"].quality == 0.0
    assert by["chat_revise"].quality_n == 1


# --------------------------------------------------------------------------------- selection and splits


def test_derived_tasks_lie_in_the_split_of_what_they_were_made_from():
    assert base_key("edit_fix:humaneval/HumanEval/12") == "humaneval/HumanEval/12"
    assert base_key("specbench/a:b/c") == "specbench/a:b/c" and base_key("specbench/162") == "specbench/162"
    for key in ("humaneval/HumanEval/0", "humaneval/HumanEval/3", "specbench/84", "specbench/81"):
        for category in edits.DERIVED_CATEGORIES:
            assert split_of(f"{category}:{key}") == split_of(key)
    named = ["edit_types:200", "edit_fix:200", "chat_revise:400"]
    whole = build_tasks(categories=named, count=0)
    calibration = build_tasks(categories=named, count=0, split="calibration")
    report = build_tasks(categories=named, count=0, split="report")
    assert {t.key for t in calibration} | {t.key for t in report} == {t.key for t in whole}
    assert all(split_of(base_key(t.key)) == "calibration" for t in calibration)
    assert all(split_of(base_key(t.key)) == "report" for t in report)
    problems_in = {base_key(t.key) for t in calibration if t.source == "edit"}
    assert len(problems_in) == 40  # the calibration quarter of HumanEval, edited
    assert not problems_in & {base_key(t.key) for t in report}


def test_categories_select_the_edit_workload():
    tasks = build_tasks(categories=["edit_fix:2", "edit_rename:2"], count=5)
    assert [t.category for t in tasks] == ["edit_fix", "edit_rename", "edit_fix", "edit_rename"]
    mixed = build_tasks(categories=["translation:1", "chat_revise:1", "edit_comprehension"], count=2, humaneval=1)
    categories = ["chat_revise", "edit_comprehension", "edit_comprehension", "humaneval", "translation"]
    assert sorted(t.category for t in mixed) == categories
    assert not any(t.source in ("edit", "revise") for t in build_tasks(count=1))  # named only, never by default
    with pytest.raises(ViasdError, match=r"unknown category edit_fx; available: .*edit_fix.*chat_revise"):
        build_tasks(categories=["edit_fx"], count=1)


def test_the_command_refuses_an_unknown_category_in_one_line(tmp_path):
    from viasd.cli import app

    result = CliRunner().invoke(app, ["bench", "--categories", "edit_fix:1,edit_fx", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "unknown category edit_fx" in result.output
    assert not (tmp_path / "r").exists()


def test_code_budget_covers_the_edits_in_the_run():
    from viasd.bench.command import parse_category_budgets

    budgets = parse_category_budgets("edit_rename=100", 300, ["edit_fix", "edit_rename", "qa"])
    assert budgets == {"edit_rename": 100, "humaneval": 300, "edit_fix": 300}


def test_edited_code_is_python(problems):
    for task in _sample(edits.edit_tasks(problems.values()), 40):
        ast.parse(task.extra["given"])


@pytest.mark.real  # about 25 s of sandboxed runs: with the slow tests, not the fast suite
def test_every_injected_bug_fails_its_tests(problems):
    tasks = edits.edit_tasks(problems.values(), ["edit_fix"])
    assert [t.key for t in tasks if _tests_pass(t.extra["given"], t)] == []
