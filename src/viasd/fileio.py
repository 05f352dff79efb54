"""File helpers: atomic writes (readers see the old file or the new one, never half of one), new files that never
replace another, locks between processes, and content hashes."""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from viasd.errors import ViasdError

Buffer = Any  # bytes, a memoryview, a numpy array: what a binary file's write takes

# Flags of the temporary sibling: created here or not at all, never through a link (as tempfile.mkstemp opens it).
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)


def write_atomic(path: str | os.PathLike[str], data: str | bytes | Iterable[Buffer]) -> None:
    """Write a whole file through a temporary sibling and a rename; the result is world-readable (0644 less the
    umask), as profiles and reports are meant to be shared. `data` may come in pieces (an iterable of buffers), so
    that a file of several GB is never whole in memory."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_sibling(target)
    try:
        with os.fdopen(fd, "wb") as handle:
            if isinstance(data, str | bytes | bytearray | memoryview):
                handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            else:
                for piece in data:
                    handle.write(piece)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_new(path: str | os.PathLike[str], data: bytes) -> None:
    """Write a whole new file as `write_atomic` does, but never over another: FileExistsError where `path` exists, so
    that two writers choosing the same name both keep their file (the second takes another name)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_sibling(target)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.link(tmp, target)  # atomic, and refused where the name is taken (a rename would replace it)
    finally:
        tmp.unlink(missing_ok=True)


class LockHeld(Exception):
    """A lock another process holds; `holder` is what it wrote in the lock file (its process id), or ''."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by {holder or 'another process'}")
        self.holder = holder


@contextmanager
def held_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """An exclusive lock on `path` (created if missing) for the block, or LockHeld at once where another process holds
    it. The file holds the holder's process id; the lock ends with its process (flock), so a killed one leaves none."""
    import fcntl

    lock = Path(path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LockHeld(lock, os.pread(fd, 32, 0).decode(errors="replace").strip()) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def exclusive(path: str | os.PathLike[str], refusal: Callable[[str], str]) -> Iterator[None]:
    """`held_lock` on `path` for the block, or a one-line ViasdError before it: `refusal(by)` where another process
    holds it (`by`: " (process N)", or "" where it wrote no number)."""
    with ExitStack() as stack:
        try:
            stack.enter_context(held_lock(path))
        except LockHeld as held:
            raise ViasdError(refusal(f" (process {held.holder})" if held.holder else "")) from None
        except OSError as error:
            raise ViasdError(f"cannot lock {path}: {error.strerror or error}") from None
        yield


def _new_sibling(target: Path) -> tuple[int, Path]:
    """A new, uniquely named, empty file beside `target`, open for writing, and its path.

    It is created with mode 0644 and the kernel applies the umask as it creates it, so the umask is never read:
    reading it with os.umask means setting it, process-wide, and a thread creating a file meanwhile (the server
    runs threads) would get the wrong mode.
    """
    for _ in range(100):
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}")
        try:
            return os.open(tmp, _CREATE, 0o644), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused temporary name beside the file", str(target))


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a file's bytes, in hex."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
