"""Running model-written code against HumanEval tests, away from the benchmark process.

Each program runs in a fresh Python interpreter (isolated mode, empty environment) inside its own
temporary directory, in a new session so the whole process group can be killed on timeout, under
resource limits (CPU seconds, address space, file size, open files). Before the program starts, an
audit hook refuses process creation, network use, writes outside the temporary directory and file
deletion or renaming outside it. This guards the harness against careless or runaway code, the kind a
model writes; it is not a security boundary against deliberately hostile code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Runs first in the child: installs the audit hook, then executes the program file given as argv[1].
_GUARD = r"""
import os, sys
_ROOT = os.path.realpath(os.getcwd())
_BLOCKED = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill",
            "os.killpg", "subprocess.Popen", "pty.spawn", "socket.connect",
            "socket.bind", "socket.sendto", "ctypes.dlopen", "ctypes.dlsym", "shutil.rmtree", "os.chroot",
            "os.setuid", "os.setgid", "resource.setrlimit", "sys.addaudithook")
_PATHS = ("os.remove", "os.rmdir", "os.rename", "os.chmod", "os.chown", "os.truncate", "os.mkdir",
          "os.symlink", "os.link", "os.utime")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def _inside(path):
    if isinstance(path, int):
        return True
    try:
        real = os.path.realpath(os.fsdecode(path))
    except Exception:
        return False
    return real == _ROOT or real.startswith(_ROOT + os.sep)

def _hook(event, args):
    if event in _BLOCKED:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writing and path is not None and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox is not allowed")
    elif event in _PATHS:
        paths = [a for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))]
        if not all(_inside(p) for p in paths):
            raise PermissionError(f"sandbox: {event} outside the sandbox is not allowed")

_program = open(sys.argv[1], encoding="utf-8").read()
sys.addaudithook(_hook)
del sys.argv[1:]
try:
    exec(compile(_program, "solution.py", "exec"), {"__name__": "__main__"})
except SystemExit as stop:
    # Exiting early skips the tests, whatever the status: that is not a pass.
    sys.stderr.write(f"SystemExit({stop.code!r}) before the tests completed\n")
    sys.stderr.flush()
    os._exit(3)
"""


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
    """Resource limits for the child, set between fork and exec."""
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


def run_program(
    program: str, timeout: float = 10.0, memory_bytes: int = 2 << 30, file_bytes: int = 16 << 20
) -> ExecutionResult:
    """Run a Python program in the sandbox; it passes when it exits with status 0 within `timeout` seconds."""
    with tempfile.TemporaryDirectory(prefix="viasd-exec-") as tmp:
        (Path(tmp) / "solution.py").write_text(program, encoding="utf-8")
        (Path(tmp) / "guard.py").write_text(_GUARD, encoding="utf-8")
        cpu = max(1, int(timeout) + 1)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "guard.py", "solution.py"],
            cwd=tmp,
            env={"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "PYTHONHASHSEED": "0", "LANG": "C.UTF-8"},
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
            proc.communicate()
            return ExecutionResult(False, "timed out", f"no result within {timeout:g} s")
        finally:
            _kill_group(proc)
        if proc.returncode == 0:
            return ExecutionResult(True, "passed")
        if proc.returncode < 0 and -proc.returncode in (signal.SIGXCPU, signal.SIGKILL):
            return ExecutionResult(False, "timed out", f"killed by signal {-proc.returncode}")
        lines = stderr.decode("utf-8", "replace").strip().splitlines()
        return ExecutionResult(False, "failed", lines[-1][:300] if lines else f"exit status {proc.returncode}")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill the child's whole process group (it runs in a session of its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def check_humaneval(problem: Mapping[str, Any], completion: str, timeout: float = 10.0) -> ExecutionResult:
    """Whether a completion passes its HumanEval problem's tests."""
    return run_program(humaneval_program(problem, completion), timeout=timeout)
