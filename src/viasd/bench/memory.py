"""Peak memory of one generation: the process's resident-set high-water mark, and CUDA's allocator peak.

tracemalloc sees only Python allocations, not torch's tensors, so the resident set is read from the
kernel instead. On Linux its high-water mark (VmHWM) can be reset per generation through
/proc/self/clear_refs; elsewhere, or where that file is not writable, the figure is the peak of the
whole process so far (`scope` says which).
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def rss_high_water() -> int | None:
    """The process's peak resident set in bytes (Linux VmHWM, else getrusage's ru_maxrss)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def reset_rss_high_water() -> bool:
    """Reset VmHWM to the current resident set (Linux >= 4.0); False where that is not possible."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Measures the peak memory of a block of work: call `reset()` before it and `read()` after it."""

    def __init__(self, device: str = "cpu") -> None:
        self.cuda = str(device).startswith("cuda")
        self.scope = "generation"

    def reset(self) -> None:
        if not reset_rss_high_water():
            self.scope = "process"
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def read(self) -> dict[str, int | str | None]:
        """{"peak_rss_bytes", "peak_cuda_bytes" (None without CUDA), "memory_scope"}."""
        cuda = None
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            cuda = int(torch.cuda.max_memory_allocated())
        return {"peak_rss_bytes": rss_high_water(), "peak_cuda_bytes": cuda, "memory_scope": self.scope}
