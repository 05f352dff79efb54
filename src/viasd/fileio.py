"""File helpers: atomic writes (readers see the old file or the new one, never half of one) and content hashes."""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
from pathlib import Path

# Flags of the temporary sibling: created here or not at all, never through a link (as tempfile.mkstemp opens it).
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write a whole file through a temporary sibling and a rename; the result is world-readable (0644 less the
    umask), as profiles and reports are meant to be shared."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_sibling(target)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
