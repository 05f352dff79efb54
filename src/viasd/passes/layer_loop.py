"""viasd's decoder layer: the one it writes beside the model's own (transformers'), over the model's own modules.

Per layer: the input norm, the q/k/v projections (or one q|k|v projection, Phi-3's), per-head q/k norms where the
model has them (Qwen3's, Gemma 3's), attention (rotary embedding, cache write: kernels/attention.py's kernel or its
torch reference; a sliding-window layer's by passes/window_attention.py, with the kernel or torch's operations), the
output projection and residual, then the model's own norm and MLP modules and residual. With the references it is
the model's own arithmetic, bit for bit (tests/test_loop.py); viasd's loop runs short passes through it
(passes/loop.py), and the fused C stack (passes/fused.py, kernels/fused_layers.c) is checked against it, at first
use and in tests/test_fused_layers.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

from viasd.kernels import attention
from viasd.kernels.build import Library
from viasd.models.stored import model_dtype
from viasd.passes import window_attention
from viasd.passes.cache_layer import GrowingLayer


def attention_kernel(model: nn.Module) -> bool:
    """Whether the layers attend by viasd's C kernel: it is there and takes the model's shapes and dtype."""
    config = model.config  # type: ignore[union-attr]
    dtype = model_dtype(model)
    head_dim = model.model.layers[0].self_attn.head_dim  # type: ignore[union-attr, index]
    takes = attention.takes(dtype, config.num_attention_heads, config.num_key_value_heads, head_dim)
    return takes and isinstance(attention.kernel(), Library)


class LayerAttention:
    """A layer's attention in one pass (query [M, heads * dim], key, value, its cache layer -> out [M, heads *
    dim]): the kernel where it runs (bf16), else its torch reference; the pass's entries written in place."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, heads: int, scale: float, library: Library | None):
        self.cos, self.sin = cos.contiguous(), sin.contiguous()  # kept alive: the kernel reads their memory
        self.heads, self.scale, self.library = heads, scale, library

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: GrowingLayer
    ) -> torch.Tensor:
        dim = self.cos.shape[-1]
        # Room for the pass's entries after the layer's (stores [1, kv_heads, capacity, dim]); written below.
        past = layer.reserve((1, key.shape[1] // dim, query.shape[0], dim), key.dtype, key.device)
        try:
            if self.library is not None:
                return attention.run(self.library, query, key, value, self.cos, self.sin, layer.stores(), past,
                                     self.heads, self.scale)  # fmt: skip
            return attention.reference(query, key, value, self.cos, self.sin, layer.stores(), past, self.heads,
                                       self.scale)  # fmt: skip
        except BaseException:
            layer.crop(-query.shape[0])  # the layer keeps what it had: the positions were reserved, maybe not written
            raise


def projections(attn: nn.Module, h: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's query, key and value [M, heads * dim] from its normed input h [1, M, hidden]: three projections or
    one q|k|v projection split by columns (Phi-3), then each head's q and k normed where the model norms them
    (Qwen3: `q_norm` and `k_norm` over each head's dim, before the rotary embedding)."""
    fused = getattr(attn, "qkv_proj", None)
    if fused is None:
        query, key, value = attn.q_proj(h)[0], attn.k_proj(h)[0], attn.v_proj(h)[0]
    else:
        width = heads * attn.head_dim
        kv_width = (fused.out_features - width) // 2
        query, key, value = fused(h)[0].split([width, kv_width, kv_width], dim=-1)
    q_norm = getattr(attn, "q_norm", None)
    if q_norm is not None:
        rows, dim = query.shape[0], attn.head_dim
        query = q_norm(query.view(rows, -1, dim)).view(rows, -1)
        key = attn.k_norm(key.view(rows, -1, dim)).view(rows, -1)
    return query, key, value


def run(
    model: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    caches: Sequence[DynamicCache],
    starts: Sequence[int],
    attention_kernel: bool,
    sliding: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The decoder layers on x [1, M, hidden] as a loop of the model's own modules (as they are in place: a view's
    copies where one is applied), rows starts[s] .. starts[s + 1] being the new tokens of the sequence whose cache is
    caches[s], attending over it (by the C kernel where `attention_kernel`, else its torch reference); cos and sin
    [M, dim], of the sliding-window layers `sliding` where they have their own (Gemma 3). Returns the new x; each
    cache is extended by its sequence's entries."""
    inner = model.model  # type: ignore[union-attr]
    config = model.config  # type: ignore[union-attr]
    first = inner.layers[0].self_attn
    heads = config.num_attention_heads
    library = attention.kernel() if attention_kernel else None
    assert library is None or isinstance(library, Library), "the route said the kernel is there"
    spans = list(itertools.pairwise(starts))
    attends = [LayerAttention(cos[a:b], sin[a:b], heads, first.scaling, library) for a, b in spans]
    local_cos, local_sin = (cos, sin) if sliding is None else sliding
    for index, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp  # norms and MLPs are called as they are: no plumbing there
        h = layer.input_layernorm(x)
        query, key, value = projections(attn, h, heads)
        attended = []
        for attend, cache, (a, b) in zip(attends, caches, spans, strict=True):
            own = cache.layers[index]
            if type(own) is DynamicSlidingWindowLayer:  # over transformers' own sliding layer
                rows = query[a:b], key[a:b], value[a:b], local_cos[a:b], local_sin[a:b]
                if library is None:
                    attended.append(window_attention.attend(*rows, own, heads, first.scaling))
                else:
                    attended.append(window_attention.attend_by_kernel(library, *rows, own, heads, first.scaling))
            else:
                attended.append(attend(query[a:b], key[a:b], value[a:b], own))
        out = attn.o_proj((attended[0] if len(attended) == 1 else torch.cat(attended))[None])
        if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 3: norms on both sides of each sub-layer
            x = x + layer.post_attention_layernorm(out)
            x = x + layer.post_feedforward_layernorm(mlp(layer.pre_feedforward_layernorm(x)))
        else:
            x = x + out
            x = x + mlp(layer.post_attention_layernorm(x))
    return x
