"""keep_freed_memory: a freed activation-sized block comes back without faulting its pages in again."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

# A child process runs what every layer of a 1,000-token prompt of the default target runs in its MLP: two [1000,
# 8960] bf16 products, SiLU, their product (18 MiB each; the products' inner size is cut to keep it fast), then
# counts the page faults of four more such layers. With glibc's defaults the freed blocks go back to the kernel
# and every layer faults its activations in again (measured on the 2-core Xeon: a quarter of a 1,000-token prompt).
CHILD = """
import resource, sys, torch
from viasd.passes.allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
x = torch.ones(1000, 64, dtype=torch.bfloat16)
gate = torch.full((8960, 64), 1e-3, dtype=torch.bfloat16)
up = torch.full((8960, 64), 2e-3, dtype=torch.bfloat16)
def layer():
    return torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
for _ in range(3):  # the first frees move glibc's adaptive thresholds: look at a steady state
    layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    layer()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


# One [1000, 8960] bf16 activation's pages. Kept memory may still grow the heap once in the four layers (seen once in
# CI: where a small allocation lands decides whether a freed block fits the next tensor), which faults in one
# activation; without it the four layers fault in about fourteen.
ACTIVATION_PAGES = 1000 * 8960 * 2 // 4096


def _glibc() -> bool:
    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        return False
    return sys.platform.startswith("linux")


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True).stdout
    kept, faults = out.split()
    return kept, int(faults)


@pytest.mark.skipif(not _glibc(), reason="glibc's malloc only")
def test_a_prompts_activations_reuse_freed_pages() -> None:
    default = _faults("default")[1]
    if default < 4096:  # the control: without it these layers fault in a tensor's pages or more
        pytest.skip(f"this C library kept the memory by itself ({default} page faults)")
    kept, faults = _faults("keep")
    assert kept == "True"
    assert faults < ACTIVATION_PAGES + 256, f"{faults} page faults with freed memory kept, {default} without"
