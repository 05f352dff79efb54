"""torch's weight-only CPU kernels as the quantized layers call them, each behind a check of what it would crash on.

These kernels check little of what they read. `_weight_int8pack_mm` reads its activations and int8 weights with
aligned vector loads, 16 inputs at a time on AVX-512 (8 on AVX2), from rows it finds by pointer arithmetic: an
operand that is not aligned, or rows whose length is not a multiple of 16, kill the process with a segmentation
fault or read past the rows (a wrong answer, no error). `_weight_int4pack_mm_for_cpu` never checks its scales'
layout, dtype or length along the input. So before every call the operands are checked here: what a copy makes
acceptable (a misaligned or strided tensor) is copied into memory torch allocated, as torch's own ops call
`.contiguous()` on what their kernels cannot take; what no copy can (a dtype, a shape) is a one-line ViasdError.
"""

from __future__ import annotations

import torch

from viasd.errors import ViasdError

# Bytes: where torch's CPU allocator starts every tensor it makes, and what its kernels' aligned loads rely on.
ALIGNMENT = 64
# Inputs per step of torch's int8 weight-only kernel (AVX-512: one aligned load of 16 int8 weights, 16 bf16 inputs).
INT8_STEP = 16
_ACTIVATIONS = (torch.bfloat16, torch.float16, torch.float32)


def is_aligned(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is contiguous and starts where torch's allocator starts a tensor (CPU memory)."""
    return tensor.is_contiguous() and (not tensor.is_cpu or tensor.data_ptr() % ALIGNMENT == 0)


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or where it is strided or starts off `ALIGNMENT` (a view into a file read by safetensors, a slice)
    a contiguous copy in memory torch allocated."""
    if is_aligned(tensor):
        return tensor
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return out.copy_(tensor)


def int8_weight_only_fault(in_features: int) -> str | None:
    """Why torch's int8 weight-only kernel cannot take weights of `in_features` inputs, or None."""
    if in_features % INT8_STEP:
        return f"{in_features} input features are not a multiple of {INT8_STEP}, the inputs its kernel reads per step"
    return None


def _refuse(kind: str, fault: str) -> ViasdError:
    return ViasdError(f"torch's {kind} weight-only product cannot take these operands: {fault}")


def int8_weights(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [out, in] int8 and `scale` [out] (float32, bf16 or fp16) as torch's int8 weight-only kernel takes
    them: aligned copies where they are not; a one-line ViasdError for what it cannot take."""
    if weight.dim() != 2 or scale.dim() != 1 or scale.shape[0] != weight.shape[0]:
        raise _refuse("int8", f"weights {tuple(weight.shape)} with scales {tuple(scale.shape)}")
    if weight.dtype != torch.int8 or scale.dtype not in _ACTIVATIONS:
        raise _refuse("int8", f"weights in {weight.dtype} with scales in {scale.dtype}")
    if weight.device != scale.device:
        raise _refuse("int8", f"weights on {weight.device} with scales on {scale.device}")
    fault = int8_weight_only_fault(weight.shape[1])
    if fault is not None:
        raise _refuse("int8", fault)
    return aligned(weight), aligned(scale)


def int8_weight_only(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ (weight * scale)^T in x's dtype by torch's `_weight_int8pack_mm`, for `weight` and `scale` as
    `int8_weights` gave them. x is checked at every call: a misaligned or strided x is copied, one the kernel
    cannot take (scale's dtype, the weights' inputs) is a one-line ViasdError."""
    if x.dim() != 2 or x.shape[1] != weight.shape[1] or x.dtype != scale.dtype:
        raise _refuse("int8", f"activations {tuple(x.shape)} in {x.dtype} for weights {tuple(weight.shape)}")
    return torch.ops.aten._weight_int8pack_mm(aligned(x), weight, scale)


def int4_weights(
    packed: torch.Tensor, group_size: int, scales_zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU int4 layout (packed [out, in / 2] uint8; scales and zeros [in / group, out, 2] bf16) as its
    kernel takes it: aligned copies where they are not; a one-line ViasdError for what it cannot take."""
    if packed.dim() != 2 or packed.dtype != torch.uint8 or scales_zeros.dtype != torch.bfloat16:
        raise _refuse("int4", f"weights {tuple(packed.shape)} in {packed.dtype} with scales in {scales_zeros.dtype}")
    rows, columns = packed.shape[0], packed.shape[1] * 2
    if group_size not in (32, 64, 128, 256) or columns % group_size:
        raise _refuse("int4", f"{columns} inputs in groups of {group_size}")
    if tuple(scales_zeros.shape) != (columns // group_size, rows, 2):
        raise _refuse("int4", f"scales {tuple(scales_zeros.shape)} for {rows} rows of {columns} inputs")
    return aligned(packed), aligned(scales_zeros)


def int4_weight_only(
    x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_zeros: torch.Tensor
) -> torch.Tensor:
    """x [rows, in] bf16 @ W^T by torch's `_weight_int4pack_mm_for_cpu`, for weights as `int4_weights` gave them;
    x is checked at every call (as `int8_weight_only`)."""
    if x.dim() != 2 or x.shape[1] != packed.shape[1] * 2 or x.dtype != torch.bfloat16:
        raise _refuse("int4", f"activations {tuple(x.shape)} in {x.dtype} for weights {tuple(packed.shape)}")
    return torch.ops.aten._weight_int4pack_mm_for_cpu(aligned(x), packed, group_size, scales_zeros)
