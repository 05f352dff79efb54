"""The manifest of a cached model: the size and SHA-256 of every file, recorded when the entry is written.

Checking sizes costs one `stat` per file, so every load does it and a truncated or replaced file is caught
before transformers reads it; checking hashes reads everything, so only `viasd models --verify` does it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from viasd.fileio import write_atomic

MANIFEST_FILE = "viasd-manifest.json"
_CHUNK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class FileRecord:
    """What a file was when the entry was written."""

    size: int
    sha256: str


def file_sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            hasher.update(chunk)
    return hasher.hexdigest()


def _files(directory: Path) -> list[Path]:
    """Every regular file of the entry but the manifest, in a stable order."""
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def write_manifest(directory: Path) -> dict[str, FileRecord]:
    """Record the size and SHA-256 of every file in `directory` (atomically) and return the records."""
    records = {
        path.relative_to(directory).as_posix(): FileRecord(path.stat().st_size, file_sha256(path))
        for path in _files(directory)
    }
    body = {"version": 1, "files": {name: {"size": r.size, "sha256": r.sha256} for name, r in records.items()}}
    write_atomic(directory / MANIFEST_FILE, json.dumps(body, indent=2) + "\n")
    return records


class ManifestError(Exception):
    """The manifest itself is unreadable or malformed."""


def read_manifest(directory: Path) -> dict[str, FileRecord] | None:
    """The recorded files, or None when the entry has no manifest (written before manifests existed)."""
    path = directory / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
        return {str(name): FileRecord(int(r["size"]), str(r["sha256"])) for name, r in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ManifestError(f"its manifest {MANIFEST_FILE} is unreadable ({type(error).__name__})") from error


def problems(directory: Path, records: dict[str, FileRecord], hashes: bool = False) -> list[str]:
    """What differs from the records: missing files and wrong sizes, and with `hashes` wrong contents."""
    found: list[str] = []
    for name, record in records.items():
        path = directory / name
        try:
            size = path.stat().st_size
        except OSError:
            found.append(f"{name} is missing")
            continue
        if size != record.size:
            found.append(f"{name} has {size} bytes, expected {record.size}")
        elif hashes and file_sha256(path) != record.sha256:
            found.append(f"{name} has other contents than were written (SHA-256 differs)")
    return found
