"""The attention of a short pass of a bf16 model as one C call: rotary embedding, cache write, attention.

In a decoding step of the 1.5B target's 4-bit view, the attention part of the layers (rotary embedding of queries
and keys, the cache update, packed attention and the reshapes around it) cost 3-5 ms of a 42 ms step in torch
ops at 256 tokens of context, most of it per-operation overhead. `PassAttention` does all of it in one call of the
kernel in `short_attention.c` (built once per machine, checked against `reference` when loaded). The cache
entries it writes are torch's bits; the attention is computed per query row in float32 in an order of its own,
so it agrees with torch to bf16 rounding and gives each row the same bits whatever block the row came in.

Only for bf16 (the dtype real models run in on a CPU) and caches of `GrowingLayer`s; `VIASD_ATTENTION_KERNEL=off`
keeps torch's operations (which float32 and float64 models always use, bit-identical to the model's forward).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import rotate_half  # Qwen2's has the same code

from viasd.kernels.build import Build, checked_kernel, status
from viasd.passes.cache_layer import GrowingLayer

SWITCH = "VIASD_ATTENTION_KERNEL"
MAX_DIM, MAX_GROUP, LANES = 256, 16, 16  # head dims (multiples of LANES) and query heads per key/value head
BUILDS: tuple[Build, ...] = (
    ("avx512", ("avx512f", "avx512bw", "avx512vl", "fma"), ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma")),
    ("avx2", ("avx2", "fma"), ("-mavx2", "-mfma")),
)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding as transformers' Llama and Qwen2 apply it (x [1, heads, M, dim], cos and sin
    [1, 1, M, dim])."""
    return (x * cos) + (rotate_half(x) * sin)


def reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layer: GrowingLayer,
    heads: int,
    dim: int,
    scale: float,
) -> torch.Tensor:
    """What `PassAttention` computes, in torch operations (the short loop's own; models/attention.py's packing): query
    [M, heads * dim], key and value [M, kv_heads * dim], cos and sin [M, dim]; out [M, heads * dim]."""
    length = query.shape[0]
    shape = (1, length, -1, dim)
    q = rotated(query.view(shape).transpose(1, 2), cos[None, None], sin[None, None])
    k = rotated(key.view(shape).transpose(1, 2), cos[None, None], sin[None, None])
    k, v = layer.update(k, value.view(shape).transpose(1, 2))
    kv_heads, past = k.shape[1], k.shape[2] - length
    groups = heads // kv_heads
    mask = None
    if length > 1:  # query m (position past + m) sees keys 0 .. past + m; a single query all (as transformers)
        mask = torch.ones(length, past + length, dtype=torch.bool, device=q.device).tril(diagonal=past)
        mask = mask.repeat(groups, 1)
    packed = q.reshape(1, kv_heads, groups * length, dim)
    out = F.scaled_dot_product_attention(packed, k, v, attn_mask=mask, scale=scale)
    return out.reshape(heads, length, dim).transpose(0, 1).reshape(length, heads * dim)


def kernel_status() -> str:
    """`compiled` when the kernel is in use for bf16 short passes, `off` when switched off, else why there is none."""
    if _switched_off():
        return "off"
    return status(_kernel())


def _switched_off() -> bool:
    return os.environ.get(SWITCH, "").strip().lower() in ("0", "off", "no", "false")


