"""Faults injected into `viasd bench`: damaged results files, bad inputs, prompts longer than the context, and
model-written programs that exit early, forge a pass, flood their output or leave processes behind.

Each test injects one fault and checks that nothing is lost, no wrong answer is given silently, and nothing
crashes: a damaged line is reported and skipped or the command stops with one line and exit code 2.
"""

from __future__ import annotations

import json
import time
import tracemalloc
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tiny import tiny_tokenizer
from viasd.bench.isolation import find_bubblewrap
from viasd.bench.runner import ResultsFile, RunSettings, read_rows, run_benchmark
from viasd.bench.sandbox import Capture, SandboxWarning, check_humaneval, run_program
from viasd.bench.tasks import Task, load_specbench
from viasd.cli import app
from viasd.decode.base import Decoder
from viasd.errors import ViasdError

HAS_BWRAP = find_bubblewrap()[0] is not None
# Every sandbox fault is injected under bubblewrap (where it works) and under the guard alone with the reaper.
MODES = [
    pytest.param(True, id="bubblewrap", marks=pytest.mark.skipif(not HAS_BWRAP, reason="no working bubblewrap")),
    pytest.param(False, id="guard-only"),
]


def _row(key: str, method: str, tps: float = 10.0) -> dict:
    stats = {"new_tokens": 2, "total_seconds": 2 / tps, "tokens_per_second": tps, "target_calls": 2}
    return {"key": key, "method": method, "category": "qa", "stats": stats, "turns": [{"text": "a b", "tokens": [3]}]}


def _lines(rows: list[dict]) -> list[bytes]:
    return [json.dumps(r).encode() + b"\n" for r in rows]


# ------------------------------------------------------------------------------------------ results file


