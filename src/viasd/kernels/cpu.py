"""What this machine's CPU is and can do, as the operating system reports it (Linux; elsewhere nothing is known)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def _cpuinfo_field(name: str) -> str | None:
    """The value of the first `name : value` line of /proc/cpuinfo (None where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (`avx512_vnni`, `amx_bf16`, ...); empty where the system does not say.

    The kernel lists a flag only when it also enables the feature for programs, so a listed flag can be used.
    """
    return frozenset((_cpuinfo_field("flags") or "").split())


def cpu_model() -> str | None:
    """The CPU's model name, e.g. `Intel(R) Xeon(R) Processor`; None where the system does not say."""
    return _cpuinfo_field("model name") or None


def native_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AMX or AVX-512 bf16): there bf16 products pay."""
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})
