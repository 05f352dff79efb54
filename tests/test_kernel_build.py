"""viasd's C kernels are compiled once per machine and source (models/native.py): the build named, the library
reused, a failed compile said in one line."""

from __future__ import annotations

import pytest

from viasd.kernels import w6a8
from viasd.kernels.build import load_kernel
from viasd.kernels.cpu import cpu_flags


def test_a_kernel_with_a_header_is_built_once_and_names_its_build(tmp_path, monkeypatch):
    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path / "models"))
    loaded = load_kernel("w6a8.c", w6a8.BUILDS, "6-bit x int8", ("lowbit.h",))
    if isinstance(loaded, str):
        pytest.skip(loaded)  # another CPU, or no compiler
    _, name = loaded
    assert name in [build[0] for build in w6a8.BUILDS]
    libraries = list((tmp_path / "kernels").glob("w6a8-*.so"))
    assert len(libraries) == 1 and f"-{name}-" in libraries[0].name
    assert load_kernel("w6a8.c", w6a8.BUILDS, "6-bit x int8", ("lowbit.h",))[1] == name
    assert list((tmp_path / "kernels").glob("w6a8-*.so")) == libraries  # the same file, not built again


def test_a_failed_compile_names_the_build_and_leaves_no_library(tmp_path, monkeypatch):
    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path / "models"))
    flag = next(iter(cpu_flags()), None)
    if flag is None:
        pytest.skip("the CPU's flags cannot be read here")
    broken = (("broken", (flag,), ("-mno-such-option",)),)
    why = load_kernel("w6a8.c", broken, "6-bit x int8", ("lowbit.h",))
    if why == "no C compiler found (set CC)" or "x86" in str(why):
        pytest.skip(str(why))
    assert isinstance(why, str) and why.startswith("compiling the 6-bit x int8 kernel (broken) failed:")
    assert "\n" not in why and not list((tmp_path / "kernels").glob("*.so"))
