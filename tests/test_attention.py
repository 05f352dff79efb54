"""Packed grouped-query attention (kernels/packed_attention.py): the same attention as transformers' sdpa, computed in
one query block per key/value head for short passes on a CPU."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import DynamicCache

from tiny import tiny_model
from viasd.kernels.packed_attention import NAME, PACK_UP_TO, use_packed_attention


def passes(model: torch.nn.Module, ids: torch.Tensor, cuts: list[int]) -> list[torch.Tensor]:
    """Logits of consecutive passes over ids[cuts[i]:cuts[i+1]], one cache throughout."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        return [model(input_ids=ids[:, a:b], cache=cache).logits for a, b in itertools.pairwise(cuts)]


@pytest.mark.parametrize(("arch", "window"), [("llama", None), ("qwen2", None), ("gemma", None), ("mistral", 6)])
def test_packed_attention_equals_transformers_sdpa_for_prompts_blocks_and_single_tokens(arch, window):
    ids = torch.randint(3, 64, (1, 60), generator=torch.Generator().manual_seed(0))
    cuts = [0, 12, 13, 18, 18 + PACK_UP_TO, 18 + PACK_UP_TO + 1, 60]  # prompt, 1, 5, PACK_UP_TO, 1, a long pass
    want = passes(tiny_model(arch, packed=False, sliding_window=window), ids, cuts)
    packed = tiny_model(arch, sliding_window=window)
    assert packed.config._attn_implementation == NAME
    got = passes(packed, ids, cuts)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)  # float64: the same attention, other blocking


def test_only_cpu_models_with_sdpa_attention_are_switched():
    eager = tiny_model("gemma2")  # its soft-capped attention is eager
    assert not use_packed_attention(eager) and eager.config._attn_implementation == "eager"
    assert not use_packed_attention(torch.nn.Linear(2, 2))  # not a transformers model
    assert use_packed_attention(tiny_model("qwen2", packed=False))
