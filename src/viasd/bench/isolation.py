"""OS-level isolation for model-written programs, with bubblewrap (`bwrap`, Debian package `bubblewrap`).

A program runs as an unprivileged user with no capabilities in new user, PID, network, IPC, UTS and
cgroup namespaces: it sees no network, only its own processes (so nothing of the parent, such as
/proc/<pid>/environ, is readable, and nothing survives the sandbox's first process), a clean
environment, and a read-only view of the system's programs and libraries and of the Python
installation, with one writable scratch directory. bwrap kills the sandbox when its parent dies.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SCRATCH = "/sandbox"  # where the scratch directory appears inside
NOBODY = "65534"
# Top-level directories that merged-/usr systems make symlinks into /usr, and others elsewhere.
_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime")
_PROBE_SECONDS = 30.0


@dataclass(frozen=True)
class Bubblewrap:
    """A bwrap executable that was seen to work here, and whether it can forbid nested user namespaces."""

    executable: str
    disable_userns: bool


def _python_dirs() -> list[str]:
    """The read-only directories the interpreter needs: its installation and the virtual environment."""
    dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    dirs.add(str(Path(sys.executable).resolve().parent.parent))
    covered = ("/usr",)
    # "/" would expose the whole filesystem: leave it out (the probe then fails and the guard alone runs, loudly).
    return sorted(d for d in dirs if d not in ("", "/") and not any(d == c or d.startswith(c + "/") for c in covered))


def _system_binds() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in _SYSTEM_FILES:
        args += ["--ro-bind-try", path, path]
    for path in _python_dirs():
        args += ["--ro-bind", path, path]
    return args


def bwrap_command(
    bwrap: Bubblewrap, scratch: str | os.PathLike[str], argv: Sequence[str], env: Mapping[str, str]
) -> list[str]:
    """The command line that runs `argv` in the sandbox, in `scratch` (seen as SCRATCH) with only `env` set."""
    args = [bwrap.executable, "--unshare-all", "--unshare-user", "--uid", NOBODY, "--gid", NOBODY]
    if bwrap.disable_userns:
        args.append("--disable-userns")
    args += ["--cap-drop", "ALL", "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
    for key, value in env.items():
        args += ["--setenv", key, value]
    args += _system_binds()
    args += ["--proc", "/proc", "--dev", "/dev", "--bind", os.fspath(scratch), SCRATCH, "--chdir", SCRATCH]
    args += ["--remount-ro", "/", "--", *argv]
    return args


@functools.cache
def find_bubblewrap() -> tuple[Bubblewrap | None, str]:
    """A working bwrap, or None and the reason there is none (not installed, or namespaces refused here).

    Works means: it starts this Python inside the sandbox this module builds; checked once per process.
    """
    executable = shutil.which("bwrap")
    if executable is None:
        return None, "bubblewrap (bwrap) is not installed"
    try:
        usage = subprocess.run([executable, "--help"], capture_output=True, text=True, timeout=_PROBE_SECONDS)
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"{executable} does not run ({error})"
    bwrap = Bubblewrap(executable, disable_userns="--disable-userns" in usage.stdout + usage.stderr)
    try:
        with tempfile.TemporaryDirectory(prefix="viasd-probe-") as scratch:
            probe = bwrap_command(bwrap, scratch, [sys.executable, "-I", "-c", ""], {})
            result = subprocess.run(
                probe, capture_output=True, text=True, timeout=_PROBE_SECONDS, stdin=subprocess.DEVNULL
            )
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"{executable} does not run ({error})"
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        detail = lines[-1] if lines else f"exit status {result.returncode}"
        return None, f"{executable} cannot make a sandbox here ({detail})"
    return bwrap, ""