def applies(dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> bool:
    """Whether `PassAttention` takes a model of this dtype and attention shape here (and is not switched off)."""
    if _switched_off():
        return False
    shape_fits = dim % LANES == 0 and dim <= MAX_DIM and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP
    return dtype == torch.bfloat16 and shape_fits and isinstance(_kernel(), ctypes.CDLL)


class PassAttention:
    """The kernel set up for the layers of one short pass: its rotary tables cos and sin [M, dim] and the model's
    attention shape. Calling it does one layer's attention (`reference`'s result), kept lean: it runs per layer."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, heads: int, dim: int, scale: float,
                 kernel: ctypes.CDLL | None = None) -> None:  # fmt: skip
        found = kernel or _kernel()
        assert isinstance(found, ctypes.CDLL), "the attention kernel is not available here (see `applies`)"
        self.function = found.short_attention
        self.cos, self.sin = cos.contiguous(), sin.contiguous()  # kept alive: the kernel reads their memory
        self.heads, self.dim, self.scale = heads, dim, scale
        self.threads = torch.get_num_threads()

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: GrowingLayer
    ) -> torch.Tensor:
        """Rotated keys and the values written into `layer`, out [M, heads * dim] bf16. The rows of query, key and
        value may be strided (columns of one fused projection); the elements of a row must be side by side."""
        length, dim = query.shape[0], self.dim
        kv_heads = key.shape[1] // dim
        if query.stride(1) != 1 or key.stride(1) != 1 or value.stride(1) != 1:
            raise ValueError("the attention kernel needs each row's elements side by side")
        # Room for the pass's entries after the layer's; the kernel writes them (stores: [1, kv, capacity, dim]).
        past = layer.reserve((1, kv_heads, length, dim), key.dtype, key.device)
        keys, values = layer.stores()
        out = torch.empty(length, self.heads * dim, dtype=query.dtype)
        status = self.function(query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0), value.data_ptr(),
                               value.stride(0), self.cos.data_ptr(), self.sin.data_ptr(), keys.data_ptr(),
                               values.data_ptr(), keys.shape[-2], past, length, self.heads, kv_heads, dim, self.scale,
                               out.data_ptr(), self.threads)  # fmt: skip
        if status != 0:
            layer.crop(-length)  # the layer keeps what it had: the pass's positions were reserved, not written
            if status == -1:
                raise MemoryError("the attention kernel could not allocate its scratch memory")
            raise ValueError(f"the attention kernel does not take {self.heads} heads over {kv_heads} of dim {dim}")
        return out


@functools.cache
def _kernel() -> ctypes.CDLL | str:
    """The compiled kernel, checked, or why there is none (a sentence); built once per machine and source."""
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    argtypes = [pointer, size, pointer, size, pointer, size, pointer, pointer, pointer, pointer, size, size, size,
                size, size, size, ctypes.c_float, pointer, ctypes.c_int]  # fmt: skip
    return checked_kernel(
        "attention.c", BUILDS, "attention", "short_attention", argtypes, _self_check, ("bf16_vectors.h",)
    )


def _self_check(kernel: ctypes.CDLL) -> str | None:
    """Why the kernel cannot be trusted on this machine, or None: over a cache of 40 positions and blocks of 1 to 5
    queries (strided like a fused projection's columns, a tail of scores that is not a whole vector), its cache
    entries must be torch's and its outputs torch's to bf16 rounding, each row the same whatever its block."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, past = 6, 2, 32, 40
    fused = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=generator).bfloat16()
    query, key, value = fused.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    angles = torch.randn(5, dim // 2, generator=generator)
    cos, sin = torch.cat([angles.cos()] * 2, 1).bfloat16(), torch.cat([angles.sin()] * 2, 1).bfloat16()
    prefix = torch.randn(2, 1, kv_heads, past, dim, generator=generator).bfloat16()

    def layer() -> GrowingLayer:
        fresh = GrowingLayer()
        fresh.update(prefix[0], prefix[1])
        return fresh

    torch_layer, own_layer = layer(), layer()
    want = reference(query, key, value, cos, sin, torch_layer, heads, dim, dim**-0.5)
    got = PassAttention(cos, sin, heads, dim, dim**-0.5, kernel)(query, key, value, own_layer)
    if not (torch.equal(torch_layer.keys, own_layer.keys) and torch.equal(torch_layer.values, own_layer.values)):
        return "writes other cache entries than torch"
    if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
        return "disagrees with torch's attention"
    for rows in range(1, 5):
        attention = PassAttention(cos[:rows], sin[:rows], heads, dim, dim**-0.5, kernel)
        part = attention(query[:rows], key[:rows], value[:rows], layer())
        if not torch.equal(part, got[:rows]):
            return "gives a query other bits in another block"
    return None
