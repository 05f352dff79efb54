"""Which of viasd's kernels run in this process, and why the others do not: for statistics, run records and
`auto`'s probe key."""

from __future__ import annotations

from viasd.kernels import attention, bf16, bf16_native, fused_layers, w4a8, w6a8, w8a8


def kernel_states() -> dict[str, str]:
    """Per kernel, `compiled (BUILD)` or why it is not used (`switched off (VIASD_KERNELS)`, no compiler, ...)."""
    return {
        "w4a8": w4a8.kernel_status(),
        "w6a8": w6a8.kernel_status(),
        "w8a8": w8a8.kernel_status(),
        "bf16": bf16.kernel_status(),
        "bf16native": bf16_native.kernel_status(),
        "attention": attention.kernel_status(),
        "fused": fused_layers.kernel_status(),
    }
