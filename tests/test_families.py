"""Model families on viasd's short passes beyond Llama and Qwen2 (docs/design.md's table): Qwen3's per-head q/k norms,
Llama 3's rope scaling (any scaling: cos and sin come from the model's own rotary embedding), Mistral's sliding
window, Phi-3's fused projections, Gemma 3's norms and local layers. Each runs through viasd's loop with the model's
own logits and cache entries, gives plain greedy's tokens under speculative decoding, and the fused stack takes it
(a decoder it does not compute, says why not)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Gemma3TextConfig, MistralConfig, Phi3Config, Phi3ForCausalLM
from transformers.activations import ACT2FN

from helpers import PROMPT, own_and_short, ragged_stack
from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.decode.speculative import SpeculativeDecoder
from viasd.drafters.model_drafter import ModelDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.kernels import notice
from viasd.kernels.packed_attention import use_packed_attention
from viasd.passes import fused, loop
from viasd.passes.loop import Segment
from viasd.passes.prepare import prepare
from viasd.passes.route import Stack
from viasd.passes.session import KVSession, new_cache
from viasd.views.quantize import quantize
from viasd.views.recipe import QuantRecipe
from viasd.views.view import View

NEW_FAMILIES = ("qwen3", "llama3", "mistral", "phi3", "gemma3")


@pytest.mark.parametrize("arch", NEW_FAMILIES)
def test_greedy_speculative_decoding_takes_short_passes_and_gives_plain_greedys_tokens(arch):
    target, tok = tiny_model(arch), tiny_tokenizer(64)
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(PROMPT, config)
    assert set(plain.stats.routes) == {"loop"}  # the short prompt and every step through viasd's loop
    drafters = {"model": ModelDrafter(tiny_model(arch, layers=2, seed=1)), "lookup": PromptLookupDrafter()}
    for name, drafter in drafters.items():
        out = SpeculativeDecoder(target, tok, drafter, gamma=4).generate(PROMPT, config)
        assert out.tokens == plain.tokens, name
        assert set(out.stats.routes) == {"loop"}, name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["mistral", "gemma3"])  # every layer sliding; every other one, with its own rope
def test_a_sliding_window_shorter_than_the_context_is_the_models_own_arithmetic(arch, dtype, monkeypatch):
    """An 8-token window over some 70 tokens: the loop attends over transformers' own sliding cache layer with the
    model's mask, so blocks, rollbacks past the window and quantized views keep its bits."""
    monkeypatch.setenv("VIASD_KERNELS", "off")
    model = tiny_model(arch, dtype=dtype, sliding_window=8)
    assert loop.covers(model)
    for view in (None, View(linears=quantize(model, QuantRecipe.parse("int4a8")))):
        pairs, own, short = own_and_short(model, view, seed=3)
        for want, got in pairs:
            assert torch.equal(got, want)
        for a, b in zip(own.layers, short.layers, strict=True):
            assert a.get_seq_length() == b.get_seq_length() > 40  # far past the window
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_the_window_matters_here():
    """The window test above can fail: 30 tokens through 4 layers of an 8-token window do not reach back to the
    first token (each layer looks 7 positions back), which the same weights without a window do."""
    windowed, full = tiny_model("mistral", sliding_window=8), tiny_model("mistral")
    ids = [random.Random(0).randrange(64) for _ in range(30)]
    changed = [(ids[0] + 1) % 64, *ids[1:]]
    with torch.inference_mode():
        for model, reaches in ((windowed, False), (full, True)):
            last = [model(torch.tensor([tokens])).logits[0, -1] for tokens in (ids, changed)]
            assert torch.equal(*last) is not reaches


def test_llama3_rope_scaling_comes_from_the_models_rotary_embedding():
    """The tiny "llama3" model scales its frequencies (so test_loop's identity covers the scaling), and the loop's
    cos and sin are its rotary embedding's."""
    scaled, plain = tiny_model("llama3"), tiny_model("llama")
    assert not torch.equal(scaled.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)
    x = torch.zeros(1, 3, 64, dtype=torch.float64)
    positions = torch.tensor([[40, 41, 7]])
    cos, sin = loop.rotary(scaled, x, positions, (0, 2, 3))["all"]
    want_cos, want_sin = scaled.model.rotary_emb(x, positions)
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])


