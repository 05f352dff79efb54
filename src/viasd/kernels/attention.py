"""The attention of a short pass of a bf16 model as one C call (`attention.c`): rotary embedding, cache write,
attention, for one layer.

In a decoding step of the 1.5B target's 4-bit view, the attention part of the layers (rotary embedding of queries
and keys, the cache update, packed attention and the reshapes around it) cost 3-5 ms of a 42 ms step in torch
ops at 256 tokens of context, most of it per-operation overhead. The kernel does it in one call. The cache entries
it writes are torch's bits; the attention is computed per query row in float32 in an order of its own, so it
agrees with torch to bf16 rounding (correctly rounded, where torch's is not always) and gives each row the same
bits whatever block the row came in. `reference` is the same operation in torch's operations: the model's own
arithmetic (transformers' Llama and Qwen2 rotary embedding, with each key/value head's query heads packed into one
block of queries, kernels/packed_attention.py).

Both write the pass's keys (rotated) and values into a layer's stores ([1, kv_heads, capacity, dim], positions
past .. past + M) and attend over positions 0 .. past + M: passes/loop.py reserves the room in the cache layer.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from viasd.kernels.build import Library, address, checked, sizes, status, usable
from viasd.kernels.interface import NO_MEMORY, OK

# Head dims (multiples of LANES, up to MAX_DIM) and query heads per key/value head (up to MAX_GROUP) it takes.
MAX_DIM, MAX_GROUP, LANES = sizes()["VIASD_MAX_HEAD_DIM"], sizes()["VIASD_MAX_GROUP"], sizes()["VIASD_LANES"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The rotary embedding's partner of each dimension: (-second half, first half), as transformers' Llama has it."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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
    stores: tuple[torch.Tensor, torch.Tensor],
    past: int,
    heads: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """One layer's attention in torch operations: query [M, heads * dim], key and value [M, kv_heads * dim], cos
    and sin [M, dim]; the rotated keys and the values written into `stores` at positions past .. past + M; out
    [M, heads * dim]. A `window` > 0 lets each query see only the last `window` positions up to its own."""
    length, dim = query.shape[0], cos.shape[-1]
    shape = (1, length, -1, dim)
    q = rotated(query.view(shape).transpose(1, 2), cos[None, None], sin[None, None])
    k = rotated(key.view(shape).transpose(1, 2), cos[None, None], sin[None, None])
    key_store, value_store = stores
    end = past + length
    key_store[..., past:end, :] = k
    value_store[..., past:end, :] = value.view(shape).transpose(1, 2)
    keys, values = key_store[..., :end, :], value_store[..., :end, :]
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    mask = None
    if length > 1 or 0 < window < end:  # query m (position past + m) sees keys 0 .. past + m; one query all of them
        mask = torch.ones(length, end, dtype=torch.bool, device=q.device).tril(diagonal=past)
        if window > 0:  # ... from past + m - window + 1 on
            mask &= ~torch.ones_like(mask).tril(diagonal=past - window)
        mask = mask.repeat(groups, 1)
    packed = q.reshape(1, kv_heads, groups * length, dim)
    out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(heads, length, dim).transpose(0, 1).reshape(length, heads * dim)


def run(
    library: Library,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    stores: tuple[torch.Tensor, torch.Tensor],
    past: int,
    heads: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """`reference`'s result by the kernel (bf16; cos and sin contiguous). The rows of query, key and value may be
    strided (columns of one fused projection); the elements of a row must be side by side. A shape the kernel
    does not take is a ValueError, with nothing written."""
    length, dim = query.shape[0], cos.shape[-1]
    kv_heads = key.shape[1] // dim
    if query.stride(1) != 1 or key.stride(1) != 1 or value.stride(1) != 1:
        raise ValueError("the attention kernel needs each row's elements side by side")
    key_store, value_store = stores
    out = torch.empty(length, heads * dim, dtype=query.dtype)
    status = library.lib.short_attention(
        address(query), query.stride(0), address(key), key.stride(0), address(value), value.stride(0), address(cos),
        address(sin), address(key_store), address(value_store), key_store.shape[-2], past, length, heads, kv_heads,
        dim, scale, window, address(out), torch.get_num_threads(),
    )  # fmt: skip
    if status == NO_MEMORY:
        raise MemoryError("the attention kernel could not allocate its scratch memory")
    if status != OK:
        raise ValueError(f"the attention kernel does not take {heads} heads over {kv_heads} of dim {dim}")
    return out


def takes(dtype: torch.dtype, heads: int, kv_heads: int, dim: int) -> bool:
    """Whether the kernel takes a model of this dtype and attention shape (bf16, whole vectors, groups it fits)."""
    shape_fits = dim % LANES == 0 and dim <= MAX_DIM and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP
    return dtype == torch.bfloat16 and shape_fits


def _self_check(library: Library) -> str | None:
    """Why the kernel cannot be trusted on this machine, or None: over a cache of 40 positions and blocks of 1 to 5
    queries (strided like a fused projection's columns, a tail of scores that is not a whole vector), its cache
    entries must be torch's and its outputs torch's to bf16 rounding (in a sliding window too), each row the same
    whatever its block."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, past = 6, 2, 32, 40
    fused = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=generator).bfloat16()
    query, key, value = fused.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    angles = torch.randn(5, dim // 2, generator=generator)
    cos, sin = torch.cat([angles.cos()] * 2, 1).bfloat16(), torch.cat([angles.sin()] * 2, 1).bfloat16()
    prefix = torch.randn(2, 1, kv_heads, 64, dim, generator=generator).bfloat16()

    def stores() -> tuple[torch.Tensor, torch.Tensor]:
        return prefix[0].clone(), prefix[1].clone()

    torch_stores, own_stores = stores(), stores()
    want = reference(query, key, value, cos, sin, torch_stores, past, heads, dim**-0.5)
    got = run(library, query, key, value, cos, sin, own_stores, past, heads, dim**-0.5)
    if not all(torch.equal(a, b) for a, b in zip(torch_stores, own_stores, strict=True)):
        return "writes other cache entries than torch"
    if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
        return "disagrees with torch's attention"
    window_stores = stores()  # a sliding window of 7 positions: the last queries see past .. past + m only
    windowed = reference(query, key, value, cos, sin, stores(), past, heads, dim**-0.5, window=7)
    got_windowed = run(library, query, key, value, cos, sin, window_stores, past, heads, dim**-0.5, window=7)
    if not torch.allclose(got_windowed.float(), windowed.float(), rtol=2e-2, atol=2e-2):
        return "disagrees with torch's attention in a sliding window"
    for rows in range(1, 5):
        part = run(library, query[:rows], key[:rows], value[:rows], cos[:rows], sin[:rows], stores(), past, heads,
                   dim**-0.5)  # fmt: skip
        if not torch.equal(part, got[:rows]):
            return "gives a query other bits in another block"
    return None


@functools.cache
def compiled() -> Library | str:
    """The compiled kernel, checked once per process (whatever VIASD_KERNELS says), or why there is none."""
    return checked("attention", _self_check)


def kernel() -> Library | str:
    """The compiled kernel, checked once per process, or why it is not used (a sentence)."""
    return usable("attention", compiled)


def kernel_status() -> str:
    """`compiled (BUILD)` when the kernel is in use for bf16 short passes, else why not."""
    return status(kernel())
