"""Preparing a loaded model for viasd's passes: once, after loading, before the first pass.

On a CPU: grouped-query attention of short passes packs each key/value head's query heads into one block
(kernels/packed_attention.py), and bf16 Linear layers compute short passes through viasd's kernels where torch's bf16
products are slow: CPUs without bf16 matrix instructions, and those with AVX-512 BF16 but no AMX
(kernels/bf16_linear.py). Both keep the model's modules, weights and names; other devices are left as
they are. A model on a CPU also has the process keep the memory its passes free (passes/allocator.py). Whether
viasd's loop runs the model is read then too, once (passes/loop.py `covers`), and whether the fused stack computes
its layers (passes/fused.py `why_not`) and agrees with viasd's decoder layer (its check on a tiny model of its own,
once per process), so that gathering a pass's facts (passes/facts.py) builds nothing.
"""

from __future__ import annotations

from torch import nn

from viasd.kernels.bf16_linear import use_bf16_kernel
from viasd.kernels.packed_attention import use_packed_attention
from viasd.passes import fused
from viasd.passes.allocator import keep_freed_memory
from viasd.passes.loop import remember_covers


def prepare(model: nn.Module) -> nn.Module:
    """`model`, prepared in place for viasd's passes (see above); returned for convenience."""
    use_bf16_kernel(model)  # bf16 products of a few tokens at the rate memory streams the weights
    use_packed_attention(model)  # grouped-query attention of short passes on a CPU: one query block per group
    remember_covers(model)  # whether viasd's loop runs it, read while no view is applied (passes/loop.py)
    if next(model.parameters()).device.type == "cpu":
        keep_freed_memory()  # a prompt's activations reuse hot pages instead of faulting fresh ones in
    fused.remember(model)  # whether the fused stack computes its layers (its family, its agreement: passes/fused.py)
    return model
