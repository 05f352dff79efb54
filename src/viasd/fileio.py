"""File helpers: atomic writes (readers see the old file or the new one, never half of one) and content hashes."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write a whole file through a temporary sibling and a rename; the result is world-readable."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    umask = os.umask(0)
    os.umask(umask)
    # mkstemp creates the file owner-only; profiles and reports are meant to be shared.
    os.chmod(tmp, 0o644 & ~umask)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 of a file's bytes, in hex."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
