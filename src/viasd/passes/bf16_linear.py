"""bf16 Linear layers on CPUs without bf16 matrix instructions: viasd's own kernel for passes of a few tokens.

Without AVX-512 BF16 or AMX, torch multiplies a block of M tokens with bf16 weights at about M times the cost of
one token (9.3x for M = 9 on an AVX2 EPYC, BENCHMARKS.md), which makes every speculative method slower than plain
decoding there. `use_bf16_kernel` switches a loaded model's bf16 Linear layers to `CpuBf16Linear`, the same
modules with the same weights (no copy), whose passes of up to MAX_ROWS tokens run on the kernel of `bf16.c`:
the weights are read once per block, and each token's output is the same whatever block it came in. Longer
passes (a prompt) widen the weights to float32 for one float32 product, which is faster than the kernel from
about a hundred tokens on and than torch's bf16 product at any length there (per [M, 1536] x [1536, 8960]
product at M = 512: 146 ms, kernel 238, torch's bf16 804). Other devices stay with torch. `VIASD_BF16_KERNEL=off`
leaves the layers as they are.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
from torch import nn

from viasd.kernels.build import Build, load_kernel
from viasd.kernels.cpu import cpu_flags

BUILDS: tuple[Build, ...] = (("avx2", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),)
NATIVE_BF16 = ("avx512_bf16", "amx_bf16")  # torch's own bf16 products are fast where these are
MAX_ROWS = 96  # tokens per pass up to which the kernel is used (measured: 65 ms at 128 against 62 widened)
SWITCH = "VIASD_BF16_KERNEL"


@functools.cache
def _kernel() -> ctypes.CDLL | str:
    """The compiled kernel, checked against float32 arithmetic, or why there is none (a sentence)."""
    loaded = load_kernel("bf16.c", BUILDS, "bf16")
    if isinstance(loaded, str):
        return loaded
    kernel, name = loaded
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    kernel.bf16_linear.argtypes = [pointer, size, size, pointer, size, pointer, ctypes.c_int]
    kernel.bf16_linear.restype = None
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 1000, generator=generator).bfloat16()  # 1000: whole 16-input steps and a tail
    x = torch.randn(7, 1000, generator=generator)
    want = x.double() @ weight.double().T
    got = _run(kernel, x, weight, 2)
    if (got.double() - want).abs().max() > 1e-4 * want.abs().max():
        return f"the compiled bf16 kernel ({name}) disagrees with float arithmetic; using torch"
    if not all(torch.equal(_run(kernel, x[:rows].contiguous(), weight, 2), got[:rows]) for rows in range(1, 7)):
        return f"the compiled bf16 kernel ({name}) gives a token other bits in another block; using torch"
    return kernel


def _run(kernel: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, threads: int) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    kernel.bf16_linear(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0], out.data_ptr(),
                       threads)  # fmt: skip
    return out


def kernel_status() -> str:
    """`compiled` when the kernel is there to use, else why not."""
    kernel = _kernel()
    return "compiled" if isinstance(kernel, ctypes.CDLL) else kernel


def wanted() -> bool:
    """Whether bf16 Linear layers on this CPU should use the kernel: the CPU lacks bf16 matrix instructions, the
    kernel compiled and passed its check, and `VIASD_BF16_KERNEL` does not say off."""
    if os.environ.get(SWITCH, "").strip().lower() in ("0", "off", "no", "false"):
        return False
    flags = cpu_flags()
    return bool(flags) and not any(flag in flags for flag in NATIVE_BF16) and kernel_status() == "compiled"


class CpuBf16Linear(nn.Linear):
    """nn.Linear whose bf16 CPU passes go through viasd's kernel up to MAX_ROWS tokens, through float32 beyond."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        weight = self.weight
        if (x.device.type != "cpu" or weight.dtype != torch.bfloat16 or rows == 0 or not weight.is_contiguous()
                or (torch.is_grad_enabled() and weight.requires_grad)):  # fmt: skip
            return super().forward(x)
        if rows > MAX_ROWS:
            bias = None if self.bias is None else self.bias.float()
            return nn.functional.linear(x.float(), weight.float(), bias).to(x.dtype)
        kernel = _kernel()
        assert isinstance(kernel, ctypes.CDLL)  # a layer is switched only where the kernel is there
        out = _run(kernel, x.reshape(rows, -1).float().contiguous(), weight, torch.get_num_threads())
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


def use_bf16_kernel(model: nn.Module) -> int:
    """Switch the model's bf16 CPU Linear layers to `CpuBf16Linear` where `wanted()`; how many were switched.

    The modules keep their identity, parameters and names (only their class changes), so nothing that holds or
    looks up a layer sees a difference."""
    if not wanted():
        return 0
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype == torch.bfloat16 and module.weight.device.type == "cpu":
            module.__class__ = CpuBf16Linear
            switched += 1
    return switched
