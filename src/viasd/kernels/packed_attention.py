"""Attention for short passes on a CPU: the query heads that share a key/value head packed into one query block.

A grouped-query model (Qwen2.5: 12 query heads over 2 key/value heads) decodes one token at a time, and verifies
blocks of a few. Transformers' `sdpa` attention hands torch either the groups (`enable_gqa`) or copies of the
key/value heads (`repeat_kv`), and torch's CPU kernel for a single query with `enable_gqa` is slow, the more so the
longer the context: with each group's queries stacked as one block of queries over their key/value head, a bf16
decoding step of the 1.5B target at 1024 tokens of context takes 154 ms instead of 210 (a 2-core AMD EPYC;
BENCHMARKS.md). `packed_sdpa` stacks them for passes of up to PACK_UP_TO tokens (decoding, verification) and
leaves longer ones (a prompt) to transformers, whose causal flash path is the fast one there. Each query row
attends as before, to the same keys under the same mask, so what changes is only how torch blocks the arithmetic.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NAME = "viasd_packed_sdpa"
PACK_UP_TO = 16  # tokens per pass up to which the groups are packed


def packed_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function contract: query [B, H, M, D], key and value [B, Hkv, T, D], a mask
    [B, 1, M, T] or None; returns [B, M, H, D]. Packs where it pays, else calls transformers' `sdpa`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, length, dim = query.shape
    groups = heads // key.shape[1]
    packable = (
        groups > 1
        and query.device.type == "cpu"
        and length <= PACK_UP_TO
        and (length == 1 if attention_mask is None else attention_mask.shape[1] == 1)
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    )
    if not packable:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    # Query heads kv * groups .. kv * groups + groups - 1 read key/value head kv (transformers' repeat_kv order):
    # their rows become one block of groups * length queries, row g * length + m being head g's query m.
    packed = query.reshape(batch, key.shape[1], groups * length, dim)
    mask = None if attention_mask is None else attention_mask.repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=mask, dropout_p=dropout if module.training else 0.0, scale=scaling
    )
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None


def use_packed_attention(model: nn.Module) -> bool:
    """Switch a CPU model that uses transformers' `sdpa` attention to `packed_sdpa`; whether it was switched."""
    config = getattr(model, "config", None)
    parameter = next(model.parameters(), None)
    if config is None or parameter is None or parameter.device.type != "cpu":
        return False
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    # Transformers finds attention functions and their mask builders by name, in registries of its own.
    AttentionInterface.register(NAME, packed_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