def longrope_phi3() -> torch.nn.Module:
    """A tiny Phi-3 with LongRoPE (Phi-3.5's scaling): frequencies switch to the long factors once a call's
    positions pass 32."""
    config = Phi3Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=32, initializer_range=0.3,
        pad_token_id=0, eos_token_id=1,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                      "long_factor": [2.0 + 0.5 * i for i in range(8)], "original_max_position_embeddings": 32},
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Phi3ForCausalLM(config).to(torch.float64).eval()
    use_packed_attention(model)
    return model


def test_a_merged_pass_gives_each_sequence_the_rope_frequencies_of_its_own_pass():
    """LongRoPE's frequencies depend on the longest position of a call: in a merged pass of a sequence past the
    original context and one within it, each gets the logits of a pass of its own."""
    model = longrope_phi3()
    assert loop.covers(model)
    short = model.model.rotary_emb(torch.zeros(1, 1, 64), torch.tensor([[10]]))[0]
    mixed = model.model.rotary_emb(torch.zeros(1, 2, 64), torch.tensor([[10, 40]]))[0]
    assert not torch.allclose(mixed[0, 0], short[0, 0])  # a merged call would rotate the short one by long factors
    prompts = [list(range(3, 43)), list(range(5, 15))]  # 40 positions (long factors) and 10 (short ones)
    stack = ragged_stack(model, None)
    together, alone = [new_cache(model) for _ in prompts], [new_cache(model) for _ in prompts]
    with torch.inference_mode():
        for caches in (together, alone):
            for cache, prompt in zip(caches, prompts, strict=True):
                model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1)
        blocks = [[7, 8, 9], [10, 11]]
        segments = [Segment(c, torch.tensor(b), len(b)) for c, b in zip(together, blocks, strict=True)]
        merged = loop.ragged_pass(model, segments, *stack)
        for cache, block, got in zip(alone, blocks, merged, strict=True):
            want = model(input_ids=torch.tensor([block]), cache=cache, use_cache=True, logits_to_keep=len(block))
            # float64 products of more rows round differently in the last bits; frequencies of the other sequence's
            # call would be off by whole factors.
            assert torch.allclose(got, want.logits[0], rtol=0, atol=1e-10)


def exact_gelu_llama() -> torch.nn.Module:
    """A bf16 Llama whose MLP activates by exact GELU: viasd's loop runs it (its own MLP modules), the fused stack
    has no such activation."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    model.config.hidden_act = "gelu"
    for layer in model.model.layers:
        layer.mlp.act_fn = ACT2FN["gelu"]
    return prepare(model)


def test_a_decoder_the_fused_stack_lacks_runs_layer_by_layer_and_says_why_once(capsys):
    model = exact_gelu_llama()
    view = View(linears=quantize(model, QuantRecipe.parse("int4a8")))
    reason = fused.why_not(model.config)
    assert reason == "it has no gelu activation"
    notice.warn_once.cache_clear()
    assert ragged_stack(model, view)[0] is Stack.LOOP and ragged_stack(model, view)[0] is Stack.LOOP
    assert capsys.readouterr().err.count(reason) == 1
    session = KVSession(model, base_view=view)
    session.forward(PROMPT)
    session.forward([5])
    assert session.routes == {"loop": 2}  # a prompt of a few tokens is a short pass too


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama3", "mistral", "phi3", "gemma3"])
def test_the_fused_stack_computes_the_families_of_the_loop(arch):
    model = prepare(tiny_model(arch, dtype=torch.bfloat16, sliding_window=8 if arch in ("mistral", "gemma3") else None))
    assert fused.why_not(model.config) is None
    view = View(linears=quantize(model, QuantRecipe.parse("int4a8")))
    assert ragged_stack(model, view)[0] is Stack.FUSED
    assert fused.why_not(MistralConfig()) is None  # Mistral 7B v0.1's window of 4096 positions
    assert fused.why_not(MistralConfig(sliding_window=None)) is None  # v0.2 on: full attention
    assert fused.why_not(Gemma3TextConfig(attn_logit_softcapping=50.0)) == "it has no soft cap of attention scores"
