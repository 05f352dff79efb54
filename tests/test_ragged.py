"""Ragged passes (passes/loop.py `ragged_pass`): the new tokens of several sequences in one pass, each after its own
cache. A sequence gets the logits and cache entries it gets in a pass of its own, bit for bit where every product
is row-independent (viasd's low-bit kernels: an int4a8 view in float32 and bf16, the fused bf16 stack), through
steps, verification blocks and rollbacks of different lengths."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import ragged_stack
from tiny import tiny_model
from viasd.passes import loop
from viasd.passes.loop import Segment
from viasd.passes.session import new_cache
from viasd.views.quantize import quantize
from viasd.views.recipe import QuantRecipe
from viasd.views.view import View, applied


def caches_after_prompts(model, prompts):
    caches = [new_cache(model) for _ in prompts]
    with torch.inference_mode():
        for cache, prompt in zip(caches, prompts, strict=True):
            model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1)
    return caches


def assert_caches_equal(a, b):
    for x, y in zip(a.layers, b.layers, strict=True):
        assert x.get_seq_length() == y.get_seq_length()
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


@pytest.mark.parametrize(
    ("arch", "dtype"),
    [("llama", torch.float32), ("qwen2", torch.float32), ("qwen2", torch.bfloat16), ("qwen3", torch.float32),
     ("llama3", torch.float32), ("mistral", torch.float32), ("phi3", torch.float32), ("phi3", torch.bfloat16),
     ("gemma3", torch.float32)],
)  # fmt: skip
def test_each_sequence_gets_what_it_gets_alone(arch, dtype):
    # A window of 16 positions: the longer prompts' sliding layers are past it.
    model = tiny_model(arch, dtype=dtype, sliding_window=16 if arch in ("mistral", "gemma3") else None)
    view = View(linears=quantize(model, QuantRecipe.parse("int4a8")))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 64) for _ in range(n)] for n in (7, 19, 3, 30)]  # caches of different lengths
    stack = ragged_stack(model, view)  # fused where the kernel takes the bf16 view, else layer by layer
    with applied(model, view):
        together, alone = caches_after_prompts(model, prompts), caches_after_prompts(model, prompts)
        with torch.inference_mode():
            for step in range(6):
                # Each sequence feeds a decoding step or a verification block; some roll back a rejected tail.
                blocks = [[rng.randrange(3, 64) for _ in range(rng.choice((1, 1, 3, 5)))] for _ in prompts]
                segments = [Segment(c, torch.tensor(b), len(b)) for c, b in zip(together, blocks, strict=True)]
                merged = loop.ragged_pass(model, segments, *stack)
                for cache, block, got in zip(alone, blocks, merged, strict=True):
                    own = loop.short_pass(model, torch.tensor([block]), cache, len(block), *stack)[0]
                    assert torch.equal(got, own)
                for index, (a, b) in enumerate(zip(together, alone, strict=True)):
                    drop = rng.randrange(0, len(blocks[index])) if step % 2 else 0
                    if drop:
                        a.crop(-drop), b.crop(-drop)
                    assert_caches_equal(a, b)


def test_only_the_kept_rows_get_logits_and_a_single_segment_is_a_short_pass():
    model = tiny_model("qwen2", dtype=torch.float32)
    caches = caches_after_prompts(model, [[5, 6, 7], [8, 9]])
    with torch.inference_mode():
        segments = [Segment(caches[0], torch.tensor([3, 4, 5]), 1), Segment(caches[1], torch.tensor([6, 7]), 2)]
        logits = loop.ragged_pass(model, segments, *ragged_stack(model, None))
    assert [tuple(x.shape) for x in logits] == [(1, 64), (2, 64)]
    assert caches[0].get_seq_length() == 6 and caches[1].get_seq_length() == 4
