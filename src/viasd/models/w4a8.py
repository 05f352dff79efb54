"""int4 weights x int8 activations: the packing, the product, and the CPU kernel that makes it fast.

The layout and the maths are in `w4a8.c`. On an x86 CPU with AVX-512 VNNI the product is that C kernel,
compiled once per machine with the system's C compiler into viasd's cache (atomically) and loaded with ctypes;
everywhere else (no compiler, another CPU, CUDA) `reference` computes the same numbers with torch ops, more
slowly. Both give every row (token) a result that does not depend on the other rows of its block.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from importlib import resources
from pathlib import Path

import torch

from viasd.models.cpu import cpu_flags
from viasd.models.fetch import default_cache_dir

GROUP = 64
_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma")
_COMPILE = ["-O3", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
            "-mf16c", "-mfma", "-ffp-contract=off"]  # fmt: skip


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight` [out, in] as 4-bit codes in groups of 64 inputs: packed [out, in/2] uint8, scale and low
    [out, in/64] fp16, so that w ~ low + code * scale (the group's range in 16 steps)."""
    rows, columns = weight.shape
    groups = weight.detach().float().reshape(rows, columns // GROUP, GROUP)
    low = groups.amin(dim=-1).half()
    scale = ((groups.amax(dim=-1) - low.float()) / 15.0).clamp_min(1e-6).half()
    codes = torch.round((groups - low.float()[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.uint8)
    packed = codes[..., : GROUP // 2] | (codes[..., GROUP // 2 :] << 4)
    return packed.reshape(rows, columns // 2).contiguous(), scale.contiguous(), low.contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The codes [out, in/64, 64] of `pack`'s packed bytes."""
    groups = packed.reshape(packed.shape[0], -1, GROUP // 2)
    return torch.cat([groups & 0x0F, groups >> 4], dim=-1)


def reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """x [rows, in] float32 @ W^T by the kernel's arithmetic, in torch ops: float32 [rows, out].

    The integer dot products are exact in float32 (at most 64 * 15 * 127), so how torch blocks the matrix
    product cannot change them; each output then sums its own contiguous row of per-group terms, in an order
    that does not depend on the other rows of the block. Rows go a few at a time to bound the memory.
    """
    weights = unpack(packed).float().transpose(0, 1).transpose(1, 2)  # [G, 64, out]
    return torch.cat([_reference_rows(chunk, weights, scale, low) for chunk in x.split(8)])


def _reference_rows(x: torch.Tensor, weights: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    rows, columns = x.shape
    groups = x.reshape(rows, columns // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(groups * inverse[..., None])  # [rows, G, 64]
    dots = torch.bmm(codes.transpose(0, 1), weights).permute(1, 2, 0)  # [rows, out, G]
    step = amax / 127.0
    terms = dots * scale.float()[None] * step[:, None, :] + low.float()[None] * (codes.sum(-1) * step)[:, None, :]
    return terms.contiguous().sum(dim=-1)


@functools.cache
def _kernel() -> ctypes.CDLL | str:
    """The compiled kernel, or why there is none (a sentence); built once per machine and source."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the int4 x int8 kernel is for x86 CPUs, this is {platform.machine()}"
    flags = cpu_flags()
    if not flags:
        return "cannot read the CPU's flags (/proc/cpuinfo)"
    missing = [flag for flag in _FLAGS if flag not in flags]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return "no C compiler found (set CC)"
    source = resources.files("viasd.models").joinpath("w4a8.c").read_bytes()
    digest = hashlib.sha256(source + " ".join(_COMPILE).encode()).hexdigest()[:16]
    library = default_cache_dir().parent / "kernels" / f"w4a8-{digest}.so"
    if not library.is_file():
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as work:
            (Path(work) / "w4a8.c").write_bytes(source)
            built = Path(work) / "w4a8.so"
            result = subprocess.run([compiler, *_COMPILE, "w4a8.c", "-o", built.name], cwd=work,
                                    capture_output=True, text=True)  # fmt: skip
            if result.returncode != 0:
                last = (result.stderr.strip().splitlines() or ["no message"])[-1]
                return f"compiling the int4 x int8 kernel failed: {last}"
            os.replace(built, library)  # atomic: other processes see no half-written library
    try:
        kernel = ctypes.CDLL(str(library))
    except OSError as error:
        return f"the compiled int4 x int8 kernel does not load: {error}"
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    kernel.w4a8_linear.argtypes = [pointer, size, size, pointer, pointer, pointer, size, pointer, ctypes.c_int]
    kernel.w4a8_linear.restype = ctypes.c_int
    return kernel


def kernel_status() -> str:
    """`compiled` when the fast CPU kernel is in use, else why not."""
    kernel = _kernel()
    return "compiled" if isinstance(kernel, ctypes.CDLL) else kernel


def product(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ W^T as float32 [rows, out]: the C kernel on a capable CPU, else `reference`."""
    x = x.float().contiguous()
    if x.device.type == "cpu":
        kernel = _kernel()
        if isinstance(kernel, ctypes.CDLL):
            out = torch.empty(x.shape[0], packed.shape[0], dtype=torch.float32)
            rows, columns, outputs = x.shape[0], x.shape[1], packed.shape[0]
            status = kernel.w4a8_linear(x.data_ptr(), rows, columns, packed.data_ptr(), scale.data_ptr(),
                                        low.data_ptr(), outputs, out.data_ptr(), torch.get_num_threads())  # fmt: skip
            if status != 0:
                raise MemoryError("the int4 x int8 kernel could not allocate its scratch memory")
            return out
        warnings.warn(f"int4a8 runs on torch ops, slowly: {kernel}", RuntimeWarning, stacklevel=2)
    return reference(x, packed, scale, low)
