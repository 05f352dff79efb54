"""The manifest of a cached model: each file's size, SHA-256 and xxh3-128 digest, recorded when the entry is written.

Three checks, by cost. Sizes (one `stat` per file) and contents by xxh3-128 run at every load, so a truncated,
replaced or bit-flipped file is caught before transformers reads it (`check_contents`); SHA-256 of everything runs
only for `viasd models --verify`. xxh3 is not a cryptographic hash: it guards against damage (a torn write, a
flipped bit, a file replaced by mistake), while the SHA-256, and the pinned SHA-256 of the GGUF file the entry was
converted from, are the proof of origin.

What the load-time check costs, measured on the development machine (AMD EPYC with SHA extensions, 2 shared cores,
files in the page cache; one file hashed in 8 MiB chunks, best of two; xxhash 3.x, Python's hashlib):

| file | xxh3-128 | SHA-256 | BLAKE2b |
| --- | --- | --- | --- |
| default target, bf16 weights (3.55 GB) | 0.47 s (7.6 GB/s) | 2.55 s (1.4 GB/s) | 3.26 s (1.1 GB/s) |
| default drafter, bf16 weights (1.26 GB) | 0.13 s (9.4 GB/s) | 0.89 s (1.4 GB/s) | 1.12 s (1.1 GB/s) |

So a start of the default pair pays about 0.6 s for the check (0.5-0.8 s measured through `ensure_default_model`,
with the machine's noise), against 3.1-4.4 s for loading the target; the bytes read are the ones transformers reads
next, from the page cache. Manifests written before xxh3 digests were recorded (version 1) are checked once by
SHA-256 (3.5 s for the target, 1.2 s for the drafter), which then records the xxh3 digests, so later starts pay
the fast check only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

import xxhash

from viasd.fileio import write_atomic

MANIFEST_FILE = "viasd-manifest.json"
VERSION = 2  # 2: an xxh3-128 digest per file besides the SHA-256
_CHUNK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class FileRecord:
    """What a file was when the entry was written."""

    size: int
    sha256: str
    xxh3: str | None = None  # xxh3-128 in hex; None in manifests written before it was recorded


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, in hex (read in chunks)."""
    return file_digests(path)[0]


def file_digests(path: Path, sha256: bool = True) -> tuple[str, str]:
    """SHA-256 (empty unless `sha256`) and xxh3-128 of a file's bytes, in hex, from one read."""
    slow = hashlib.sha256() if sha256 else None
    fast = xxhash.xxh3_128()
    buffer = bytearray(_CHUNK_BYTES)  # read into one buffer: no new bytes object per chunk
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            fast.update(view[:count])
            if slow is not None:
                slow.update(view[:count])
    return (slow.hexdigest() if slow is not None else ""), fast.hexdigest()


def _files(directory: Path) -> list[Path]:
    """Every regular file of the entry but the manifest, in a stable order."""
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def _write(directory: Path, records: dict[str, FileRecord]) -> None:
    """Write the records as the entry's manifest, atomically."""
    files = {name: {"size": r.size, "sha256": r.sha256, "xxh3_128": r.xxh3} for name, r in records.items()}
    write_atomic(directory / MANIFEST_FILE, json.dumps({"version": VERSION, "files": files}, indent=2) + "\n")


def write_manifest(directory: Path) -> dict[str, FileRecord]:
    """Record the size, SHA-256 and xxh3-128 of every file in `directory` (atomically) and return the records."""
    records = {}
    for path in _files(directory):
        sha256, xxh3 = file_digests(path)
        records[path.relative_to(directory).as_posix()] = FileRecord(path.stat().st_size, sha256, xxh3)
    _write(directory, records)
    return records


class ManifestError(Exception):
    """The manifest itself is unreadable or malformed."""


def _record(raw: dict[str, object]) -> FileRecord:
    """One file's record as the manifest holds it (a missing xxh3 digest: an older manifest)."""
    xxh3 = raw.get("xxh3_128")
    if xxh3 is not None and not isinstance(xxh3, str):
        raise TypeError("xxh3_128 must be text")
    return FileRecord(int(raw["size"]), str(raw["sha256"]), xxh3)  # type: ignore[call-overload]


def read_manifest(directory: Path) -> dict[str, FileRecord] | None:
    """The recorded files, or None when the entry has no manifest (written before manifests existed)."""
    path = directory / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
        return {str(name): _record(r) for name, r in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
        raise ManifestError(f"its manifest {MANIFEST_FILE} is unreadable ({type(error).__name__})") from error


def problems(directory: Path, records: dict[str, FileRecord], hashes: bool = False) -> list[str]:
    """What differs from the records: missing files and wrong sizes, and with `hashes` wrong contents (SHA-256)."""
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


def check_contents(directory: Path, records: dict[str, FileRecord]) -> list[str]:
    """Files whose bytes differ from the records, by xxh3-128 (SHA-256 where an older manifest has no xxh3 digest:
    those digests are then recorded, best effort, so that the next check is the fast one). Sizes are checked first."""
    found = problems(directory, records)
    if found:
        return found
    upgraded = dict(records)
    for name, record in records.items():
        try:
            sha256, xxh3 = file_digests(directory / name, sha256=record.xxh3 is None)
        except OSError as error:
            found.append(f"{name} cannot be read ({error.strerror or error})")
            continue
        if record.xxh3 is None and sha256 != record.sha256:
            found.append(f"{name} has other contents than were written (SHA-256 differs)")
        elif record.xxh3 is not None and xxh3 != record.xxh3:
            found.append(f"{name} has other contents than were written (xxh3 digest differs)")
        elif record.xxh3 is None:
            upgraded[name] = replace(record, xxh3=xxh3)
    if not found and upgraded != records:
        with contextlib.suppress(OSError):  # a read-only cache: the SHA-256 check again next time
            _write(directory, upgraded)
    return found
