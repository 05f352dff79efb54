"""What viasd's low-bit formats share in Python (the formats themselves: w4a8.py, w6a8.py, w8a8.py; their table:
formats.py; their C driver: lowbit.c): the call of a format's kernel, the load-time check every format's kernel must
pass, and the product that runs the kernel where it is there and the format's torch reference where it is not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from viasd.kernels.build import Library, address, build_fault
from viasd.kernels.interface import NO_MEMORY, OK
from viasd.kernels.notice import warn_once
from viasd.kernels.switch import OFF

Run = Callable[[torch.Tensor, Any, int], torch.Tensor]  # (x, weights, threads) -> x @ W^T by a kernel


def self_check(run: Run, reference: Callable[[torch.Tensor, Any], torch.Tensor], weights: Any) -> str | None:
    """Why a kernel cannot be trusted here, or None: on `weights` (rows that are not whole tiles), blocks of 1 to 17
    tokens (past one tile call's) must match `reference` and give each token the same bits in every block and with
    any number of threads."""
    generator = torch.Generator().manual_seed(1)
    k = weights.k
    x = torch.randn(17, k, generator=generator) * torch.linspace(0.1, 4.0, k)
    want = reference(x, weights)
    got = run(x, weights, 2)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
        return "disagrees with the reference product"
    for start, size in ((0, 1), (16, 1), (3, 5), (1, 8), (2, 9), (0, 16)):
        if not torch.equal(run(x[start : start + size].contiguous(), weights, 2), got[start : start + size]):
            return "gives a token other bits in another block"
    if not torch.equal(run(x, weights, 1), got):
        return "gives other bits with another number of threads"
    return None


def run(function: str, name: str, library: Library, x: torch.Tensor, weights: Any, threads: int,
        bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x (`kernel_input`) @ W^T + bias (float32) by the format's C `function` (every low-bit kernel takes x, whether
    it is bf16, its shape, the weights' tensors, their rows, the bias, the output and the threads), in x's dtype;
    `name` is the kernel's in messages."""
    if x.shape[1] != weights.k:
        raise ValueError(f"the {name} kernel does not take {x.shape[1]} inputs for weights of {weights.k}")
    out = torch.empty(x.shape[0], weights.n, dtype=x.dtype)
    pointers = [address(t) for t in weights.tensors()]
    status = getattr(library.lib, function)(address(x), x.dtype == torch.bfloat16, x.shape[0], x.shape[1], *pointers,
                                            weights.n, address(bias), address(out), threads)  # fmt: skip
    if status == NO_MEMORY:
        raise MemoryError(f"the {name} kernel could not allocate its scratch memory")
    if status != OK:
        raise ValueError(f"the {name} kernel does not take {x.shape[1]} inputs")
    return out


def kernel_input(x: torch.Tensor) -> torch.Tensor:
    """x as viasd's low-bit kernels take it: contiguous float32 or bf16 (a bf16 model's activations as they come);
    other dtypes as float32. Their output has the same dtype."""
    return (x if x.dtype in (torch.float32, torch.bfloat16) else x.float()).contiguous()


def product(
    x: torch.Tensor,
    weights: Any,
    bias: torch.Tensor | None,
    found: Library | str,
    run: Callable[[Library, torch.Tensor, Any, int, torch.Tensor | None], torch.Tensor],
    reference: Callable[[torch.Tensor, Any], torch.Tensor],
    name: str,
) -> torch.Tensor:
    """x [rows, in] @ W^T + bias in x's dtype, computed in float32 and rounded once: by `run` with the kernel
    `found` on a CPU where it is there, else by `reference`, saying once why (unless switched off, or said already
    as the fault of the kernels' build)."""
    if x.device.type == "cpu":
        if isinstance(found, Library):
            b = None if bias is None else bias.float().contiguous()
            return run(found, kernel_input(x), weights, torch.get_num_threads(), b).to(x.dtype)
        if found != OFF and found != build_fault():
            warn_once(f"{name} products run on torch ops, slowly: {found}")
    out = reference(x.float(), weights)
    return (out if bias is None else out + bias.float()).to(x.dtype)
