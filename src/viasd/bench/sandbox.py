"""Running model-written code against HumanEval tests, away from the benchmark process.

Model output is untrusted input. Each program runs in a fresh Python interpreter (isolated mode, clean
environment) in its own temporary directory, in a new session, under resource limits (CPU seconds,
address space, file size, open files), with an in-process guard (`guard.py`) that turns ordinary accidents
into clear failures. Where bubblewrap works (`isolation.py`), the program runs in a sandbox of its own
namespaces: no network, a read-only filesystem but its scratch directory, no view of other processes, and
nothing left alive after the time limit. Where it does not, model-written code is refused unless the caller
accepts the risk (`isolate=None`, `viasd bench --allow-unsandboxed-code`): then the guard alone remains,
which deliberate code can undo, under a reaper (`reaper.py`) that kills whatever the program started, and
the benchmark warns once (a `SandboxWarning`).

A program passes only when it exits with status 0 *and* the guard has reported, on a pipe of its own that is
not the program's output, that the program ran to its end: exiting early, in any way, is a failure, and
nothing the program can read or print stands in for that report (see `guard.py`). Its standard output and
error are read as they come, but only their first and last bytes are kept (MAX_CAPTURE in all).
"""

from __future__ import annotations

import contextlib
import math
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from viasd.bench.guard import DONE, GUARD
from viasd.bench.isolation import SCRATCH, bwrap_command, find_bubblewrap
from viasd.bench.reaper import REAPER
from viasd.errors import ViasdError

_REAP_SECONDS = 5.0
MAX_CAPTURE = 64 << 10  # bytes kept of each of the program's standard output and standard error
_CHUNK = 64 << 10


class SandboxWarning(UserWarning):
    """Model-written code is about to run without OS-level isolation."""


@dataclass(frozen=True)
class ExecutionResult:
    """How a program ended: passed (exit 0 after running to its end), failed (with why) or timed out."""

    passed: bool
    status: str  # "passed", "failed" or "timed out"
    detail: str = ""


def sandbox_refusal(reason: str) -> str:
    """The one-line refusal to run model-written code without a sandbox: how to get one, or how to accept the risk."""
    return (
        f"refusing to run model-written code without a sandbox: {reason}; install bubblewrap "
        "(apt-get install bubblewrap), or pass --allow-unsandboxed-code to run it under an in-process guard "
        "that deliberate code can undo"
    )


def require_sandbox() -> None:
    """Fail at once (a ViasdError) where bubblewrap cannot isolate model-written code, before any work is done."""
    bwrap, reason = find_bubblewrap()
    if bwrap is None:
        raise ViasdError(sandbox_refusal(reason))


class Capture:
    """The first and last bytes of a stream (at most `limit` in all).

    Memory stays bounded whatever the program writes: the middle of a long stream is counted, not kept.
    """

    def __init__(self, limit: int = MAX_CAPTURE) -> None:
        self.limit = limit
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def feed(self, data: bytes) -> None:
        """Take the next chunk of the stream."""
        half = self.limit // 2
        room = max(0, half - len(self.head))
        self.head += data[:room]
        self.tail += data[room:]
        excess = len(self.tail) - (self.limit - half)
        if excess > 0:
            self.dropped += excess
            del self.tail[:excess]

    def text(self) -> str:
        """What was kept, with a note where bytes were left out."""
        gap = f"\n[... {self.dropped} bytes left out ...]\n".encode() if self.dropped else b""
        return bytes(self.head + gap + self.tail).decode("utf-8", "replace")


def humaneval_program(problem: Mapping[str, Any], completion: str) -> str:
    """The program HumanEval runs for a completion: prompt + completion + tests + check(entry point)."""
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def _limits(cpu_seconds: int, memory_bytes: int, file_bytes: int) -> None:
    """Resource limits for the child, set between fork and exec (bubblewrap and the program inherit them)."""
    import resource

    for limit, value in (
        (resource.RLIMIT_CPU, cpu_seconds),
        (resource.RLIMIT_AS, memory_bytes),
        (resource.RLIMIT_FSIZE, file_bytes),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
    ):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(limit, (value, value))


