"""Running the benchmark: every method on every task, interleaved per task, one result row at a time.

For each task every method runs in turn, the order rotated from one task to the next, so a machine that
speeds up or slows down during the run affects every method alike. Each finished (task, method) pair is
appended to the results file and flushed at once; a resumed run skips the pairs already there.

Nothing is timed before the run has warmed up (`warm_up_run`): every kernel built and checked, and every method's
first passes run on the longest and the shortest of its pending prompts, so that one-time costs (a kernel's build
and check, the first pass of each length's route) land on no task, the first one least of all.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from viasd.bench.edits import EDIT_METRIC, EDIT_SOURCE, REVISE_METRIC, REVISE_SOURCE, check_edit, revise_copy
from viasd.bench.memory import PeakMemory
from viasd.bench.metrics import QUALITY_METRICS, combine_stats, text_score
from viasd.bench.sandbox import check_humaneval
from viasd.bench.tasks import Task
from viasd.decode.base import Decoder, GenerationConfig, GenerationResult
from viasd.errors import ViasdError
from viasd.jsonio import JSONFault, parse_json
from viasd.prompting import Message, encode_messages, encode_text
from viasd.verify.sampling import SamplingParams

WARMUP_TOKENS = 16


@dataclass
class RunSettings:
    """How every generation of a run is made."""

    methods: Sequence[str]
    max_new_tokens: int = 128
    # Budgets of single categories: a HumanEval answer is a whole function and a worked maths answer a chain
    # of steps, both longer than a short prose turn (a category not named gets max_new_tokens).
    category_max_new_tokens: Mapping[str, int] = field(default_factory=dict)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    chat: bool = True
    warmup: bool = True
    humaneval_timeout: float = 10.0
    # Run HumanEval code under the in-process guard alone where bubblewrap is missing (the user accepted the risk).
    allow_unsandboxed_code: bool = False

    def budget(self, task: Task) -> int:
        """Token budget per turn of `task`."""
        return self.category_max_new_tokens.get(task.category, self.max_new_tokens)


def rotation(methods: Sequence[str], index: int) -> list[str]:
    """The method order for the task at `index`: the list rotated by `index` places."""
    if not methods:
        return []
    shift = index % len(methods)
    return [*methods[shift:], *methods[:shift]]


# ------------------------------------------------------------------------------------- results file


# A row's required fields and their types; a row without an error also needs the statistics the report sums.
ROW_FIELDS: dict[str, type] = {"key": str, "method": str, "category": str, "stats": dict}
STATS_FIELDS = ("new_tokens", "total_seconds", "tokens_per_second", "target_calls")
# Fields the report reads where a row has them, and the types it can read (None: absent or null is fine).
OPTIONAL_FIELDS: dict[str, tuple[type, ...]] = {
    "references": (list,),
    "quality": (dict,),
    "peak_rss_bytes": (int, float),
    "peak_cuda_bytes": (int, float),
}


@dataclass(frozen=True)
class DamagedLine:
    """A line of a results file that holds no result row: where it is and what is wrong with it."""

    path: Path
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


def row_problem(row: Any) -> str | None:
    """Why a parsed JSON value is not a result row (None when it is one): the report needs these fields."""
    if not isinstance(row, dict):
        return "not a result row (not a JSON object)"
    for name, kind in ROW_FIELDS.items():
        if not isinstance(row.get(name), kind):
            return f"not a result row ({name!r} missing or not a {kind.__name__})"
    for name, kinds in OPTIONAL_FIELDS.items():
        value = row.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            return f"not a result row ({name!r} is not a {' or '.join(k.__name__ for k in kinds)})"
    if row.get("quality") is not None and not isinstance(row["quality"].get("scores", []), list):
        return "not a result row ('quality' scores are not a list)"
    if row.get("error"):
        return None if isinstance(row["error"], str) else "not a result row ('error' is not text)"
    turns = row.get("turns")
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return "not a result row ('turns' missing or not a list of objects)"
    stats = row["stats"]
    bad = [k for k in STATS_FIELDS if isinstance(stats.get(k), bool) or not isinstance(stats.get(k), (int, float))]
    if bad:
        return f"not a result row (stats without {', '.join(bad)})"
    return None


def _parse_line(line: bytes) -> tuple[dict[str, Any] | None, str]:
    """One line as a result row, or None and why it is not one."""
    try:
        row = parse_json(line)
    except JSONFault:
        return None, "not JSON" + ("" if line.endswith(b"\n") else " (a torn last line: an interrupted write)")
    problem = row_problem(row)
    return (None, problem) if problem else (row, "")


def read_rows(path: str | Path) -> tuple[list[dict[str, Any]], list[DamagedLine]]:
    """The result rows of a results file and its damaged lines; blank lines are skipped. Never writes the file."""
    file = Path(path)
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        return [], []
    except OSError as error:
        raise ViasdError(f"cannot read {file}: {error.strerror or error}") from None
    rows: list[dict[str, Any]] = []
    damaged: list[DamagedLine] = []
    for number, line in enumerate(data.splitlines(keepends=True), start=1):
        if not line.strip():
            continue
        row, problem = _parse_line(line)
        if row is None:
            damaged.append(DamagedLine(file, number, problem))
        else:
            rows.append(row)
    return rows, damaged


def warn_damaged(line: DamagedLine) -> None:
    """The default report of a damaged line: one line on standard error."""
    print(f"warning: {line}; skipped", file=sys.stderr, flush=True)


class ResultsFile:
    """An append-only JSONL file of result rows, flushed to disk row by row.

    Reading never changes the file: a damaged line (not JSON, or JSON that is not a result row) stays where
    it is, is reported once per ResultsFile through `on_damage`, and is left out of the rows, so a resumed
    run runs its (task, method) pair again. `damaged` holds what the last load found.
    """

    def __init__(self, path: str | Path, on_damage: Callable[[DamagedLine], None] | None = warn_damaged) -> None:
        self.path = Path(path)
        self.on_damage = on_damage
        self.damaged: list[DamagedLine] = []
        self._reported: set[int] = set()

    def load(self) -> list[dict[str, Any]]:
        """The intact rows; each damaged line is reported the first time it is seen."""
        rows, self.damaged = read_rows(self.path)
        for line in self.damaged:
            if line.line not in self._reported and self.on_damage is not None:
                self.on_damage(line)
            self._reported.add(line.line)
        return rows

    def append(self, row: Mapping[str, Any]) -> None:
        """Write one row as a line of its own, after a newline when the file ends in a torn line."""
        line = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
        with self.path.open("ab") as handle:
            if handle.tell() > 0 and not _ends_with_newline(self.path):
                line = b"\n" + line
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())


def _ends_with_newline(path: Path) -> bool:
    """Whether the file's last byte is a newline (an interrupted write leaves a line without one)."""
    with path.open("rb") as handle:
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) == b"\n"


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


