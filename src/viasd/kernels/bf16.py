"""bf16 weights x float32 activations (`bf16.c`): products of a few tokens on CPUs without bf16 matrix
instructions, where torch's bf16 product of a block costs about as many single-token products as it has tokens.

Each output row of weights is read once for the whole block, and each token gets the same bits whatever block it
came in. The reference is float32 arithmetic of the widened weights (the kernel adds in another order, so it agrees
to float32 rounding). Used by kernels/bf16_linear.py.
"""

from __future__ import annotations

import functools

import torch

from viasd.kernels.build import Library, address, checked, status, usable


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32 @ weight [out, in] bf16 ^T in float32."""
    return x.float() @ weight.float().T


def _run(library: Library, x: torch.Tensor, weight: torch.Tensor, threads: int) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    library.lib.bf16_linear(address(x), x.shape[0], x.shape[1], address(weight), weight.shape[0], address(out), threads)
    return out


def _self_check(library: Library) -> str | None:
    """Why the kernel cannot be trusted here, or None: it must agree with float64 arithmetic and give each token the
    same bits in every block."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 1000, generator=generator).bfloat16()  # 1000: whole 16-input steps and a tail
    x = torch.randn(7, 1000, generator=generator)
    want = x.double() @ weight.double().T
    got = _run(library, x, weight, 2)
    if (got.double() - want).abs().max() > 1e-4 * want.abs().max():
        return "disagrees with float arithmetic"
    if not all(torch.equal(_run(library, x[:rows].contiguous(), weight, 2), got[:rows]) for rows in range(1, 7)):
        return "gives a token other bits in another block"
    return None


@functools.cache
def compiled() -> Library | str:
    """The compiled kernel, checked once per process (whatever VIASD_KERNELS says), or why there is none."""
    return checked("bf16", _self_check)


def kernel() -> Library | str:
    """The compiled kernel, checked once per process, or why it is not used (a sentence)."""
    return usable("bf16", compiled)


def kernel_status() -> str:
    """`compiled (BUILD)` when the kernel is there to use, else why not."""
    return status(kernel())


def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32 (contiguous) @ weight^T in float32: the kernel where it runs, else `reference`."""
    found = kernel()
    if isinstance(found, Library):
        return _run(found, x, weight, torch.get_num_threads())
    return reference(x, weight)
