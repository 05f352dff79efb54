"""`VIASD_KERNELS`: which of viasd's kernels may run. Unset or `on`: all where they apply; `off`: none, every
operation is its torch reference; or a comma list of kernels to leave out, e.g. `-fused,-attention` (to measure
what one kernel brings)."""

from __future__ import annotations

import functools
import os

from viasd.errors import ViasdError

SWITCH = "VIASD_KERNELS"
KERNELS = ("w4a8", "w6a8", "w8a8", "bf16", "bf16native", "attention", "fused")
OFF = f"switched off ({SWITCH})"


@functools.cache
def parse(text: str) -> frozenset[str]:
    """The kernels that `text`, a value of VIASD_KERNELS, switches off; a one-line ViasdError for anything else."""
    value = text.strip().lower()
    if value in ("", "on", "1", "all"):
        return frozenset()
    if value in ("off", "0", "none"):
        return frozenset(KERNELS)
    off = set()
    for part in (p.strip() for p in value.split(",")):
        name = part.removeprefix("-")
        if not part.startswith("-") or name not in KERNELS:
            raise ViasdError(
                f"{SWITCH}={text!r}: write on, off, or kernels to leave out like -fused,-attention "
                f"(kernels: {', '.join(KERNELS)})"
            )
        off.add(name)
    return frozenset(off)


def switched_off(kernel: str) -> bool:
    """Whether VIASD_KERNELS leaves `kernel` out (read at each call: a test or benchmark may change it)."""
    return kernel in parse(os.environ.get(SWITCH, ""))