def test_a_damaged_line_in_the_middle_loses_no_later_row_and_the_file_is_not_touched(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    rows = [_row(f"q/{i}", "plain") for i in range(5)]
    lines = _lines(rows)
    lines[1] = b'{"key": "q/1", "method": "pl\x00 garbage\n'
    path.write_bytes(b"".join(lines))
    before = path.read_bytes()
    seen = []
    results = ResultsFile(path, on_damage=seen.append)
    assert [r["key"] for r in results.load()] == ["q/0", "q/2", "q/3", "q/4"]
    assert [str(d) for d in seen] == [f"{path}:2: not JSON"]
    assert [r["key"] for r in results.load()] == ["q/0", "q/2", "q/3", "q/4"]
    assert len(seen) == 1  # reported once
    assert path.read_bytes() == before  # reading never rewrites the file


def test_json_that_is_not_a_result_row_is_reported_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    good = _row("q/0", "plain")
    no_stats = {k: v for k, v in good.items() if k != "stats"}
    bad_stats = {**good, "stats": {"new_tokens": 2}}
    bad_turns = {**good, "turns": "text"}
    lines = [b"[1, 2]\n", json.dumps(no_stats).encode() + b"\n", b"\xff\xfe not utf-8\n", b"\n"]
    lines += [json.dumps(bad_stats).encode() + b"\n", json.dumps(bad_turns).encode() + b"\n", b'"a row"\n']
    lines += [b"[" * 100_000 + b"\n", *_lines([{**good, "quality": [1]}, {**good, "references": 3}, good])]
    path.write_bytes(b"".join(lines))
    rows, damaged = read_rows(path)
    assert rows == [good]
    assert [d.line for d in damaged] == [1, 2, 3, 5, 6, 7, 8, 9, 10]  # line 4 is blank
    assert "not a JSON object" in damaged[0].reason and "'stats'" in damaged[1].reason
    assert damaged[2].reason == "not JSON" and "tokens_per_second" in damaged[3].reason
    assert "'turns'" in damaged[4].reason and "'quality'" in damaged[7].reason and "'references'" in damaged[8].reason
    error_row = {"key": "q/1", "method": "plain", "category": "qa", "error": "too long", "stats": {}, "turns": []}
    path.write_bytes(b"".join(_lines([error_row])))
    assert read_rows(path) == ([error_row], [])  # an error row is a row


def test_appending_after_a_torn_last_line_starts_a_new_line(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    path.write_bytes(b"".join(_lines([_row("q/0", "plain")])) + b'{"key": "q/1", "meth')
    seen = []
    results = ResultsFile(path, on_damage=seen.append)
    assert len(results.load()) == 1
    results.append(_row("q/1", "plain"))
    assert [r["key"] for r in results.load()] == ["q/0", "q/1"]  # the new row is not glued onto the torn one
    assert len(seen) == 1 and seen[0].line == 2 and "torn" in seen[0].reason
    # A last line cut just before its newline is a whole row: kept, and the next row still starts its own line.
    path.write_bytes(json.dumps(_row("q/0", "plain")).encode())
    results = ResultsFile(path, on_damage=seen.append)
    results.append(_row("q/1", "plain"))
    assert [r["key"] for r in results.load()] == ["q/0", "q/1"] and len(seen) == 1


class CountingDecoder(Decoder):
    """Answers with fixed tokens, counting its prompts; `context_limit` is the model's context in tokens."""

    method = "fake"

    def __init__(self, tokenizer, context_limit: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = frozenset()
        self.context_limit = context_limit
        self.view = None
        self.prompts: list[list[int]] = []

    def _decode(self, prompt, sink, params, stats) -> None:
        self.prompts.append(prompt)
        sink.push([5, 6])
        stats.target_calls = 1


def test_resume_runs_again_only_the_pairs_of_damaged_lines(tmp_path: Path) -> None:
    tok = tiny_tokenizer(64)
    tasks = [Task(f"q/{i}", "specbench", "qa", (f"t{3 + i} t9",)) for i in range(3)]
    settings = RunSettings(methods=["a", "b"], max_new_tokens=2, chat=False, warmup=False)
    decoder = CountingDecoder(tok)
    path = tmp_path / "results.jsonl"
    run_benchmark(tasks, lambda m: decoder, tok, settings, ResultsFile(path, on_damage=None))
    lines = path.read_bytes().splitlines(keepends=True)
    assert len(lines) == 6
    damaged = json.loads(lines[2])
    lines[2] = b"{oops\n"
    path.write_bytes(b"".join(lines))
    decoder.prompts.clear()
    seen = []
    rows = run_benchmark(tasks, lambda m: decoder, tok, settings, ResultsFile(path, on_damage=seen.append))
    assert len(decoder.prompts) == 1  # only the damaged pair ran again
    assert sorted((r["key"], r["method"]) for r in rows) == sorted((t.key, m) for t in tasks for m in ("a", "b"))
    assert (rows[-1]["key"], rows[-1]["method"]) == (damaged["key"], damaged["method"])
    assert [d.line for d in seen] == [3]
    assert path.read_bytes().splitlines()[2] == b"{oops"  # the damaged line is kept as it was


def _run_dir(tmp_path: Path, rows: list[dict], damage: int | None) -> Path:
    """A finished run of 2 tasks x 2 methods, its results file holding `rows` with line `damage` (0-based) spoilt."""
    out = tmp_path / "run"
    out.mkdir()
    env = {"settings": {"methods": ["plain", "sd"], "tasks": 2}, "models": {}, "date": "2026-01-01"}
    (out / "environment.json").write_text(json.dumps(env))
    lines = _lines(rows)
    if damage is not None:
        lines[damage] = lines[damage][: len(lines[damage]) // 2] + b"\n"
    (out / "results.jsonl").write_bytes(b"".join(lines))
    return out


def test_report_and_compare_refuse_a_damaged_line_that_hides_a_row(tmp_path: Path) -> None:
    rows = [_row("q/0", "plain", 10.0), _row("q/0", "sd", 20.0), _row("q/1", "plain", 10.0), _row("q/1", "sd", 5.0)]
    out = _run_dir(tmp_path, rows, damage=3)
    before = (out / "results.jsonl").read_bytes()
    runner = CliRunner()
    for args in (["--report-only"], ["--compare", "sd,plain"]):
        result = runner.invoke(app, ["bench", "--out", str(out), *args])
        assert result.exit_code == 2, result.output
        assert f"{out / 'results.jsonl'}:4: not JSON" in result.output and "--resume" in result.output
        assert len(result.output.strip().splitlines()) == 1 and not isinstance(result.exception, ValueError)
    assert (out / "results.jsonl").read_bytes() == before and not (out / "summary.md").exists()
    # --resume ran the pair again (appended after the damaged line): nothing is missing, so both now work.
    with (out / "results.jsonl").open("ab") as handle:
        handle.write(_lines([rows[3]])[0])
    report = runner.invoke(app, ["bench", "--out", str(out), "--report-only"])
    assert report.exit_code == 0, report.output
    assert f"warning: {out / 'results.jsonl'}:4: not JSON; skipped" in report.output
    assert "- tasks: 2, methods: plain, sd" in (out / "summary.md").read_text()
    compared = runner.invoke(app, ["bench", "--out", str(out), "--compare", "sd,plain"])
    assert compared.exit_code == 0 and "over 2 tasks" in compared.output, compared.output


# ------------------------------------------------------------------------------------------------ inputs


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"settings": {"seed": ' + b"1" * 5000 + b"}}", "an integer longer than 4300 digits"),
        (b'{"settings": ' + b"[" * 100_000, "JSON nested deeper than the parser can read"),
        (b'{"settings": ', "not JSON"),
    ],
)
@pytest.mark.parametrize("command", [["--report-only"], ["--resume"]])
def test_a_damaged_environment_record_is_one_line_and_exit_2(
    tmp_path: Path, content: bytes, message: str, command: list[str]
) -> None:
    out = _run_dir(tmp_path, [_row("q/0", "plain")], damage=None)
    (out / "environment.json").write_bytes(content)
    result = CliRunner().invoke(app, ["bench", "--out", str(out), "--methods", "plain", *command])
    assert result.exit_code == 2, result.output
    assert f"{out / 'environment.json'} is damaged ({message}" in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"question_id": 1, "category": "qa", "turns": ["caf\xe9"]}\n', "line 1: not UTF-8 text (byte 0xe9)"),
        (b'{"question_id": 1, "category": "qa", "turns": ["a"]}\n\xff\n', "line 2: not UTF-8 text"),
        (b'{"question_id": 1, "category": ["qa"], "turns": ["a"]}\n', "line 1: 'category' must be"),
        (b'{"question_id": null, "category": "qa", "turns": ["a"]}\n', "line 1: 'question_id' must be"),
        (b'{"question_id": 1, "category": "qa", "turns": ["\\ud800"]}\n', "line 1: 'turns' must be"),
        (b"[" * 100_000 + b"\n", "line 1: JSON nested deeper than the parser can read"),
        (b'{"question_id": ' + b"7" * 5000 + b', "category": "qa", "turns": ["a"]}\n', "line 1: an integer longer"),
        (b'["a question"]\n', "line 1: expected a JSON object"),
    ],
)
def test_a_bad_questions_file_is_one_line_and_exit_2(tmp_path: Path, content: bytes, message: str) -> None:
    questions = tmp_path / "q.jsonl"
    questions.write_bytes(content)
    with pytest.raises(ViasdError, match="line"):
        load_specbench(questions)
    result = CliRunner().invoke(app, ["bench", "--questions", str(questions), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_json_line_separators_inside_strings_do_not_split_a_question(tmp_path: Path) -> None:
    questions = tmp_path / "q.jsonl"
    record = {"question_id": 1, "category": "qa", "turns": ["one\u2028two\x85three"]}
    questions.write_text(json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")
    assert load_specbench(questions)[0].turns == ("one\u2028two\x85three",)


def test_a_resumed_run_whose_shortest_prompt_does_not_fit_records_an_error_row(tmp_path: Path) -> None:
    tok = tiny_tokenizer(64)
    short = Task("q/short", "specbench", "qa", ("t3 t4",))
    # Few characters but many tokens, and many characters but few tokens (unknown words are one token each).
    long = Task("q/long", "specbench", "qa", ("t3 t4 t5 t6 t7",))
    wordy = Task("q/wordy", "specbench", "qa", ("t3 " + "x" * 40,))
    settings = RunSettings(methods=["a"], max_new_tokens=2, chat=False)
    path = tmp_path / "results.jsonl"
    ResultsFile(path).append({**_row("q/short", "a"), "task_index": 0, "position": 0})
    decoder = CountingDecoder(tok, context_limit=4)
    rows = run_benchmark([short, long], lambda m: decoder, tok, settings, ResultsFile(path))
    assert decoder.prompts == []  # no warm-up: no pending prompt fits
    assert rows[-1]["key"] == "q/long" and "the model's context holds 4" in rows[-1]["error"]
    assert run_benchmark([short, long], lambda m: decoder, tok, settings, ResultsFile(path)) == rows  # not again
    # The warm-up takes the prompt that is shortest in tokens (and fits), not the one shortest in characters.
    fresh = ResultsFile(tmp_path / "fresh.jsonl")
    rows = run_benchmark([long, wordy], lambda m: decoder, tok, settings, fresh)
    assert decoder.prompts == [[3, 0], [3, 0]]  # the warm-up, then the task
    assert [(r["key"], bool(r.get("error"))) for r in rows] == [("q/long", True), ("q/wordy", False)]


# ----------------------------------------------------------------------------------------------- sandbox


PROBLEM = {
    "prompt": 'def add(a, b):\n    """Sum of a and b."""\n',
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
}
EARLY_EXITS = {
    "os._exit before the tests": "    import os\n    os._exit(0)\n",
    "sys.exit from a module-level line": "    return a - b\nimport sys\nsys.exit(0)\n",
    "an atexit hook that hides a failure": "    import atexit, os\n    atexit.register(os._exit, 0)\n    return 0\n",
    "an atexit hook at module level": "    return a - b\nimport atexit, os\natexit.register(lambda: os._exit(0))\n",
    "a forged marker": "    import os\n    print('PASSED')\n    print('0' * 32, flush=True)\n    os._exit(0)\n",
    "a marker searched for in its files and environment": (
        "    import os, re\n    for name in os.listdir('.'):\n"
        "        print(*re.findall('[0-9a-f]{32}', open(name).read()), sep='\\n')\n"
        "    print(*os.environ.values(), sep='\\n', flush=True)\n    os._exit(0)\n"
    ),
    "a thread that exits for the process": (
        "    import os, threading\n    threading.Thread(target=os._exit, args=(0,)).start()\n"
        "    import time\n    time.sleep(5)\n"
    ),
}


@pytest.mark.parametrize("isolate", MODES)
@pytest.mark.parametrize("name", list(EARLY_EXITS))
def test_exiting_before_the_tests_end_is_not_a_pass(name: str, isolate: bool) -> None:
    result = check_humaneval(PROBLEM, EARLY_EXITS[name], timeout=10.0, isolate=isolate)
    assert not result.passed, (name, result)
    assert result.status == "failed", result


@pytest.mark.parametrize("isolate", MODES)
def test_programs_that_run_to_their_end_pass(isolate: bool) -> None:
    assert check_humaneval(PROBLEM, "    return a + b\n", isolate=isolate).passed
    chatty = "    print('result', a + b)\n    import sys\n    print('note', file=sys.stderr)\n    return a + b\n"
    assert check_humaneval(PROBLEM, chatty, isolate=isolate).passed
    wrong = check_humaneval(PROBLEM, "    return a - b\n", isolate=isolate)
    assert wrong.status == "failed" and "AssertionError" in wrong.detail


def test_the_capture_keeps_head_and_tail() -> None:
    capture = Capture(limit=100)
    capture.feed(b"a" * 1000 + b"NON")
    capture.feed(b"CE-12")
    capture.feed(b"34" + b"z" * 1000 + b"\nlast line\n")
    assert len(capture.head) + len(capture.tail) == 100
    assert capture.dropped == 1000 + 10 + 1000 + 11 - 100
    assert capture.text().startswith("a" * 50) and capture.text().endswith("last line\n")


FLOOD = "import sys\nchunk = b'x' * (1 << 20)\nfor _ in range(300):\n    sys.{stream}.buffer.write(chunk)\n"


@pytest.mark.parametrize("isolate", MODES)
@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_300_mb_of_output_neither_grows_memory_nor_hides_the_result(stream: str, isolate: bool) -> None:
    program = FLOOD.format(stream=stream) + "assert 1 + 1 == 2\n"
    tracemalloc.start()
    try:
        result = run_program(program, timeout=60.0, isolate=isolate)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.passed, result
    assert peak < 4 << 20, f"{peak / 2**20:.0f} MiB held for 300 MB of {stream}"
    failing = run_program(FLOOD.format(stream=stream) + "raise ValueError('the end')\n", timeout=60.0, isolate=isolate)
    assert failing.status == "failed" and failing.detail == "ValueError: the end"


# A program that resets the guard, then leaves a grandchild in a session of its own that writes a file later.
LEAVE_A_GRANDCHILD = """
import __main__
__main__._BLOCKED = ()
__main__._inside = lambda path: True
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        quiet = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):  # let go of the harness's pipes, so that it returns while this lives on
            os.dup2(quiet, fd)
        time.sleep(3)
        open({path!r}, "w").write("outlived the run")
        os._exit(0)
    os._exit(0)
os.wait()
if {wait}:
    time.sleep(60)
"""


@pytest.mark.parametrize("wait", [True, False], ids=["timed-out", "finished"])
def test_without_bubblewrap_a_setsid_grandchild_does_not_outlive_the_run(tmp_path: Path, wait: bool) -> None:
    """Killing the process group misses a new session; the reaper (a child subreaper) ends it all the same."""
    late = tmp_path / "late.txt"
    start = time.monotonic()
    result = run_program(LEAVE_A_GRANDCHILD.format(path=str(late), wait=wait), timeout=1.5, isolate=False)
    assert result.status == ("timed out" if wait else "passed"), result
    time.sleep(max(0.0, start + 5.0 - time.monotonic()))  # well past the moment the grandchild would write
    assert not late.exists(), "a process the program started outlived the run"


def test_without_bubblewrap_the_bench_refuses_code_unless_allowed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("viasd.bench.sandbox.find_bubblewrap", lambda: (None, "bubblewrap (bwrap) is not installed"))
    monkeypatch.setattr("viasd.bench.isolation.find_bubblewrap", lambda: (None, "bubblewrap (bwrap) is not installed"))

    def no_model(*args, **kwargs):
        raise ViasdError("would load a model now")

    monkeypatch.setattr("viasd.engine.load_model", no_model)
    args = ["bench", "--count", "0", "--humaneval", "1", "--methods", "plain", "--out", str(tmp_path / "run")]
    runner = CliRunner()
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2, refused.output
    assert len(refused.output.strip().splitlines()) == 1
    assert "apt-get install bubblewrap" in refused.output and "--allow-unsandboxed-code" in refused.output
    assert not (tmp_path / "run").exists()
    allowed = runner.invoke(app, [*args, "--allow-unsandboxed-code"])
    assert allowed.exit_code == 2 and "would load a model now" in allowed.output, allowed.output
    # Prose-only runs run no code: no sandbox needed.
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": 1, "category": "qa", "turns": ["a"]}\n')
    prose = runner.invoke(app, ["bench", "--questions", str(questions), "--count", "1", "--out", str(tmp_path / "p")])
    assert prose.exit_code == 2 and "would load a model now" in prose.output, prose.output
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert check_humaneval(PROBLEM, "    return a + b\n", isolate=None).passed
    assert [w.category for w in caught] == [SandboxWarning]
