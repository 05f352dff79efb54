"""viasd's kernel library (kernels/build.py): built once per machine, compiler and sources, kept in a private cache
folder, checked by content before every load; every fault (no compiler, a bad CC, a compiler that hangs or fails,
a damaged or foreign library, an unusable cache folder) ends in one line, never in a crash, and is said on stderr
once per process; a compiler stopped past its time is stopped with the processes it started."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest
import torch

from tiny import tiny_model, tiny_tokenizer
from viasd.errors import ViasdError
from viasd.kernels import attention, bf16, bf16_native, build, fused_layers, interface, notice, w4a8, w6a8, w8a8
from viasd.kernels.build import Build, Library
from viasd.kernels.cpu import cpu_flags
from viasd.kernels.state import kernel_states
from viasd.kernels.switch import KERNELS, parse
from viasd.passes import fused as fused_plan

CHOSEN = build.choose_build(build.BUILDS, cpu_flags())
needs_build = pytest.mark.skipif(isinstance(CHOSEN, str) or build.compiler() is None, reason="no kernels here")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


def counting_compiler(tmp_path: Path, body: str = 'exec cc "$@"') -> Path:
    """A compiler that records each run in `runs` beside it, then does `body`."""
    script = tmp_path / "counting-cc"
    script.write_text(f'#!/bin/sh\necho run >> "{tmp_path}/runs"\n{body}\n')
    script.chmod(0o755)
    return script


def runs(tmp_path: Path) -> int:
    return len((tmp_path / "runs").read_text().splitlines()) if (tmp_path / "runs").exists() else 0


def test_the_header_is_the_interface_every_function_it_declares_is_in_the_library():
    sizes = build.sizes()
    assert sizes["VIASD_GROUP"] == 32 and sizes["VIASD_SUPER"] == 256  # the GGUF blocks' sizes
    loaded = build.library()
    if isinstance(loaded, str):
        pytest.skip(loaded)
    for function in ("w4a8_linear", "w6a8_linear", "w8a8_linear", "bf16_linear", "short_attention", "fused_layers"):
        assert callable(getattr(loaded.lib, function))


def test_status_codes_and_product_kinds_are_named_from_the_header_on_both_sides():
    """What the kernels return and which product kinds they take are the header's enums, which Python reads through
    cffi (kernels/interface.py): neither side writes one as a bare number, so they cannot drift apart."""
    folder = resources.files("viasd.kernels")
    bare_c = re.compile(r"return\s+-?\d+\s*;|\?\s*-?\d+\s*:\s*-?\d+\s*;|kind\s*[=!]=\s*\d")
    for name in build.SOURCES:
        assert not bare_c.search(folder.joinpath(name).read_text()), name
    bare_python = re.compile(r"status\s*[=!]=\s*-?\d|kind\s*[=!]=\s*\d|Product\(\d|_random_product\(\d")
    for path in (*Path(str(folder)).glob("*.py"), Path(fused_plan.__file__)):
        assert not bare_python.search(path.read_text()), path.name
    assert {interface.FOUR_BIT, interface.SIX_BIT, interface.EIGHT_BIT} == set(build.constants("viasd_kind").values())
    assert {interface.NORM_LLAMA, interface.NORM_GEMMA} == set(build.constants("viasd_norm").values())
    assert {interface.SILU, interface.GELU_TANH} == set(build.constants("viasd_activation").values())


@needs_build
def test_the_compiled_kernels_return_the_status_python_reads_from_the_header():
    loaded = build.library()
    assert isinstance(loaded, Library), loaded
    out, null = torch.empty(1, 1), build.ffi().NULL
    x = torch.zeros(1, 31)  # 31 inputs: not whole groups of 32, which the int4 kernel refuses before reading any
    refused = loaded.lib.w4a8_linear(build.address(x), 0, 1, 31, null, null, null, 1, null, build.address(out), 1)
    assert refused == interface.BAD_SHAPE != interface.OK


@needs_build
def test_built_once_into_a_private_folder_with_its_digest_then_reused(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(counting_compiler(tmp_path)))
    first = build.load(CHOSEN)
    assert isinstance(first, Library) and first.build == CHOSEN.name
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    libraries, digests = list(cache.glob("*.so")), list(cache.glob("*.sha256"))
    assert len(libraries) == 1 and len(digests) == 1 and f"-{CHOSEN.name}-" in libraries[0].name
    again = build.load(CHOSEN)
    assert isinstance(again, Library) and runs(tmp_path) == 1  # loaded from the cache, not built again


@needs_build
@pytest.mark.parametrize("damage", ["truncated", "foreign"])
def test_a_damaged_or_foreign_library_is_built_again_not_loaded(cache, tmp_path, monkeypatch, capsys, damage):
    monkeypatch.setenv("CC", str(counting_compiler(tmp_path)))
    assert isinstance(build.load(CHOSEN), Library)
    (library,) = cache.glob("*.so")
    # The damaged file replaces the library (a new file under its name): this process still maps the first one, and
    # writing into that would kill it with SIGBUS, as loading a truncated library would.
    planted = library.with_name("planted")
    if damage == "truncated":
        planted.write_bytes(library.read_bytes()[:4096])
    else:  # a library planted under the expected name: its code must never run
        planted.write_bytes(b"\x7fELF" + os.urandom(2000))
    planted.replace(library)
    capsys.readouterr()
    again = build.load(CHOSEN)
    assert isinstance(again, Library) and runs(tmp_path) == 2
    assert build._sha256(library) == next(cache.glob("*.sha256")).read_text().strip()
    # Said on stderr, in one line: a rebuild takes seconds, and a planted library is worth knowing of.
    assert capsys.readouterr().err == (
        f"viasd: the compiled kernels {library} are not the ones built there (damaged or replaced): building again\n"
    )


def test_no_compiler_and_a_bad_cc_say_so_in_one_line(cache, monkeypatch):
    if isinstance(CHOSEN, str):
        pytest.skip(CHOSEN)
    monkeypatch.setenv("CC", "no-such-compiler-anywhere")
    why = build.load(CHOSEN)
    assert why == "the C compiler CC='no-such-compiler-anywhere' is not found"
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", "")
    assert build.load(CHOSEN) == "no C compiler found (install gcc or set CC)"


def test_a_failed_build_says_why_leaves_nothing_and_is_not_retried_until_the_compiler_changes(cache, tmp_path,
                                                                                              monkeypatch):  # fmt: skip
    flag = next(iter(cpu_flags()), None)
    if flag is None or build.compiler() is None:
        pytest.skip("no CPU flags or no compiler here")
    broken = Build("broken", (flag,), ("-mno-such-option",))
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("CC", str(counting_compiler(tmp_path)))
    why = build.load(broken)
    assert isinstance(why, str) and why.startswith("compiling viasd's kernels (broken) failed:") and "\n" not in why
    assert not list(cache.glob("*.so")) and runs(tmp_path) == 1
    assert build.load(broken) == why and runs(tmp_path) == 1  # remembered: not compiled again at every start
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv("CC", str(counting_compiler(other)))  # another compiler: tried again
    assert isinstance(build.load(broken), str) and runs(other) == 1


def test_a_compiler_that_hangs_is_stopped(cache, tmp_path, monkeypatch):
    if isinstance(CHOSEN, str):
        pytest.skip(CHOSEN)
    monkeypatch.setenv("CC", str(counting_compiler(tmp_path, "sleep 30")))
    monkeypatch.setattr(build, "BUILD_SECONDS", 1)
    why = build.load(CHOSEN)
    assert why == f"compiling viasd's kernels ({CHOSEN.name}) took over 1 s; stopped"


def _running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.parametrize("term", ["ends on SIGTERM", "ignores SIGTERM"])
def test_a_compiler_that_hangs_is_stopped_with_the_processes_it_started(cache, tmp_path, monkeypatch, term):
    if isinstance(CHOSEN, str) or not Path("/proc/self/stat").exists():
        pytest.skip(CHOSEN if isinstance(CHOSEN, str) else "no /proc here")
    ignore = "trap '' TERM\n" if term == "ignores SIGTERM" else ""
    body = f'{ignore}sleep 60 &\necho $! > "{tmp_path}/child"\nwait'  # as cc runs cc1, as and ld
    monkeypatch.setenv("CC", str(counting_compiler(tmp_path, body)))
    monkeypatch.setattr(build, "BUILD_SECONDS", 1)
    monkeypatch.setattr(build, "STOP_SECONDS", 0.5)
    why = build.load(CHOSEN)
    child = int((tmp_path / "child").read_text())
    try:
        assert why == f"compiling viasd's kernels ({CHOSEN.name}) took over 1 s; stopped"
        deadline = time.monotonic() + 5
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child), "the compiler's child runs on after the compiler was stopped"
    finally:
        if _running(child):
            os.kill(child, signal.SIGKILL)


@pytest.fixture
def fresh_process() -> Iterator[None]:
    """The kernels as a new process finds them: nothing loaded or checked, nothing said yet (and so again after)."""

    def forget() -> None:
        for cached in (build.library, w4a8.compiled, w6a8.compiled, w8a8.compiled, bf16.compiled, bf16_native.compiled,
                       attention.compiled, fused_layers.compiled, notice.warn_once):  # fmt: skip
            cached.cache_clear()

    forget()
    yield
    forget()


@pytest.mark.parametrize("fault", ["no compiler", "a compiler that hangs", "a compiler that fails"])
def test_kernels_that_fall_back_for_a_fault_of_the_build_say_why_once(cache, tmp_path, monkeypatch, capsys,
                                                                      fresh_process, fault):  # fmt: skip
    if isinstance(CHOSEN, str):
        pytest.skip(CHOSEN)
    if fault == "no compiler":
        monkeypatch.setenv("CC", "no-such-compiler-anywhere")
    else:
        monkeypatch.setenv("CC", str(counting_compiler(tmp_path, "sleep 5" if "hangs" in fault else "exit 1")))
        monkeypatch.setattr(build, "BUILD_SECONDS", 1)
        monkeypatch.setattr(build, "STOP_SECONDS", 0.5)
    monkeypatch.delenv("VIASD_KERNELS", raising=False)
    states = [kernel_states() for _ in range(2)]  # what a generation consults, and --json records
    weights = w4a8.random_weights(16, 64, torch.Generator().manual_seed(0))
    w4a8.product(torch.randn(2, 64), weights)  # a low-bit product on torch's ops: its own notice is this one
    why = build.library()
    assert isinstance(why, str) and all(why in state for state in states[0].values()) and states[0] == states[1]
    err = capsys.readouterr().err.splitlines()
    assert err == [f"viasd: viasd's C kernels are not used, torch computes in their place (slower): {why}"]


def test_generation_without_a_compiler_says_so_in_one_line(tmp_path):
    """A whole generation, in a process of its own: every kernel falls back, one line says why."""
    directory = tmp_path / "model"
    tiny_model("llama", dtype=torch.bfloat16).save_pretrained(directory)
    tiny_tokenizer(64).save_pretrained(directory)
    env = {**os.environ, "VIASD_CACHE_DIR": str(tmp_path / "cache"), "CC": "no-such-compiler-anywhere"}
    env.pop("VIASD_KERNELS", None)
    command = [sys.executable, "-m", "viasd", "generate", "t3 t4 t5", "--target", str(directory), "--method", "plain",
               "-n", "3", "--dtype", "bf16", "--json"]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr
    said = [line for line in run.stderr.splitlines() if line.startswith("viasd:")]
    if isinstance(CHOSEN, str):
        assert said == []  # a CPU the kernels are not for: no fault, nothing to say
        return
    why = "the C compiler CC='no-such-compiler-anywhere' is not found"
    assert said == [f"viasd: viasd's C kernels are not used, torch computes in their place (slower): {why}"]
    assert json.loads(run.stdout)["setup"]["kernels"]["bf16"] == why


@needs_build
@pytest.mark.parametrize("fault", ["not a directory", "others may write", "read-only"])
def test_an_unusable_cache_folder_builds_for_this_process_with_one_line(cache, capsys, fault):
    cache.parent.mkdir(parents=True)
    if fault == "not a directory":
        cache.write_text("not a folder")
    elif fault == "others may write":
        cache.mkdir(mode=0o777)
        cache.chmod(0o777)
    else:
        cache.parent.chmod(0o500)
    try:
        if fault == "read-only" and os.access(cache.parent, os.W_OK):
            pytest.skip("running as a user whom permissions do not stop (root)")
        loaded = build.load(CHOSEN)
    finally:
        cache.parent.chmod(0o700)
    assert isinstance(loaded, Library) and not list(cache.parent.rglob("*.so"))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("viasd: cannot use") and "built for this process only" in err[0]


def test_viasd_kernels_takes_on_off_or_kernels_to_leave_out():
    assert parse("") == parse("on") == frozenset()
    assert parse("off") == frozenset(KERNELS)
    assert parse("-fused, -attention") == {"fused", "attention"}
    for bad in ("fused", "-nothing", "maybe"):
        with pytest.raises(ViasdError, match="VIASD_KERNELS"):
            parse(bad)


# A confined generation thread (as a server's) asks for a kernel first; the thread count is read while it lives.
FIRST_CHECK_ON_A_THREAD = """
import os, sys, threading, time
from viasd.kernels import build, w8a8
from viasd.passes.executor import confine_openmp
found = build.library()
if isinstance(found, str):
    print("no-library")
    sys.exit()
