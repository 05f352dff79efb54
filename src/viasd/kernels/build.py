"""Building and loading viasd's kernel library: compiled once per machine with the system's C compiler, kept in a
private folder of viasd's cache, checked by content before it is loaded, bound through cffi to the declarations
of `viasd_kernels.h`.

All of viasd's C sources go into one library, in the widest build this CPU runs (`BUILDS`). Nothing here raises:
every way a build can fail (no compiler, a bad `CC`, a compiler that hangs, an unwritable cache, a damaged or
foreign library under the expected name) comes back as a one-line reason, and the callers use torch instead. Each
is also said on stderr, one line once per process, as a library found damaged and built again is: torch's ops are
slower, and a reason kept only in `--json` leaves a slow run unexplained. A CPU the kernels are not for is no fault
and says nothing here.

The cache holds, per key (sources, headers, compiler flags, and the compiler itself): the library, a record of its
SHA-256 written when it was built and checked before every load (a truncated library would kill the process with
SIGBUS; a planted one would run its code in it), or a record of why the build failed, so a failed build is not
tried again at every start, but is as soon as the sources or the compiler change.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from viasd.cache import private_folder
from viasd.errors import ViasdError
from viasd.fileio import write_atomic
from viasd.kernels.cpu import cpu_flags
from viasd.kernels.notice import warn_once
from viasd.kernels.switch import OFF, switched_off

HEADER = "viasd_kernels.h"  # the interface: what cffi reads
SOURCES = ("lowbit.c", "w4a8.c", "w6a8.c", "w8a8.c", "bf16.c", "bf16_native.c", "attention.c", "fused_layers.c",
           "repack.c")  # fmt: skip
HEADERS = (HEADER, "lowbit.h", "bf16_vectors.h")
COMMON_FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-Wno-psabi")
BUILD_SECONDS = 180  # a compiler that takes longer is stuck (the build takes a few seconds)
STOP_SECONDS = 5.0  # how long a stuck compiler's processes get to end after SIGTERM, before SIGKILL


@dataclass(frozen=True)
class Build:
    """One way to compile the kernels: its name, the CPU flags it needs, the compiler flags it is made with."""

    name: str
    needs: tuple[str, ...]
    flags: tuple[str, ...]


# Widest first. The wide build's int8 dot products are AVX-512 VNNI's; the other's are AVX2's (the same numbers).
BUILDS = (
    Build("avx512-vnni", ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma"),
          ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma")),
    Build("avx2", ("avx2", "f16c", "fma"), ("-mavx2", "-mf16c", "-mfma")),
)  # fmt: skip


@dataclass(frozen=True)
class Library:
    """A loaded kernel library: cffi's handle on it, the build it is, and where it was loaded from."""

    lib: Any
    build: str
    path: Path


@functools.cache
def ffi() -> Any:
    """cffi's FFI with the declarations of `viasd_kernels.h` (preprocessor lines left out: cffi takes none)."""
    import cffi

    text = resources.files("viasd.kernels").joinpath(HEADER).read_text()
    declarations = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    interface = cffi.FFI()
    interface.cdef(declarations)
    return interface


@functools.cache
def constants(enum: str) -> dict[str, int]:
    """The constants of one of the interface's enums by name: `viasd_sizes`, `viasd_status` (what its functions
    return), `viasd_kind` (the kinds of low-bit product)."""
    return dict(ffi().typeof(f"enum {enum}").relements)


def sizes() -> dict[str, int]:
    """The interface's size constants (`enum viasd_sizes`) by name, e.g. VIASD_GROUP: 32."""
    return dict(constants("viasd_sizes"))