def score_task(
    task: Task,
    texts: Sequence[str],
    timeout: float,
    unsandboxed: bool = False,
    finish_reasons: Sequence[str] = (),
) -> dict[str, Any] | None:
    """The task metric of each turn's answer ({"metric", "scores"}), or None when the task has none.

    HumanEval code, and the code of an edit task's answer, runs in bubblewrap, or, with `unsandboxed` where
    bubblewrap is missing, under the guard alone. `finish_reasons`: why each turn ended (a chat_revise answer cut by
    its budget is held to as much of the first answer as it had room for).
    """
    if task.source == "humaneval":
        result = check_humaneval(task.extra, texts[0], timeout=timeout, isolate=None if unsandboxed else True)
        return {"metric": "pass@1", "scores": [float(result.passed)], "detail": result.status, "why": result.detail}
    if task.source == EDIT_SOURCE:
        result = check_edit(task, texts[0], timeout=timeout, isolate=None if unsandboxed else True)
        return {"metric": EDIT_METRIC, "scores": [float(result.passed)], "detail": result.status, "why": result.detail}
    if task.source == REVISE_SOURCE:
        cut = len(finish_reasons) > 1 and finish_reasons[1] == "length"
        score = revise_copy(texts[0], texts[1], task.extra["mark"], second_cut=cut)
        return {"metric": REVISE_METRIC, "scores": [score]}  # one score: the whole chat's
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
    reasons = [r.finish_reason for r in results]
    row["quality"] = score_task(task, answers, settings.humaneval_timeout, settings.allow_unsandboxed_code, reasons)
    return row


