"""What this machine's CPU can do, as the operating system reports it (Linux; elsewhere nothing is known)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (`avx512_vnni`, `amx_bf16`, ...) from /proc/cpuinfo; empty where there is none.

    The kernel lists a flag only when it also enables the feature for programs, so a listed flag can be used.
    """
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()
