"""Running model-written code against HumanEval tests, away from the benchmark process.

Model output is untrusted input. Each program runs in a fresh Python interpreter (isolated mode, clean
environment) in its own temporary directory, in a new session, under resource limits (CPU seconds,
address space, file size, open files), with an in-process guard (`guard.py`) that turns ordinary accidents
into clear failures. Where bubblewrap works (`isolation.py`), the program also runs in a sandbox of its
own namespaces: no network, a read-only filesystem but its scratch directory, no view of other processes,
and nothing left alive after the time limit. Where it does not, the guard alone remains, which deliberate
code can undo: the benchmark warns once (a `SandboxWarning`) and says how to install bubblewrap.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from viasd.bench.guard import GUARD
from viasd.bench.isolation import SCRATCH, bwrap_command, find_bubblewrap
from viasd.errors import ViasdError

_REAP_SECONDS = 5.0


class SandboxWarning(UserWarning):
    """Model-written code is about to run without OS-level isolation."""


@dataclass(frozen=True)
class ExecutionResult:
    """How a program ended: passed (exit 0), failed (with the last line of stderr) or timed out."""

    passed: bool
    status: str  # "passed", "failed" or "timed out"
    detail: str = ""


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


def _command(tmp: str, isolate: bool | None) -> tuple[list[str], dict[str, str]]:
    """The command that runs guard.py on solution.py in `tmp`, and the environment to start it with."""
    bwrap, reason = find_bubblewrap()
    if isolate and bwrap is None:
        raise ViasdError(f"cannot isolate model-written code: {reason}")
    argv = [sys.executable, "-I", "-B", "guard.py", "solution.py"]
    if isolate is not False and bwrap is not None:
        env = {"PATH": "/usr/bin:/bin", "HOME": SCRATCH, "TMPDIR": SCRATCH, "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}
        return bwrap_command(bwrap, tmp, argv, env), {"PATH": "/usr/bin:/bin"}
    if isolate is None:
        warnings.warn(
            f"HumanEval code runs without OS-level isolation: {reason}. Only an in-process guard, which "
            "deliberate code can undo, stands between it and this machine; install bubblewrap "
            "(e.g. apt-get install bubblewrap) to run it in a sandbox",
            SandboxWarning,
            stacklevel=3,
        )
    return argv, {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"}


def run_program(
    program: str,
    timeout: float = 10.0,
    memory_bytes: int = 2 << 30,
    file_bytes: int = 16 << 20,
    isolate: bool | None = None,
) -> ExecutionResult:
    """Run a Python program in the sandbox; it passes when it exits with status 0 within `timeout` seconds.

    `isolate`: None uses bubblewrap when it works here and warns when it does not; True requires it (a
    `ViasdError` when missing); False runs under the in-process guard only.
    """
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise ViasdError(f"the HumanEval timeout must be a finite number of seconds > 0, got {timeout}")
    with tempfile.TemporaryDirectory(prefix="viasd-exec-") as tmp:
        (Path(tmp) / "solution.py").write_text(program, encoding="utf-8")
        (Path(tmp) / "guard.py").write_text(GUARD, encoding="utf-8")
        command, env = _command(tmp, isolate)
        cpu = max(1, math.ceil(timeout) + 1)
        proc = subprocess.Popen(
            command,
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=lambda: _limits(cpu, memory_bytes, file_bytes),
        )
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            _reap(proc)
            return ExecutionResult(False, "timed out", f"no result within {timeout:g} s")
        finally:
            _kill_group(proc)
        if proc.returncode == 0:
            return ExecutionResult(True, "passed")
        if proc.returncode < 0 and -proc.returncode in (signal.SIGXCPU, signal.SIGKILL):
            return ExecutionResult(False, "timed out", f"killed by signal {-proc.returncode}")
        lines = stderr.decode("utf-8", "replace").strip().splitlines()
        return ExecutionResult(False, "failed", lines[-1][:300] if lines else f"exit status {proc.returncode}")


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Collect a killed child without waiting on its pipe for ever: outside a sandbox, a process the
    program started in a session of its own may survive the kill and hold the pipe open."""
    try:
        proc.communicate(timeout=_REAP_SECONDS)
    except subprocess.TimeoutExpired:
        if proc.stderr is not None:
            proc.stderr.close()
        proc.wait()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the child's whole process group (it runs in a session of its own); under bubblewrap, killing it
    also ends the sandbox's PID namespace, and with it every process the program started."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def check_humaneval(
    problem: Mapping[str, Any], completion: str, timeout: float = 10.0, isolate: bool | None = None
) -> ExecutionResult:
    """Whether a completion passes its HumanEval problem's tests."""
    return run_program(humaneval_program(problem, completion), timeout=timeout, isolate=isolate)
