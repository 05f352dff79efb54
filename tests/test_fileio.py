"""Atomic writes: the file appears whole with mode 0644 less the umask, and the process umask is never touched
(setting it, even for a moment, would give files another thread creates meanwhile the wrong mode)."""

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from viasd.fileio import write_atomic


@pytest.fixture
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    """The process umask set to the test's value (before os.umask is patched), restored afterwards."""
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077, 0o002], indirect=True)
def test_the_written_file_gets_0644_less_the_umask_and_the_umask_is_never_changed(
    umask: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_umask(mask: int) -> int:
        raise AssertionError(f"os.umask({mask:#o}) called: the process umask changed")

    monkeypatch.setattr(os, "umask", no_umask)
    path = tmp_path / "sub" / "profile.json"
    write_atomic(path, "first\n")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 & ~umask
    write_atomic(path, b"second\n")  # replacing a file: the same mode, the new bytes, no temporary file left over
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 & ~umask
    assert path.read_bytes() == b"second\n" and [p.name for p in path.parent.iterdir()] == ["profile.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path: Path) -> None:
    path = tmp_path / "report.md"
    write_atomic(path, "old\n")
    with pytest.raises(TypeError):
        write_atomic(path, 42)  # type: ignore[arg-type]
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["report.md"]
