"""bf16 Linear layers on CPUs without bf16 matrix instructions: viasd's kernel for passes of a few tokens.

Without AVX-512 BF16 or AMX, torch multiplies a block of M tokens with bf16 weights at about M times the cost of
one token (9.3x for M = 9 on an AVX2 EPYC), which makes every speculative method slower than plain decoding
there. `use_bf16_kernel` switches a loaded model's bf16 Linear layers to `CpuBf16Linear`, the same modules with
the same weights (no copy), whose passes of up to MAX_ROWS tokens run on kernels/bf16.py's kernel: the weights
are read once per block, and each token's output is the same whatever block it came in. Longer passes (a prompt)
widen the weights to float32 for one float32 product, which is faster than the kernel from about a hundred tokens
on and than torch's bf16 product at any length there (per [M, 1536] x [1536, 8960] product at M = 512: 146 ms,
kernel 238, torch's bf16 804). Other devices stay with torch.
"""

from __future__ import annotations

import torch
from torch import nn

from viasd.kernels import bf16
from viasd.kernels.build import Library
from viasd.kernels.cpu import cpu_flags

NATIVE_BF16 = ("avx512_bf16", "amx_bf16")  # torch's own bf16 products are fast where these are
MAX_ROWS = 96  # tokens per pass up to which the kernel is used (measured: 65 ms at 128 against 62 widened)


def wanted() -> bool:
    """Whether bf16 Linear layers on this CPU should use the kernel: the CPU lacks bf16 matrix instructions, and
    the kernel compiled, passed its check and is not switched off (VIASD_KERNELS)."""
    flags = cpu_flags()
    return bool(flags) and not any(flag in flags for flag in NATIVE_BF16) and isinstance(bf16.kernel(), Library)


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
        out = bf16.product(x.reshape(rows, -1).float().contiguous(), weight)
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
