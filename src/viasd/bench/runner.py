"""Running the benchmark: every method on every task, interleaved per task, one result row at a time.

For each task every method runs in turn, the order rotated from one task to the next, so a machine that
speeds up or slows down during the run affects every method alike. Each finished (task, method) pair is
appended to the results file and flushed at once; a resumed run skips the pairs already there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from viasd.bench.memory import PeakMemory
from viasd.bench.metrics import QUALITY_METRICS, combine_stats, text_score
from viasd.bench.sandbox import check_humaneval
from viasd.bench.tasks import HUMANEVAL_CATEGORY, Task
from viasd.decode.base import Decoder, GenerationConfig, GenerationResult
from viasd.errors import ViasdError
from viasd.prompting import Message, encode_messages, encode_text
from viasd.verify.sampling import SamplingParams

WARMUP_TOKENS = 16


@dataclass
class RunSettings:
    """How every generation of a run is made."""

    methods: Sequence[str]
    max_new_tokens: int = 128
    # HumanEval answers are whole functions: they may get a larger budget than prose turns (None: the same).
    code_max_new_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    chat: bool = True
    warmup: bool = True
    humaneval_timeout: float = 10.0

    def budget(self, task: Task) -> int:
        """Token budget per turn of `task`."""
        if task.category == HUMANEVAL_CATEGORY and self.code_max_new_tokens is not None:
            return self.code_max_new_tokens
        return self.max_new_tokens


def rotation(methods: Sequence[str], index: int) -> list[str]:
    """The method order for the task at `index`: the list rotated by `index` places."""
    if not methods:
        return []
    shift = index % len(methods)
    return [*methods[shift:], *methods[:shift]]


# ------------------------------------------------------------------------------------- results file


def read_rows(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """Rows of a results file and the byte length of its intact part (a torn last line is left out)."""
    file = Path(path)
    if not file.exists():
        return [], 0
    data = file.read_bytes()
    rows: list[dict[str, Any]] = []
    good = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
        good += len(line)
    return rows, good


class ResultsFile:
    """An append-only JSONL file of result rows, flushed to disk row by row."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def load(self) -> list[dict[str, Any]]:
        """The rows already written; a torn last line (an interrupted write) is cut off the file."""
        rows, good = read_rows(self.path)
        if self.path.exists() and self.path.stat().st_size != good:
            with self.path.open("r+b") as handle:
                handle.truncate(good)
        return rows

    def append(self, row: Mapping[str, Any]) -> None:
        line = json.dumps(row, ensure_ascii=False) + "\n"
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())


# ---------------------------------------------------------------------------------------- one task


def turn_prompt(
    tokenizer: PreTrainedTokenizerBase, task: Task, answers: Sequence[str], turn: int, chat: bool
) -> list[int]:
    """Prompt ids for `turn`: earlier turns with this method's own answers, then the turn, then the task's prefix."""
    messages: list[Message] = []
    for i in range(turn):
        messages.append({"role": "user", "content": task.turns[i]})
        messages.append({"role": "assistant", "content": task.prefix + answers[i]})
    messages.append({"role": "user", "content": task.turns[turn]})
    ids = encode_messages(tokenizer, messages, chat=chat)
    if task.prefix:
        ids += encode_text(tokenizer, task.prefix)
    return ids


def score_task(task: Task, texts: Sequence[str], timeout: float) -> dict[str, Any] | None:
    """The task metric of each turn's answer ({"metric", "scores"}), or None when the task has none."""
    if task.source == "humaneval":
        result = check_humaneval(task.extra, texts[0], timeout=timeout)
        return {"metric": "pass@1", "scores": [float(result.passed)], "detail": result.status, "why": result.detail}
    metric = QUALITY_METRICS.get(task.category)
    if metric is None:
        return None
    scores = [text_score(metric, text, task.reference(i)) for i, text in enumerate(texts)]
    if all(s is None for s in scores):
        return None
    return {"metric": metric, "scores": scores}


def run_task(
    decoder: Decoder,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    method: str,
    settings: RunSettings,
    memory: PeakMemory | None = None,
) -> dict[str, Any]:
    """Answer every turn of `task` with one method (its own answers carried over) and return the result row."""
    config = GenerationConfig(max_new_tokens=settings.budget(task), sampling=settings.sampling, stop_strings=task.stop)
    row: dict[str, Any] = {
        "key": task.key,
        "source": task.source,
        "category": task.category,
        "method": method,
        "references": list(task.references),
    }
    answers: list[str] = []
    results: list[GenerationResult] = []
    if memory is not None:
        memory.reset()
    try:
        for turn in range(len(task.turns)):
            ids = turn_prompt(tokenizer, task, answers, turn, settings.chat)
            result = decoder.generate(ids, config)
            results.append(result)
            answers.append(result.text)
    except ViasdError as error:
        row.update(error=str(error), turns=[], stats={})
        return row
    if memory is not None:
        row.update(memory.read())
    row["turns"] = [
        {"text": r.text, "tokens": r.tokens, "finish_reason": r.finish_reason, "stats": r.stats.to_dict()}
        for r in results
    ]
    row["stats"] = combine_stats([r.stats for r in results], method).to_dict()
    row["quality"] = score_task(task, answers, settings.humaneval_timeout)
    return row


# -------------------------------------------------------------------------------------- the whole run


def warm_up(decoder: Decoder, tokenizer: PreTrainedTokenizerBase, task: Task, settings: RunSettings) -> None:
    """One short untimed generation, so one-time costs (allocations, kernel choice) stay out of the numbers."""
    ids = turn_prompt(tokenizer, task, [], 0, settings.chat)
    tokens = min(WARMUP_TOKENS, settings.max_new_tokens)
    decoder.generate(ids, GenerationConfig(max_new_tokens=tokens, sampling=settings.sampling))


def pending_pairs(
    tasks: Sequence[Task], methods: Sequence[str], done: Iterable[tuple[str, str]]
) -> list[tuple[int, Task, str]]:
    """(task index, task, method) still to run, in run order: per task, the methods rotated by the index."""
    finished = set(done)
    return [
        (i, task, method)
        for i, task in enumerate(tasks)
        for method in rotation(methods, i)
        if (task.key, method) not in finished
    ]


def run_benchmark(
    tasks: Sequence[Task],
    decoder_for: Callable[[str], Decoder],
    tokenizer: PreTrainedTokenizerBase,
    settings: RunSettings,
    results: ResultsFile,
    memory: PeakMemory | None = None,
    on_start: Callable[[Task, str], None] | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every pending (task, method) pair, appending each row to `results`; returns all rows of the file.

    Every method's decoder is built (and warmed up) before the first timed generation, so a method that
    cannot run here (a missing profile, a drafter that does not fit) fails before any time is spent.
    """
    rows = results.load()
    todo = pending_pairs(tasks, settings.methods, ((r["key"], r["method"]) for r in rows))
    if not todo:
        return rows
    needed = list(dict.fromkeys(method for _, _, method in todo))
    decoders = {method: decoder_for(method) for method in needed}
    if settings.warmup:
        shortest = min((task for _, task, _ in todo), key=lambda t: len(t.turns[0]))
        for method in needed:
            if on_start is not None:
                on_start(shortest, f"{method} (warm-up)")
            warm_up(decoders[method], tokenizer, shortest, settings)
    for index, task, method in todo:
        if on_start is not None:
            on_start(task, method)
        row = run_task(decoders[method], tokenizer, task, method, settings, memory)
        row["task_index"] = index
        row["position"] = rotation(settings.methods, index).index(method)
        results.append(row)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows
