"""One line on stderr per distinct notice, once per process: what a kernel fallback tells the user."""

from __future__ import annotations

import functools
import sys


@functools.cache
def warn_once(message: str) -> None:
    """Print `viasd: <message>` to stderr, the first time this message comes up in the process only."""
    print(f"viasd: {message}", file=sys.stderr, flush=True)
