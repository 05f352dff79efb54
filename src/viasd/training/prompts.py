"""Where the training conversations start: the opening words of a user's request, and local code to ask about.

The target writes the rest of each request itself (Magpie-style: its chat template up to the user's turn, then
these few words), then answers it. The openers spread the requests over the kinds of work people bring (code,
translation, summaries, questions, maths, passages to answer from, writing, role play); one in ten asks about a
short function of Python's own standard library, local text that needs no download (long openings cost a prompt
pass each on a CPU, so they are kept short). Nothing here comes from the benchmark's tasks.
"""

from __future__ import annotations

import ast
import random
import sys
from dataclasses import dataclass
from pathlib import Path

OPENERS: tuple[str, ...] = (
    "Write a Python function that",
    "Write a function in JavaScript that",
    "Implement a class in Python that",
    "How do I",
    "Write a SQL query that",
    "Write a bash script that",
    "What is the difference between",
    "Fix the bug in this code:\n```python\n",
    "Write unit tests with pytest for a function that",
    "Explain how",
    "Translate the following sentence into English:",
    "Translate into French:",
    "Translate this German text into English:",
    "Translate the following paragraph into Spanish:",
    "Summarize the following article in three sentences:\n\n",
    "Summarize this news report:\n\n",
    "Give a one-paragraph summary of the following text:\n\n",
    "Answer the question using the passage below.\n\nPassage:",
    "Read the following document and answer the question at the end.\n\n",
    "Based on the context below, answer briefly.\n\nContext:",
    "Solve this problem step by step:",
    "A store sells",
    "If a train travels",
    "Calculate",
    "Prove that",
    "What is",
    "Why does",
    "Who was",
    "When did",
    "Name three",
    "Write a short story about",
    "Write an email to",
    "Write a poem about",
    "Give me tips for",
    "Compose a blog post about",
    "Pretend you are",
    "Imagine you are",
    "Describe",
    "Compare",
    "Extract the names and dates from the following text:\n\n",
    "List the steps to",
    "What are the pros and cons of",
    "Explain to a beginner",
    "Rewrite the following sentence to be more formal:",
    "In physics,",
    "In economics,",
    "In history,",
)

CODE_TASKS: tuple[str, ...] = (
    "Explain what this function does:",
    "Add type hints and a docstring to this function:",
    "Write pytest unit tests for this function:",
    "Can this function be made simpler? Rewrite it:",
    "Find possible bugs in this code:",
    "Summarize what this code does in two sentences:",
)


@dataclass(frozen=True)
class Opener:
    """The start of a user's request: text the target continues (`complete`) or a whole request (not `complete`)."""

    text: str
    complete: bool


def stdlib_functions(limit_lines: int = 12) -> list[str]:
    """Sources of short top-level functions of Python's standard library (local text, in every installation)."""
    root = Path(sys.modules["ast"].__file__ or "").parent
    found: list[str] = []
    for path in sorted(root.glob("*.py")):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None:
                length = node.end_lineno - node.lineno + 1
                if 4 <= length <= limit_lines:
                    found.append("\n".join(lines[node.lineno - 1 : node.end_lineno]))
    return found


def openers(count: int, seed: int, functions: list[str] | None = None) -> list[Opener]:
    """`count` openers drawn with `seed`: nine in ten from OPENERS, one in ten a request about local code."""
    rng = random.Random(seed)
    code = functions if functions is not None else stdlib_functions()
    chosen = []
    for _ in range(count):
        if code and rng.random() < 0.1:
            task = rng.choice(CODE_TASKS)
            chosen.append(Opener(f"{task}\n```python\n{rng.choice(code)}\n```", complete=True))
        else:
            chosen.append(Opener(rng.choice(OPENERS), complete=False))
    return chosen


def task_openers(questions: str | Path | None = None) -> list[Opener]:
    """Whole requests from the benchmark's calibration split (bench/splits.py): each Spec-Bench question's first turn
    and each HumanEval problem's, in the kinds and lengths people bring (articles to summarise, passages to answer
    from), which the target's own short requests lack. The report split is never read."""
    from viasd.bench.tasks import build_tasks

    tasks = build_tasks(questions, count=None, humaneval=164, split="calibration")
    return [Opener(task.turns[0], complete=True) for task in tasks]
