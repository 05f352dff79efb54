"""bf16 weights x bf16 activations on CPUs with AVX-512 BF16 (`bf16_native.c`): products of a few tokens at the
rate memory streams the weights, where torch's bf16 product of one token reaches about half of it.

Each output row of weights is read once for the whole block, and each token gets the same bits whatever block it
came in. The reference is float32 arithmetic of the (exact) widened inputs: the kernel adds in another order, so it
agrees to float32 rounding. Used by kernels/bf16_linear.py.
"""

from __future__ import annotations

import functools

import torch

from viasd.kernels.build import Library, address, checked, library, status, usable
from viasd.kernels.cpu import cpu_flags
from viasd.kernels.interface import OK

NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")  # what the CPU must report before the kernel is called


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] bf16 @ weight [out, in] bf16 ^T in float32."""
    return x.float() @ weight.float().T


def _call(library: Library, x: torch.Tensor, weight: torch.Tensor, threads: int) -> tuple[int, torch.Tensor]:
    """The kernel's status and x @ weight^T in float32 (whatever the kernel wrote: check the status)."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    status = library.lib.bf16_native_linear(
        address(x), x.shape[0], x.shape[1], address(weight), weight.shape[0], address(out), threads
    )
    return int(status), out


def _run(library: Library, x: torch.Tensor, weight: torch.Tensor, threads: int) -> torch.Tensor:
    return _call(library, x, weight, threads)[1]  # shapes the check at load saw taken (any rows, inputs, outputs)


def _self_check(library: Library) -> str | None:
    """Why the kernel cannot be trusted here, or None: the compiler made it, it agrees with float64 arithmetic, and
    it gives each token the same bits in every block."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(41, 1000, generator=generator).bfloat16()  # 1000: steps of 32 and a masked tail; 41: odd
    x = torch.randn(11, 1000, generator=generator).bfloat16()  # 11: a whole block of 8 and a remainder
    want = x.double() @ weight.double().T
    status, got = _call(library, x, weight, 2)
    if status != OK:
        return "was not made by this compiler (it lacks AVX-512 BF16)"
    if (got.double() - want).abs().max() > 1e-4 * want.abs().max():
        return "disagrees with float arithmetic"
    if not all(torch.equal(_run(library, x[:rows].contiguous(), weight, 2), got[:rows]) for rows in range(1, 11)):
        return "gives a token other bits in another block"
    return None


@functools.cache
def compiled() -> Library | str:
    """The compiled kernel, checked once per process (whatever VIASD_KERNELS says), or why there is none. A CPU
    without AVX-512 BF16 is no fault: the kernel is simply not for it."""
    missing = [flag for flag in NEEDS if flag not in cpu_flags()]
    if missing and isinstance(library(), Library):  # a library that cannot be had says why, as for every kernel
        return f"not for this CPU (it lacks {', '.join(missing)})"
    return checked("bf16native", _self_check)


def kernel() -> Library | str:
    """The compiled kernel, checked once per process, or why it is not used (a sentence)."""
    return usable("bf16native", compiled)


def kernel_status() -> str:
    """`compiled (BUILD)` when the kernel is there to use, else why not."""
    return status(kernel())


def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] bf16 (contiguous) @ weight^T in float32: the kernel where it runs, else `reference`."""
    found = kernel()
    if isinstance(found, Library):
        return _run(found, x, weight, torch.get_num_threads())
    return reference(x, weight)