# -------------------------------------------------------------------------------------- the whole run


def warm_up(decoder: Decoder, ids: Sequence[int], settings: RunSettings) -> None:
    """One short untimed generation, so one-time costs (allocations, kernel choice) stay out of the numbers."""
    tokens = min(WARMUP_TOKENS, settings.max_new_tokens)
    decoder.generate(ids, GenerationConfig(max_new_tokens=tokens, sampling=settings.sampling))


def warmup_prompts(prompts: Iterable[tuple[Task, list[int]]], limit: int | None) -> list[tuple[Task, list[int]]]:
    """The longest and the shortest in tokens of the (task, first prompt ids) pairs that fit in a context of `limit`
    tokens (one where they are as long): the longest runs the passes of long prompts (their routes, chunks and
    kernels), the shortest those of short ones, so no timed generation is the first of its kind.

    None (an empty list) when no prompt fits: nothing can be timed then, and each such task becomes an error row of
    its own instead of stopping the run (a resumed run would stop at the same warm-up again, for ever).
    """
    fitting = sorted((pair for pair in prompts if limit is None or len(pair[1]) < limit), key=lambda p: len(p[1]))
    if not fitting:
        return []
    longest, shortest = fitting[-1], fitting[0]
    return [longest] if len(longest[1]) == len(shortest[1]) else [longest, shortest]


@dataclass(frozen=True)
class Warmup:
    """What ran before the first timed generation, for the run's record: its seconds, every kernel's state as built
    and checked then, and per method the lengths of the prompts it warmed up on."""

    seconds: float
    kernels: dict[str, str]
    prompts: dict[str, list[int]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def warm_up_run(
    decoders: Mapping[str, Decoder],
    todo: Sequence[tuple[int, Task, str]],
    tokenizer: PreTrainedTokenizerBase,
    settings: RunSettings,
    on_start: Callable[[Task, str], None] | None = None,
) -> Warmup:
    """Before anything is timed: every kernel built and checked (its build, once per machine, and its check, once per
    process, take seconds), then per method an untimed generation on each of its warm-up prompts."""
    from viasd.kernels.state import kernel_states

    began = time.perf_counter()
    kernels = kernel_states()
    first = {task.key: (task, turn_prompt(tokenizer, task, [], 0, settings.chat)) for _, task, _ in todo}
    lengths: dict[str, list[int]] = {}
    for method, decoder in decoders.items():
        chosen = warmup_prompts(
            (first[t.key] for _, t, m in todo if m == method), getattr(decoder, "context_limit", None)
        )
        for task, ids in chosen:
            if on_start is not None:
                on_start(task, f"{method} (warm-up)")
            warm_up(decoder, ids, settings)
        lengths[method] = [len(ids) for _, ids in chosen]
    return Warmup(round(time.perf_counter() - began, 3), kernels, lengths)


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
    on_warmup: Callable[[Warmup], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every pending (task, method) pair, appending each row to `results`; returns all rows of the file.

    Every method's decoder is built (and, with `settings.warmup`, the run warmed up: `warm_up_run`, told to
    `on_warmup`) before the first timed generation, so a method that cannot run here (a missing profile, a drafter
    that does not fit) fails before any time is spent.
    """
    rows = results.load()
    todo = pending_pairs(tasks, settings.methods, ((r["key"], r["method"]) for r in rows))
    if not todo:
        return rows
    needed = list(dict.fromkeys(method for _, _, method in todo))
    decoders = {method: decoder_for(method) for method in needed}
    if settings.warmup:
        warmed = warm_up_run(decoders, todo, tokenizer, settings, on_start)
        if on_warmup is not None:
            on_warmup(warmed)
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