def _command(tmp: str, isolate: bool | None, report: int) -> tuple[list[str], dict[str, str], bool]:
    """The command that runs guard.py on solution.py in `tmp`, reporting on descriptor `report`, its environment,
    and whether a reaper leads it."""
    bwrap, reason = find_bubblewrap()
    guard = ["guard.py", "solution.py", str(report)]
    if isolate is not False and bwrap is not None:
        argv = [sys.executable, "-I", "-B", *guard]
        env = {"PATH": "/usr/bin:/bin", "HOME": SCRATCH, "TMPDIR": SCRATCH, "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}
        return bwrap_command(bwrap, tmp, argv, env), {"PATH": "/usr/bin:/bin"}, False
    if isolate:
        raise ViasdError(sandbox_refusal(reason))
    if isolate is None:
        warnings.warn(
            f"HumanEval code runs without OS-level isolation: {reason}. Only an in-process guard, which "
            "deliberate code can undo, stands between it and this machine; install bubblewrap "
            "(e.g. apt-get install bubblewrap) to run it in a sandbox",
            SandboxWarning,
            stacklevel=3,
        )
    argv = [sys.executable, "-I", "-B", "-c", REAPER, sys.executable, "-I", "-B", *guard]
    return argv, {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}, True


def run_program(
    program: str,
    timeout: float = 10.0,
    memory_bytes: int = 2 << 30,
    file_bytes: int = 16 << 20,
    isolate: bool | None = True,
) -> ExecutionResult:
    """Run a Python program in the sandbox; it passes when it runs to its end and exits 0 within `timeout` s.

    `isolate`: True (the default) requires bubblewrap, a one-line `ViasdError` saying how to install it where
    it does not work; None uses it where it works and otherwise runs under the guard alone with a
    `SandboxWarning` (the user accepted the risk); False always runs under the guard alone.
    """
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise ViasdError(f"the HumanEval timeout must be a finite number of seconds > 0, got {timeout}")
    with tempfile.TemporaryDirectory(prefix="viasd-exec-") as tmp, contextlib.closing(ReportPipe()) as report:
        (Path(tmp) / "solution.py").write_text(program, encoding="utf-8")
        (Path(tmp) / "guard.py").write_text(GUARD, encoding="utf-8")
        command, env, reaper = _command(tmp, isolate, report.write_end)
        cpu = max(1, math.ceil(timeout) + 1)
        deadline = time.monotonic() + timeout
        proc = subprocess.Popen(
            command,
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(report.write_end,),
            start_new_session=True,
            preexec_fn=lambda: _limits(cpu, memory_bytes, file_bytes),
        )
        report.handed_over()
        out, err = Capture(), Capture()
        finished = False
        try:
            finished = _collect(proc, deadline, out, err) and _wait(proc, deadline)
        finally:
            _stop(proc, reaper and not finished)
        received = report.received()
    if not finished:
        return ExecutionResult(False, "timed out", f"no result within {timeout:g} s")
    return _verdict(proc.returncode, received, err)


class ReportPipe:
    """The pipe on which the guard reports that the program ran to its end; the harness keeps its read end."""

    def __init__(self) -> None:
        self.read_end, self.write_end = os.pipe()

    def handed_over(self) -> None:
        """Close the harness's copy of the write end once the child holds it."""
        os.close(self.write_end)
        self.write_end = -1

    def received(self) -> bytes:
        """What the guard wrote by the time the program ended. Never waits for the pipe to close: a process the
        program left behind may still hold it."""
        os.set_blocking(self.read_end, False)
        try:
            return os.read(self.read_end, len(DONE) + 1)
        except BlockingIOError:
            return b""

    def close(self) -> None:
        """Close what is still open."""
        for fd in (self.read_end, self.write_end):
            if fd >= 0:
                os.close(fd)
        self.read_end = self.write_end = -1


def _verdict(returncode: int, report: bytes, err: Capture) -> ExecutionResult:
    """Passed only with exit status 0 and the guard's report that the program ran to its end."""
    if returncode == 0 and report == DONE:
        return ExecutionResult(True, "passed")
    if returncode < 0 and -returncode in (signal.SIGXCPU, signal.SIGKILL):
        return ExecutionResult(False, "timed out", f"killed by signal {-returncode}")
    lines = err.text().strip().splitlines()
    if returncode == 0:
        why = "exit status 0, but the program did not run to its end (an early exit)"
        return ExecutionResult(False, "failed", f"{lines[-1][:300]} ({why})" if lines else why)
    return ExecutionResult(False, "failed", lines[-1][:300] if lines else f"exit status {returncode}")


def _collect(proc: subprocess.Popen[bytes], deadline: float, out: Capture, err: Capture) -> bool:
    """Read standard output and error into bounded captures until both close; False when the deadline came first."""
    with selectors.DefaultSelector() as selector:
        for stream, capture in ((proc.stdout, out), (proc.stderr, err)):
            assert stream is not None
            selector.register(stream, selectors.EVENT_READ, capture)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            for key, _ in selector.select(remaining):
                data = os.read(key.fd, _CHUNK)
                if data:
                    key.data.feed(data)
                else:
                    selector.unregister(key.fileobj)
    return True


def _wait(proc: subprocess.Popen[bytes], deadline: float) -> bool:
    """Wait for the child to end by the deadline; False when it is still running then."""
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return False
    return True


def _stop(proc: subprocess.Popen[bytes], reap: bool) -> None:
    """End everything the program started and collect the child, whatever happened.

    With a reaper (no bubblewrap), SIGTERM first lets it kill the program's descendants, those in sessions of
    their own too; then the child's whole process group is killed. Under bubblewrap, killing the group also
    ends the sandbox's PID namespace, and with it every process the program started.
    """
    if reap and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=_REAP_SECONDS)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


def check_humaneval(
    problem: Mapping[str, Any], completion: str, timeout: float = 10.0, isolate: bool | None = True
) -> ExecutionResult:
    """Whether a completion passes its HumanEval problem's tests (see `run_program` for `isolate`)."""
    return run_program(humaneval_program(problem, completion), timeout=timeout, isolate=isolate)
