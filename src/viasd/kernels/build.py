"""viasd's own C kernels: compiled once per machine with the system's C compiler, cached, loaded with ctypes."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

import torch

from viasd.kernels.cpu import cpu_flags
from viasd.models.fetch import default_cache_dir

# A build: its name, the CPU flags it needs, the compiler flags it is made with.
Build = tuple[str, tuple[str, ...], Sequence[str]]
COMMON_FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off")


def choose_build(builds: Sequence[Build], flags: frozenset[str]) -> Build | str:
    """The first (widest) of `builds` that a CPU with `flags` runs, or why none does."""
    if not flags:
        return "cannot read the CPU's flags (/proc/cpuinfo)"
    for build in builds:
        if all(flag in flags for flag in build[1]):
            return build
    return "this CPU has none of " + ", ".join("+".join(needed) for _, needed, _ in builds)


def load_kernel(
    source: str, builds: Sequence[Build], what: str, headers: Sequence[str] = ()
) -> tuple[ctypes.CDLL, str] | str:
    """`viasd/models/<source>` (which may include `headers`, beside it) compiled for the widest build this CPU runs
    and loaded: (library, build name), or why not (a sentence naming `what`). The library is kept in viasd's cache
    under a name that digests the source, headers and flags, and written atomically, so processes never load a
    half-written file."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the {what} kernel is for x86 CPUs, this is {platform.machine()}"
    build = choose_build(builds, cpu_flags())
    if isinstance(build, str):
        return build
    name, _, build_flags = build
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return "no C compiler found (set CC)"
    files = {file: resources.files("viasd.kernels").joinpath(file).read_bytes() for file in (source, *headers)}
    command = [*COMMON_FLAGS, *build_flags]
    digest = hashlib.sha256(b"".join(files.values()) + " ".join(command).encode()).hexdigest()[:16]
    library = default_cache_dir().parent / "kernels" / f"{Path(source).stem}-{name}-{digest}.so"
    if not library.is_file():
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as work:
            for file, text in files.items():
                (Path(work) / file).write_bytes(text)
            built = Path(work) / "kernel.so"
            result = subprocess.run([compiler, *command, source, "-o", built.name], cwd=work,
                                    capture_output=True, text=True)  # fmt: skip
            if result.returncode != 0:
                last = (result.stderr.strip().splitlines() or ["no message"])[-1]
                return f"compiling the {what} kernel ({name}) failed: {last}"
            os.replace(built, library)  # atomic: other processes see no half-written library
    try:
        return ctypes.CDLL(str(library)), name
    except OSError as error:
        return f"the compiled {what} kernel does not load: {error}"


def checked_kernel(
    source: str,
    builds: Sequence[Build],
    what: str,
    function: str,
    argtypes: Sequence[type],
    check: Callable[[ctypes.CDLL], str | None],
    headers: Sequence[str] = (),
) -> ctypes.CDLL | str:
    """`load_kernel`, then `function`'s signature (returning an int status) declared and the library held to
    `check` (None: it computes what it should): the library, or why it is not used (a sentence)."""
    loaded = load_kernel(source, builds, what, headers)
    if isinstance(loaded, str):
        return loaded
    kernel, name = loaded
    getattr(kernel, function).argtypes = list(argtypes)
    getattr(kernel, function).restype = ctypes.c_int
    problem = check(kernel)
    return f"the compiled {what} kernel ({name}) {problem}; using torch ops" if problem else kernel


def status(kernel: ctypes.CDLL | str) -> str:
    """`compiled` for a kernel in use, else why there is none."""
    return "compiled" if isinstance(kernel, ctypes.CDLL) else kernel


def kernel_input(x: torch.Tensor) -> torch.Tensor:
    """x as viasd's low-bit kernels take it: contiguous float32 or bf16 (a bf16 model's activations as they come);
    other dtypes as float32. Their output has the same dtype."""
    return (x if x.dtype in (torch.float32, torch.bfloat16) else x.float()).contiguous()
