"""A real model of a family beyond Llama and Qwen2 on viasd's short passes: Gemma 3 270M (the catalog's
`gemma3-270m`, from PyPI), whose layers mix 512-token sliding windows with full attention, each with its own rotary
base. In float32 viasd's loop is the model's own arithmetic, so its passes give transformers' logits bit for bit, and
greedy speculative decoding gives plain greedy's tokens, through short passes. As the CLI runs it by default (its
GGUF file's view), every short pass is one call of the fused C stack, with the layer loop's tokens."""

from __future__ import annotations

import pytest
import torch

from helpers import ragged_stack
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.decode.speculative import SpeculativeDecoder
from viasd.drafters.model_drafter import ModelDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.engine import Engine
from viasd.models.loading import load_model
from viasd.passes import loop
from viasd.passes.prepare import prepare
from viasd.passes.session import new_cache
from viasd.spec import EngineSpec
from viasd.views.layer_skip import LayerMask

pytestmark = pytest.mark.real

TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"


def test_gemma3_short_passes_are_the_models_own_and_speculative_decoding_is_greedys():
    loaded = load_model("gemma3-270m", device="cpu", dtype="float32")
    model = prepare(loaded.model)
    assert type(model).__name__ == "Gemma3ForCausalLM" and loop.covers(model)
    ids = loaded.tokenizer(TEXT)["input_ids"]
    own, short = new_cache(model), new_cache(model)
    stack = ragged_stack(model, None)
    with torch.inference_mode():
        for cache in (own, short):
            model(input_ids=torch.tensor([ids[:20]]), cache=cache, use_cache=True, logits_to_keep=1)
        at = 20
        for size in (1, 4, 1, 7, 3):  # decoding steps and verification blocks
            block = torch.tensor([ids[at : at + size]])
            want = model(input_ids=block, cache=own, use_cache=True, logits_to_keep=size).logits
            assert torch.equal(loop.short_pass(model, block, short, size, *stack), want)
            at += size
    for a, b in zip(own.layers, short.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)

    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    plain = PlainDecoder(model, loaded.tokenizer).generate(ids, config)
    assert plain.stats.routes.get("loop", 0) == 23  # every step after the prompt through viasd's loop
    skipping = LayerMask.skipping(model.config.num_hidden_layers, [3, 7, 11])
    for name, drafter in {"lookup": PromptLookupDrafter(), "self": ModelDrafter(model, skipping, name="self")}.items():
        out = SpeculativeDecoder(model, loaded.tokenizer, drafter, gamma=4).generate(ids, config)
        assert out.tokens == plain.tokens, name
        assert out.stats.routes.get("loop", 0) > 0, name


def test_gemma3_as_the_cli_runs_it_takes_the_fused_stack_past_its_window_with_the_layer_loops_tokens(monkeypatch):
    """`viasd generate --target gemma3-270m`'s target: its Q4_K_M file's view (Q5_0, Q8_0, Q4_K and Q6_K blocks).
    Some 550 positions reach past the 512-token windows; the fused stack runs every step and gives the tokens of
    the same view layer by layer, and greedy prompt-lookup speculation through it plain greedy's."""
    engine = Engine(EngineSpec(target="gemma3-270m", drafter="gemma3-270m", device="cpu"))
    described = engine.describe("plain")
    assert described["target_as_run"] == "gguf view of gemma-3-270m-q4_k_m.gguf", described
    ids = engine.target.tokenizer(TEXT)["input_ids"]
    config = GenerationConfig(max_new_tokens=520, ignore_eos=True)
    fused = engine.generate(ids, "plain", config)
    assert fused.stats.routes.get("fused", 0) == 519 and "loop" not in fused.stats.routes  # every step after the prompt
    lookup = engine.generate(ids, "lookup", config)
    assert lookup.tokens == fused.tokens and "fused" in lookup.stats.routes and "loop" not in lookup.stats.routes
    monkeypatch.setenv("VIASD_KERNELS", "-fused")  # the same kernels, layer by layer
    layer_by_layer = engine.generate(ids, "plain", config)
    assert layer_by_layer.stats.routes.get("loop", 0) == 519
    assert layer_by_layer.tokens == fused.tokens