def choose_build(builds: Sequence[Build], flags: frozenset[str]) -> Build | str:
    """The first (widest) of `builds` that a CPU with `flags` runs, or why none does."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"viasd's kernels are for x86 CPUs, this is {platform.machine()}"
    if not flags:
        return "cannot read the CPU's flags (/proc/cpuinfo)"
    for build in builds:
        if all(flag in flags for flag in build.needs):
            return build
    return "this CPU has none of " + ", ".join("+".join(build.needs) for build in builds)


def compiler() -> str | None:
    """The C compiler's path: `$CC` (a name on PATH or a path), else cc or gcc; None where there is none."""
    named = os.environ.get("CC", "").strip()
    if named:
        return shutil.which(named.split()[0])
    return shutil.which("cc") or shutil.which("gcc")


def _compiler_identity(path: str) -> str:
    """What a rebuild should follow: the compiler's resolved path, size and modification time (an upgrade changes
    them), without running it."""
    real = os.path.realpath(path)
    try:
        info = os.stat(real)
    except OSError:
        return real
    return f"{real}:{info.st_size}:{info.st_mtime_ns}"


def _key(build: Build, cc: str) -> str:
    files = b"".join(resources.files("viasd.kernels").joinpath(f).read_bytes() for f in (*SOURCES, *HEADERS))
    command = " ".join([*COMMON_FLAGS, *build.flags, _compiler_identity(cc)])
    return hashlib.sha256(files + command.encode()).hexdigest()[:16]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _compile(cc: str, build: Build, into: Path) -> str | None:
    """Compile the library to `into` (a fresh path); None, or why it failed (one line)."""
    with tempfile.TemporaryDirectory(dir=into.parent) as work:
        for name in (*SOURCES, *HEADERS):
            (Path(work) / name).write_bytes(resources.files("viasd.kernels").joinpath(name).read_bytes())
        command = [cc, *COMMON_FLAGS, *build.flags, *SOURCES, "-o", "kernels.so"]
        try:
            result = _run_compiler(command, work)
        except subprocess.TimeoutExpired:
            return f"compiling viasd's kernels ({build.name}) took over {BUILD_SECONDS} s; stopped"
        except OSError as error:
            return f"cannot run the C compiler {cc}: {error.strerror or error}"
        if result.returncode != 0:
            lines = [line for line in result.stderr.strip().splitlines() if "error" in line.lower()]
            last = (lines or result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
            return f"compiling viasd's kernels ({build.name}) failed: {last.strip()}"
        os.replace(Path(work) / "kernels.so", into)
    return None


def _run_compiler(command: list[str], cwd: str) -> subprocess.CompletedProcess[str]:
    """Run the compiler in a process group of its own for up to BUILD_SECONDS (subprocess.TimeoutExpired past
    that). A compiler stopped (past its time, or this process interrupted) is stopped with every process it
    started, as coreutils' timeout and make stop a job: its group, not only itself, else cc1, as, ld or a
    wrapper's children run on."""
    with subprocess.Popen(
        command, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as process:  # fmt: skip
        try:
            stdout, stderr = process.communicate(timeout=BUILD_SECONDS)
        except BaseException:
            _stop_group(process)
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _stop_group(process: subprocess.Popen[str]) -> None:
    """SIGTERM to the process's group; SIGKILL to whatever of it is left after STOP_SECONDS."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_SECONDS
        while time.monotonic() < deadline:
            if process.poll() is not None:
                os.killpg(process.pid, 0)  # ProcessLookupError once no process of the group is left
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _open(path: Path, build: Build) -> Library | str:
    try:
        return Library(ffi().dlopen(str(path)), build.name, path)
    except OSError as error:
        return f"the compiled kernels ({build.name}) do not load: {error}"


def load(build: Build) -> Library | str:
    """The kernel library in `build`, from the cache when a sound copy is there, else compiled (and cached where
    the cache is usable); or why not (one line)."""
    cc = compiler()
    if cc is None:
        named = os.environ.get("CC", "").strip()
        return f"the C compiler CC={named!r} is not found" if named else "no C compiler found (install gcc or set CC)"
    key = _key(build, cc)
    stem = f"kernels-{build.name}-{key}"
    try:
        folder = private_folder("kernels")
    except ViasdError as error:
        return _load_uncached(cc, build, f"{error}; the kernels are built for this process only")
    library, digest, failure = folder / f"{stem}.so", folder / f"{stem}.sha256", folder / f"{stem}.failed"
    if failure.is_file():  # this build failed before, with this compiler and these sources
        return failure.read_text(errors="replace").strip() or "an earlier build failed"
    if library.is_file():
        try:
            sound = digest.read_text().strip() == _sha256(library)
        except OSError:
            sound = False
        if sound:
            return _open(library, build)
        warn_once(f"the compiled kernels {library} are not the ones built there (damaged or replaced): building again")
        library.unlink(missing_ok=True)  # damaged, or not ours: built again below
    try:
        problem = _compile(cc, build, library)
        if problem is not None:
            write_atomic(failure, problem + "\n")
            return problem
        write_atomic(digest, _sha256(library) + "\n")
    except OSError as error:
        return _load_uncached(cc, build, f"cannot write to {folder}: {error.strerror or error}")
    return _open(library, build)


def _load_uncached(cc: str, build: Build, why: str) -> Library | str:
    """Compile into a private temporary folder and load from there (the file is removed once loaded)."""
    warn_once(why)
    work = Path(tempfile.mkdtemp(prefix="viasd-kernels-"))
    try:
        problem = _compile(cc, build, work / "kernels.so")
        return problem or _open(work / "kernels.so", build)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@functools.cache
def library() -> Library | str:
    """The kernel library in the widest build this CPU runs, loaded once per process; or why there is none (said
    on stderr where it is a fault of the build, see `build_fault`)."""
    build = choose_build(BUILDS, cpu_flags())
    if isinstance(build, str):
        return build
    found = load(build)
    if isinstance(found, str):
        warn_once(f"viasd's C kernels are not used, torch computes in their place (slower): {found}")
    return found


def build_fault() -> str | None:
    """Why the kernel library failed to build or load on a CPU it is for (said on stderr already), or None."""
    found = library()
    return found if isinstance(found, str) and not isinstance(choose_build(BUILDS, cpu_flags()), str) else None


def checked(kernel: str, check: Callable[[Library], str | None]) -> Library | str:
    """The library for `kernel` when it passes `check` (None: it computes what its torch reference does), else
    why it is not used (one line)."""
    found = library()
    if isinstance(found, str):
        return found
    problem = on_own_thread(lambda: check(found))
    return f"viasd's {kernel} kernel ({found.build}) {problem}" if problem else found


def on_own_thread(work: Callable[[], Any]) -> Any:
    """`work()` run on a thread of its own and joined; its exception is raised here.

    A kernel's check asks for two threads whatever the caller's OpenMP count, so OpenMP gives the calling thread a
    team of workers that lives as long as that thread. A server's generation thread (confined to one thread,
    passes/executor.py) that ran the first check kept such a team, and with more threads in teams than cores every
    OpenMP region waited for sleeping workers: served decoding steps cost 66 ms instead of 43 on the 2-core Xeon.
    On a thread of its own the team ends with the check."""
    outcome: list[Any] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as error:  # raised again on the caller's thread
            failure.append(error)

    thread = threading.Thread(target=run, name="viasd-kernel-check")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]


def usable(kernel: str, checked_library: Callable[[], Library | str]) -> Library | str:
    """`checked_library()` (a kernel's cached `checked`), or OFF where VIASD_KERNELS leaves the kernel out."""
    return OFF if switched_off(kernel) else checked_library()


def status(found: Library | str) -> str:
    """`compiled (BUILD)` for a library in use, else why there is none."""
    return f"compiled ({found.build})" if isinstance(found, Library) else found


def address(tensor: Any) -> Any:
    """A tensor's memory as a C pointer for cffi (None stays NULL)."""
    return ffi().NULL if tensor is None else ffi().cast("void *", tensor.data_ptr())
