"""int4 weights x int8 activations: the packing, the product, and the CPU kernel that makes it fast.

The layout and the maths are in `w4a8.c`. On an x86 CPU with AVX-512 VNNI or AVX2 the product is that C
kernel (in viasd's kernel library, kernels/build.py), checked against `reference` before first use; everywhere
else (no compiler, another CPU, CUDA, `VIASD_KERNELS=off`) `reference` computes the same numbers with torch ops,
more slowly. Both give every row (token)
a result that does not depend on the other rows of its block.
"""

from __future__ import annotations

import functools

import torch

from viasd.kernels.build import Library, address, checked, sizes, status, usable
from viasd.kernels.notice import warn_once
from viasd.kernels.switch import OFF

GROUP = sizes()["VIASD_GROUP"]  # inputs per scale and minimum (weights) and per step (activations)
CHUNK = sizes()["VIASD_CHUNK"]  # inputs per 32 packed bytes: two groups, one in each nibble


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [out, in] (0..15) as packed [out, in/2] uint8: per chunk of 64 inputs, byte j holds code j in its low
    nibble and code 32 + j in its high one (a GGUF Q4_K block's own order)."""
    rows, columns = codes.shape
    chunks = codes.to(torch.uint8).reshape(rows, columns // CHUNK, CHUNK)
    packed = chunks[..., : CHUNK // 2] | (chunks[..., CHUNK // 2 :] << 4)
    return packed.reshape(rows, columns // 2).contiguous()


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight` [out, in] as 4-bit codes in groups of 32 inputs: packed [out, in/2] uint8, scale and low
    [out, in/32] fp16, so that w ~ low + code * scale (the group's range in 16 steps)."""
    rows, columns = weight.shape
    groups = weight.detach().float().reshape(rows, columns // GROUP, GROUP)
    low = groups.amin(dim=-1).half()
    scale = ((groups.amax(dim=-1) - low.float()) / 15.0).clamp_min(1e-6).half()
    codes = torch.round((groups - low.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
    return pack_codes(codes.reshape(rows, columns)), scale.contiguous(), low.contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The codes [out, in/32, 32] of `pack`'s packed bytes, group by group."""
    chunks = packed.reshape(packed.shape[0], -1, CHUNK // 2)
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=-1).reshape(packed.shape[0], -1, GROUP)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The float32 weight [out, in] that the packed codes, scales and minimums stand for."""
    weight = low.float()[..., None] + unpack(packed).float() * scale.float()[..., None]
    return weight.reshape(packed.shape[0], -1)


def reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32 @ W^T by the kernel's arithmetic, in torch ops: float32 [rows, out].

    The integer dot products are exact in float32 (at most 32 * 15 * 127), so how torch blocks the matrix
    product cannot change them; each output then sums its own contiguous row of per-group terms, in an order
    that does not depend on the other rows of the block. Rows go a few at a time to bound the memory.
    """
    weights = unpack(packed).float().transpose(0, 1).transpose(1, 2)  # [G, 32, out]
    return torch.cat([_reference_rows(chunk, weights, scale, low) for chunk in x.split(8)])


def activation_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] quantized per row and group of 32 as the kernels do: the codes [rows, G, 32] (integers in
    float32) and each group's step max|x| / 127 [rows, G]."""
    rows, columns = x.shape
    groups = x.reshape(rows, columns // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1)
    # A true division, as the kernels make it (torch computes a number over a tensor through a reciprocal).
    inverse = torch.where(amax > 0, amax.new_tensor(127.0) / amax, torch.zeros_like(amax))
    return torch.round(groups * inverse[..., None]), amax / 127.0


def _reference_rows(x: torch.Tensor, weights: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    codes, step = activation_codes(x)  # [rows, G, 32], [rows, G]
    dots = torch.bmm(codes.transpose(0, 1), weights).permute(1, 2, 0)  # [rows, out, G]
    terms = dots * scale.float()[None] * step[:, None, :] + low.float()[None] * (codes.sum(-1) * step)[:, None, :]
    return terms.contiguous().sum(dim=-1)


@functools.cache
def compiled() -> Library | str:
    """The compiled kernel, checked once per process (whatever VIASD_KERNELS says), or why there is none."""
    return checked("int4 x int8", _self_check)


def kernel() -> Library | str:
    """The compiled kernel, checked once per process, or why it is not used (a sentence)."""
    return usable("w4a8", compiled)


def kernel_input(x: torch.Tensor) -> torch.Tensor:
    """x as viasd's low-bit kernels take it: contiguous float32 or bf16 (a bf16 model's activations as they come);
    other dtypes as float32. Their output has the same dtype."""
    return (x if x.dtype in (torch.float32, torch.bfloat16) else x.float()).contiguous()


def _run(library: Library, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
         threads: int, bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x (`kernel_input`) @ W^T + bias (float32) by the kernel, in x's dtype."""
    out = torch.empty(x.shape[0], packed.shape[0], dtype=x.dtype)
    status = library.lib.w4a8_linear(address(x), x.dtype == torch.bfloat16, x.shape[0], x.shape[1], address(packed),
                                     address(scale), address(low), packed.shape[0], address(bias), address(out),
                                     threads)  # fmt: skip
    if status != 0:
        raise MemoryError("the int4 x int8 kernel could not allocate its scratch memory")
    return out


def _self_check(library: Library) -> str | None:
    """Why the kernel cannot be trusted on this machine, or None: a small product (whole 8-chunk blocks and a
    tail, blocks of 1 to 6 tokens) must match `reference` and give each token the same bits in every block."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 832, generator=generator)
    x = torch.randn(6, 832, generator=generator) * torch.linspace(0.1, 4.0, 832)
    packed, scale, low = pack(weight)
    want = reference(x, packed, scale, low)
    got = _run(library, x, packed, scale, low, 2)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
        return "disagrees with the reference product"
    for rows in range(1, 6):
        if not torch.equal(_run(library, x[:rows].contiguous(), packed, scale, low, 2), got[:rows]):
            return "gives a token other bits in another block"
    return None


def kernel_status() -> str:
    """`compiled (BUILD)` when the fast CPU kernel is in use, else why not."""
    return status(kernel())


def product(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [rows, in] @ W^T + bias [rows, out] in x's dtype, computed in float32 and rounded once: the C kernel on a
    capable CPU, else `reference`."""
    if x.device.type == "cpu":
        found = kernel()
        if isinstance(found, Library):
            b = None if bias is None else bias.float().contiguous()
            return _run(found, kernel_input(x), packed, scale, low, torch.get_num_threads(), b).to(x.dtype)
        if found != OFF:
            warn_once(f"int4 x int8 products run on torch ops, slowly: {found}")
    out = reference(x.float(), packed, scale, low)
    return (out if bias is None else out + bias.float()).to(x.dtype)
