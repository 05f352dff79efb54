"""Whether a model's weights fit the memory this machine has free. A GGUF model larger than that is refused in one
line before anything is loaded: its view would otherwise grow until the kernel killed the process part way."""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")
GB = 1e9


def available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """The memory the system can give a new process without swapping (Linux's MemAvailable), or None where it does
    not say (another system, an unreadable file)."""
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            parts = value.split()
            if parts and parts[0].isdigit():
                return int(parts[0]) * 1024  # the file counts in KiB
    return None


def too_large(needed: int, available: int | None) -> str | None:
    """Why weights of `needed` bytes cannot run with `available` bytes free (None: they fit, or nothing is known)."""
    if available is None or needed <= available:
        return None
    return f"its weights take {needed / GB:.1f} GB in memory and this machine has {available / GB:.1f} GB available"
