"""bf16 Linear layers on a CPU: viasd's kernels for passes of a few tokens (a decoding step, a verification block).

Without AVX-512 BF16 or AMX, torch multiplies a block of M tokens with bf16 weights at about M times the cost of
one token (9.3x for M = 9 on an AVX2 EPYC), which makes every speculative method slower than plain decoding
there. `use_bf16_kernel` switches a loaded model's bf16 Linear layers to `CpuBf16Linear`, the same modules with
the same weights (no copy), whose passes of up to MAX_ROWS tokens run on kernels/bf16.py's kernel: the weights
are read once per block, and each token's output is the same whatever block it came in. Longer passes (a prompt)
widen the weights to float32 for one float32 product, which is faster than the kernel from about a hundred tokens
on and than torch's bf16 product at any length there (per [M, 1536] x [1536, 8960] product at M = 512: 146 ms,
kernel 238, torch's bf16 804).

With AVX-512 BF16 but no AMX (Zen 4 and later), torch's bf16 product of one token streams the weights at about
half the rate memory allows (14-19 GB/s on a 2-core Zen 4, where the kernel below reads 25-30; 28 layers' distinct
weights, `scripts/bf16_product_rates.py`), and a decoding step of a dense model is little else. There
`NativeBf16Linear` runs passes of up to NATIVE_MAX_ROWS tokens on kernels/bf16_native.py's kernel (one token's
product in 0.6-0.74x torch's time, 4-8 tokens' in 0.54-0.67x, 16 in 0.8x, 20-40 in 0.86-0.95x), each token's bits
again independent of its block; longer passes (a prompt) stay with torch's bf16 product, which its own kernels make
fast there. With AMX torch stays in charge (its AMX products of a block beat a streaming kernel). Other devices stay
with torch.
"""

from __future__ import annotations

import torch
from torch import nn

from viasd.kernels import bf16, bf16_native
from viasd.kernels.build import Library
from viasd.kernels.cpu import cpu_flags

NATIVE_BF16 = ("avx512_bf16", "amx_bf16")  # torch's own bf16 products are fast where these are
MAX_ROWS = 96  # tokens per pass up to which the kernel is used (measured: 65 ms at 128 against 62 widened)
# And the native kernel: every pass of viasd's loop (verification blocks up to 16 tokens), so that a token's bits
# never depend on its block, and longer passes while it costs less than torch's product: a `via` round's catch-up
# block, a short prompt (Zen 4, 28 layers' products: 0.54-0.8x at 4-16 tokens, 0.86-0.95x at 20-40, level at 48;
# whole passes of the dense 1.5B target with logits for every row 0.84-0.94x at 20-40).
NATIVE_MAX_ROWS = 40
# Tokens the native kernel reads each pair of weight rows for at once (BLOCK in kernels/bf16_native.c): a pass of up
# to 8 costs about 1.2 single-token steps of the dense 1.5B target (Zen 4, `scripts/verification_costs.py`), so a
# round that drafts 7 verifies for little more than one that drafts 4.
NATIVE_BLOCK = 8


def wanted() -> bool:
    """Whether bf16 Linear layers on this CPU should use the widening kernel: the CPU lacks bf16 matrix
    instructions, and the kernel compiled, passed its check and is not switched off (VIASD_KERNELS)."""
    flags = cpu_flags()
    return bool(flags) and not any(flag in flags for flag in NATIVE_BF16) and isinstance(bf16.kernel(), Library)


def native_wanted() -> bool:
    """Whether bf16 Linear layers on this CPU should use the AVX-512 BF16 kernel: the CPU has the instructions but
    no AMX, and the kernel compiled, passed its check and is not switched off (VIASD_KERNELS)."""
    return "amx_bf16" not in cpu_flags() and isinstance(bf16_native.kernel(), Library)


def _short_bf16_pass(layer: nn.Linear, x: torch.Tensor) -> int | None:
    """The tokens of a pass that a kernel can take (bf16 weights on the CPU, contiguous, no gradient), else None."""
    weight = layer.weight
    rows = x.numel() // max(x.shape[-1], 1)
    if (x.device.type != "cpu" or weight.dtype != torch.bfloat16 or rows == 0 or not weight.is_contiguous()
            or (torch.is_grad_enabled() and weight.requires_grad)):  # fmt: skip
        return None
    return rows


class CpuBf16Linear(nn.Linear):
    """nn.Linear whose bf16 CPU passes go through viasd's kernel up to MAX_ROWS tokens, through float32 beyond."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _short_bf16_pass(self, x)
        weight = self.weight
        if rows is None:
            return super().forward(x)
        if rows > MAX_ROWS:
            bias = None if self.bias is None else self.bias.float()
            return nn.functional.linear(x.float(), weight.float(), bias).to(x.dtype)
        out = bf16.product(x.reshape(rows, -1).float().contiguous(), weight)
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


class NativeBf16Linear(nn.Linear):
    """nn.Linear whose bf16 CPU passes of up to NATIVE_MAX_ROWS tokens go through the AVX-512 BF16 kernel, longer
    ones through torch's bf16 product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _short_bf16_pass(self, x)
        if rows is None or rows > NATIVE_MAX_ROWS or x.dtype != torch.bfloat16:
            return super().forward(x)
        out = bf16_native.product(x.reshape(rows, -1).contiguous(), self.weight)
        if self.bias is not None:
            out = out + self.bias.float()  # in float32, rounded once with the product, as torch's bf16 product does
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


def cheap_block(model: nn.Module) -> int | None:
    """Tokens per pass that cost `model` about one step, where that is known: NATIVE_BLOCK where its Linear layers
    run on the native kernel; else None."""
    return NATIVE_BLOCK if any(isinstance(module, NativeBf16Linear) for module in model.modules()) else None


def use_bf16_kernel(model: nn.Module) -> int:
    """Switch the model's bf16 CPU Linear layers to `NativeBf16Linear` where `native_wanted()`, else to
    `CpuBf16Linear` where `wanted()`; how many were switched.

    The modules keep their identity, parameters and names (only their class changes), so nothing that holds or
    looks up a layer sees a difference."""
    kind: type[nn.Linear] | None = NativeBf16Linear if native_wanted() else CpuBf16Linear if wanted() else None
    if kind is None:
        return 0
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype == torch.bfloat16 and module.weight.device.type == "cpu":
            module.__class__ = kind
            switched += 1
    return switched
