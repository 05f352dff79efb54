"""The calibration work file: a JSON file beside the profile that keeps what is slow to recompute.

It holds the target's continuations of the calibration prompts, the per-layer skip scores and the gate
records of each searched mask, each under a key that names everything it depends on, so `--resume` and
`--reselect` reuse them and never mix data of other models or settings. A missing or unreadable work
file is simply empty.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from viasd.fileio import write_atomic


def work_key(kind: str, *parts: Any) -> str:
    """A key for `kind` of data that depends on `parts` (anything JSON can write)."""
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{kind}-{digest}"


class WorkFile:
    """Get and put JSON values by key; every put rewrites the file atomically. `path` None keeps nothing."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path is not None else None

    def _read(self) -> dict[str, Any]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> Any:
        return self._read().get(key)

    def put(self, key: str, value: Any) -> None:
        if self.path is None:
            return
        data = self._read()
        data[key] = value
        write_atomic(self.path, json.dumps(data) + "\n")
