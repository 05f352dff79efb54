"""Task kinds read from prompts: code is recognised from source lines and requests for code; the reading errs towards
code (a prose prompt read as code costs speed only); the kinds a user may name are checked at the edge."""

from __future__ import annotations

import pytest

from viasd.bench.tasks import load_humaneval, load_specbench
from viasd.errors import ViasdError
from viasd.task_kind import CODE, PROSE, parse_kind, prompt_kind


@pytest.mark.parametrize(
    "prompt",
    [
        "Write a Python function that merges two sorted lists.",
        "Implement a stack class in Python with push, pop, peek and is_empty methods.",
        "Write a SQL query that lists the ten customers with the highest total order amount.",
        "Why does this fail?\n\nimport os\nprint(os.getcwd(",
        "Fix the bug:\n```\nfor i in range(10) print(i)\n```",
        "#include <stdio.h>\nint main() { return 0; }",
    ],
)
def test_code_prompts_read_as_code(prompt: str) -> None:
    assert prompt_kind(prompt) == CODE


@pytest.mark.parametrize(
    "prompt",
    [
        "Translate into French: The library opens at nine in the morning and closes at six.",
        "Summarize in two sentences: the printing press made books cheaper.",
        "What causes the seasons on Earth? Answer in a short paragraph.",
        "A train travels 180 km in 2.5 hours. What is its average speed?",
    ],
)
def test_prose_prompts_read_as_prose(prompt: str) -> None:
    assert prompt_kind(prompt) == PROSE


def test_every_humaneval_problem_reads_as_code_and_most_benchmark_prose_as_prose() -> None:
    assert {prompt_kind(task.turns[0]) for task in load_humaneval()} == {CODE}
    prose = [t for t in load_specbench() if t.category in ("translation", "summarization", "qa", "math_reasoning")]
    assert sum(prompt_kind(t.turns[0]) == PROSE for t in prose) >= 0.95 * len(prose)


def test_a_request_word_in_the_middle_of_a_long_document_does_not_make_it_code() -> None:
    story = "The council met again. " * 40 + "The new program for schools was approved. " + "It rained. " * 40
    assert prompt_kind("Summarize: " + story) == PROSE
    assert prompt_kind(story + "Write a Python script that counts the words above.") == CODE


def test_kinds_are_parsed_at_the_edge() -> None:
    assert parse_kind("auto") is None and parse_kind("code") == CODE and parse_kind("prose") == PROSE
    with pytest.raises(ViasdError, match="unknown task kind 'sql'; choose one of auto, code, prose"):
        parse_kind("sql")
