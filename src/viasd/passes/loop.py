"""Short passes (decoding steps, verification blocks) of Llama-style decoders without transformers' per-layer machinery.

A decoding step of the 1.5B target in its 4-bit view spends some 30 ms in the matrix kernels and 10-15 ms in
everything else, and a good part of that is transformers' plumbing around the arithmetic: output capturing,
deprecation wrappers, mask builders, attention-function lookup, per-module call hooks (llama.cpp's whole step
takes about 35 ms). `short_pass` runs the same arithmetic (the same torch operations, in the same order, on the
same modules: the model's own norms, projections, rotary embedding and cache layers, quantized copies included)
as a plain loop, so its logits are bit-identical to the model's own forward (tested), only cheaper: 2-5 ms per
step of the 4-bit view in our measurements (BENCHMARKS.md). In bf16, each layer's rotary embedding, cache write
and attention are instead one call of viasd's attention kernel (models/short_attention.py), 3-5 ms less again:
torch's cache entries, attention correctly rounded, and the same logits for a token in any block, but no longer
the model's own last bits. A bf16 view whose Linear layers are all low-bit ones runs its whole decoder stack as
one C call (models/fused_layers.py), about 5 ms less again.

It covers the architectures whose layer code it mirrors (`supports`: Llama and Qwen2, full attention only) and
passes of up to `attention.PACK_UP_TO` tokens, where attention packs each key/value head's query heads into one
block (models/attention.py), in models switched to that attention; anything else (a prompt, a layer-skipping view,
a sliding-window model, a model with forward hooks, a model attending another way, as with
`VIASD_PACKED_ATTENTION=off`) goes through the model's own forward, and so does everything with
`VIASD_SHORT_PASSES=off`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from viasd.kernels import attention as short_attention
from viasd.passes import fused as fused_layers
from viasd.passes.cache_layer import GrowingLayer
from viasd.passes.packed_attention import NAME as PACKED
from viasd.passes.packed_attention import PACK_UP_TO

SWITCH = "VIASD_SHORT_PASSES"  # off: every pass goes through the model's own forward (to compare)

# The transformers classes whose forward `short_pass` mirrors, by architecture (checked by name: a new release that
# renames or restructures them falls back to the model's own forward, and the bit-identity tests catch a change).
MIRRORED = {
    "llama": ("LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "LlamaRMSNorm"),
    "qwen2": ("Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm"),
}


def supports(model: nn.Module) -> bool:
    """Whether `short_pass` computes what `model`'s own forward computes: a CPU Llama or Qwen2 model whose layers
    are all transformers' own classes, with full attention everywhere, switched to packed attention (and short
    passes not switched off)."""
    config = getattr(model, "config", None)
    classes = MIRRORED.get(getattr(config, "model_type", ""))
    inner = getattr(model, "model", None)
    if classes is None or inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return False
    if os.environ.get(SWITCH, "").strip().lower() in ("0", "off", "no", "false"):
        return False
    if getattr(config, "_attn_implementation", None) != PACKED:  # attention as the loop computes it (packed)
        return False
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cpu":
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return False
    layer_class, attention_class, mlp_class, norm_class = classes
    want = (layer_class, attention_class, mlp_class, norm_class, norm_class)
    for layer in inner.layers:
        parts = (layer, layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm)
        if tuple(type(part).__name__ for part in parts) != want:
            return False
    return type(inner.norm).__name__ == norm_class


def usable(model: nn.Module, cache: DynamicCache, tokens: int) -> bool:
    """Whether a pass of `tokens` tokens on `cache` may go through `short_pass`, for a model that `supports` it: it
    has no forward hooks of its own and runs all its layers (a skipped layer is not one of transformers' classes)."""
    if not 0 < tokens <= PACK_UP_TO or not all(isinstance(layer, DynamicLayer) for layer in cache.layers):
        return False
    # Hooks on the model or its decoder stack see its own forward's arguments: the short loop has none to give.
    for module in (model, model.model):  # type: ignore[union-attr]
        if module._forward_hooks or module._forward_pre_hooks:
            return False
    layers = model.model.layers  # type: ignore[union-attr]
    return len(cache.layers) == len(layers) and all(type(layer) is type(layers[0]) for layer in layers)


def short_pass(model: nn.Module, input_ids: torch.Tensor, cache: DynamicCache, keep: int) -> torch.Tensor:
    """Logits [1, keep, vocab] of the last `keep` of `input_ids` [1, M] after the cache's tokens, the cache extended
    by them: what `model(input_ids=..., cache=cache, use_cache=True, logits_to_keep=keep).logits` returns, for a
    model that `supports` it and a pass that is `usable`."""
    inner = model.model  # type: ignore[union-attr]
    length = input_ids.shape[1]
    past = cache.layers[0].get_seq_length()
    x = inner.embed_tokens(input_ids)
    positions = torch.arange(past, past + length, device=x.device).unsqueeze(0)
    cos, sin = inner.rotary_emb(x, positions)
    cos, sin = cos[0], sin[0]  # [M, dim]
    plan = fused_layers.plan_for(model, x.dtype, cache)
    if plan is not None:  # a low-bit bf16 view: all layers in one call
        fused_layers.run_layers(model, x, cos, sin, cache, plan)
        return model.lm_head(inner.norm(x[:, -keep:, :]))  # type: ignore[operator]
    attend = _attention(model, x.dtype, cos, sin, cache)
    for index, layer in enumerate(inner.layers):
        attention, mlp = layer.self_attn, layer.mlp  # norms and MLPs are called as they are: no plumbing there
        h = layer.input_layernorm(x)
        query, key, value = attention.q_proj(h)[0], attention.k_proj(h)[0], attention.v_proj(h)[0]
        x = x + attention.o_proj(attend(query, key, value, cache.layers[index])[None])
        x = x + mlp(layer.post_attention_layernorm(x))
    return model.lm_head(inner.norm(x[:, -keep:, :]))  # type: ignore[operator]


def _attention(
    model: nn.Module, dtype: torch.dtype, cos: torch.Tensor, sin: torch.Tensor, cache: DynamicCache
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, DynamicLayer], torch.Tensor]:
    """A layer's attention for this pass (query [M, heads * dim], key, value, its cache layer -> out [M, heads *
    dim]): the kernel of models/short_attention.py for bf16 and in-place caches, else torch's operations (its
    `reference`, the model's own arithmetic)."""
    config = model.config  # type: ignore[union-attr]
    first = model.model.layers[0].self_attn  # type: ignore[union-attr, index]
    heads, dim, scale = config.num_attention_heads, first.head_dim, first.scaling
    in_place = all(type(layer) is GrowingLayer for layer in cache.layers)
    if in_place and short_attention.applies(dtype, heads, config.num_key_value_heads, dim):
        return short_attention.PassAttention(cos, sin, heads, dim, scale)
    return lambda query, key, value, layer: short_attention.reference(
        query, key, value, cos, sin, layer, heads, dim, scale
    )
