"""A sliding-window layer's attention in a short pass (Mistral's layers, Qwen2's and Qwen3's sliding ones, Gemma 3's
local ones), in torch's operations over transformers' own sliding cache layer, as the model's own forward attends
there (`attend`), or by viasd's attention kernel with a window (`attend_by_kernel`, bf16 models).

The cache layer is transformers' `DynamicSlidingWindowLayer` (sessions keep it: passes/session.py crops it by its
own rules), so the keys a pass sees are the ones it hands out, and the mask is the model's: a query at position p
sees the keys at positions p - window < j <= p. With each key/value head's query heads packed into one block
(kernels/packed_attention.py), the arithmetic is the model's own: its packed attention, its mask, or none where
transformers skips it (one query whose keys all lie in the window).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicSlidingWindowLayer

from viasd.kernels import attention
from viasd.kernels.attention import rotated
from viasd.kernels.build import Library
from viasd.passes import sliding_store


def window_mask(past: int, length: int, first: int, keys: int, window: int, device: torch.device) -> torch.Tensor:
    """Which keys each query sees [length, keys]: queries at positions past .. past + length - 1, keys at positions
    first .. first + keys - 1; a query sees the keys at or before it, less than `window` positions back."""
    query = torch.arange(past, past + length, device=device)[:, None]
    key = torch.arange(first, first + keys, device=device)[None, :]
    return (key <= query) & (key > query - window)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layer: DynamicSlidingWindowLayer,
    heads: int,
    scale: float,
) -> torch.Tensor:
    """One sliding layer's attention: query [M, heads * dim], key and value [M, kv_heads * dim], cos and sin
    [M, dim]; the rotated keys and the values go into `layer` (its `update`); out [M, heads * dim]."""
    length, dim = query.shape[0], cos.shape[-1]
    shape = (1, length, -1, dim)
    q = rotated(query.view(shape).transpose(1, 2), cos[None, None], sin[None, None])
    k = rotated(key.view(shape).transpose(1, 2), cos[None, None], sin[None, None])
    past = layer.get_seq_length()
    visible, first = layer.get_mask_sizes(length)  # what the model's own mask covers, before the update
    keys, values = layer.update(k, value.view(shape).transpose(1, 2))
    try:
        kv_heads = keys.shape[1]
        groups = heads // kv_heads
        window = layer.sliding_window
        mask = None
        # transformers leaves the mask out for one query whose keys all lie in the window (`_ignore_causal_mask_sdpa`)
        if length > 1 or visible >= window:
            mask = window_mask(past, length, first, keys.shape[-2], window, q.device).repeat(groups, 1)
        packed = q.reshape(1, kv_heads, groups * length, dim)
        out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scale)
    except BaseException:
        layer.crop(-length)  # the layer keeps what it had
        raise
    return out.reshape(heads, length, dim).transpose(0, 1).reshape(length, heads * dim)


def attend_by_kernel(
    library: Library,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layer: DynamicSlidingWindowLayer,
    heads: int,
    scale: float,
) -> torch.Tensor:
    """`attend`'s result by the attention kernel (bf16): the layer's held positions and the pass's in one store
    (passes/sliding_store.py), each query seeing the last `sliding_window` positions up to its own, as the model's
    mask lets it; the layer takes the store once the kernel has written it."""
    dim = cos.shape[-1]
    shape = (1, key.shape[1] // dim, query.shape[0], dim)
    stores, held = sliding_store.room(layer, shape, key.dtype)
    out = attention.run(library, query, key, value, cos.contiguous(), sin.contiguous(), stores, held, heads, scale,
                        layer.sliding_window)  # fmt: skip
    sliding_store.commit(layer, stores, query.shape[0])
    return out