counts = {}
def generation():
    confine_openmp()
    before = len(os.listdir("/proc/self/task"))
    w8a8.kernel()  # the process's first check of this kernel
    for _ in range(200):  # a finished thread's OpenMP workers take a moment to exit
        if len(os.listdir("/proc/self/task")) == before:
            break
        time.sleep(0.01)
    counts["kernel"] = len(os.listdir("/proc/self/task")) - before
    w8a8._self_check(found)  # the same check on this thread, as kernels ran them before on_own_thread
    counts["control"] = len(os.listdir("/proc/self/task")) - before
thread = threading.Thread(target=generation)
thread.start()
thread.join()
print(counts["kernel"], counts["control"])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_a_kernels_first_check_leaves_no_openmp_team_with_the_thread_that_asked():
    """A check asks for two threads; on the asking thread their team outlived it and slowed every pass (served
    decoding 66 against 43 ms a step): it runs on a thread of its own (`build.on_own_thread`), whose team ends."""
    out = subprocess.run([sys.executable, "-c", FIRST_CHECK_ON_A_THREAD], capture_output=True, text=True, check=True)
    if out.stdout.strip() == "no-library":
        pytest.skip("no kernel library here")
    kernel, control = map(int, out.stdout.split())
    assert control >= 1  # the check on the asking thread leaves a worker: the test can fail
    assert kernel == 0


def test_on_own_thread_gives_the_result_and_raises_the_error():
    assert build.on_own_thread(lambda: 42) == 42
    with pytest.raises(ValueError, match="bad"):
        build.on_own_thread(lambda: (_ for _ in ()).throw(ValueError("bad")))
