"""The calibration prompts of one task kind: the calibration split of the benchmark's tasks of that kind (never the
split it reports on), encoded as the benchmark encodes them, so that a per-kind round policy is selected on the
prompts it will route."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from viasd.bench.runner import turn_prompt
from viasd.bench.splits import keep
from viasd.bench.tasks import Task, load_humaneval, load_specbench, spread
from viasd.task_kind import CODE, PROSE, prompt_kind


def kind_tasks(kind: str, count: int | None) -> tuple[list[Task], str]:
    """`count` tasks (None: all) of the calibration split that are of `kind`, and where they come from: HumanEval's
    for code, the Spec-Bench development questions whose first turn reads as prose for prose."""
    if kind == CODE:
        tasks, source = keep(load_humaneval(), _key, "calibration"), "HumanEval, calibration split"
    else:
        questions = keep(load_specbench(), _key, "calibration")
        tasks = [t for t in questions if prompt_kind(t.turns[0]) == PROSE]
        source = "Spec-Bench development questions read as prose, calibration split"
    chosen = spread(tasks, count)
    return chosen, f"{source}: {len(chosen)} of {len(tasks)} tasks"


def kind_prompts(tokenizer: PreTrainedTokenizerBase, kind: str, count: int | None) -> tuple[list[list[int]], str]:
    """The prompt ids of `kind_tasks` (first turns, with a task's answer prefix), and where they come from."""
    tasks, source = kind_tasks(kind, count)
    return [turn_prompt(tokenizer, task, [], 0, chat=True) for task in tasks], source


def _key(task: Task) -> str:
    return task.key
