"""Short passes of low-bit bf16 views with all decoder layers in one C call: the numbers of the per-layer loop (with
the attention kernel), the same for each token in any block, re-planned when a view swaps other layers in, and
used by sessions only where every layer is a low-bit one."""

import random
from pathlib import Path

import pytest
import torch

from helpers import PROMPT, qwen2_with_gguf, ragged_stack
from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.decode.speculative import SpeculativeDecoder
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.kernels import fused_layers as fused_kernel
from viasd.kernels import notice
from viasd.kernels.build import Library
from viasd.passes import fused as fused_layers
from viasd.passes import layer_loop, route
from viasd.passes import loop as short_pass
from viasd.passes.facts import gather
from viasd.passes.prepare import prepare
from viasd.passes.session import KVSession, new_cache
from viasd.views.gguf import GgufWeights
from viasd.views.layer_skip import LayerMask
from viasd.views.linears import Int6Int8Linear, Int8Int8Linear
from viasd.views.quantize import quantize
from viasd.views.recipe import QuantRecipe
from viasd.views.view import View, applied

pytestmark = pytest.mark.skipif(not isinstance(fused_kernel.kernel(), Library), reason="no fused layers here")
OFF = ("VIASD_KERNELS", "-fused")  # the per-layer loop, with the same product and attention kernels


def applies(model, view) -> bool:
    """Whether the fused stack takes `view` of `model` whole (its verdict, which the route's facts read)."""
    return fused_layers.fits(model, view)


def passes(model, view, blocks, seed=0):
    """Logits [1, sum of blocks, V] of short passes of the given sizes after a 20-token prompt, and the cache."""
    rng = random.Random(seed)
    ids = [rng.randrange(64) for _ in range(20 + sum(blocks))]
    cache = new_cache(model)
    out = []
    with torch.inference_mode(), applied(model, view):
        model(input_ids=torch.tensor([ids[:20]]), cache=cache, use_cache=True, logits_to_keep=1)
        at = 20
        for size in blocks:
            stack = ragged_stack(model, view)
            assert (stack[0] is route.Stack.FUSED) == isinstance(fused_kernel.kernel(), Library)
            out.append(short_pass.short_pass(model, torch.tensor([ids[at : at + size]]), cache, size, *stack))
            at += size
    return torch.cat(out, dim=1), cache


def int4a8_view(arch, window=None):
    model = tiny_model(arch, dtype=torch.bfloat16, sliding_window=window)
    return model, View(linears=quantize(model, QuantRecipe.parse("int4a8")))


def gemma3_270m_mix(name: str) -> str:
    """gemma3-270m's Q4_K_M file's block types: Q5_0 where rows are no whole number of super-blocks (q, k, gate, up),
    Q8_0 value projections, Q4_K output projections, Q6_K down projections."""
    kinds = {"v_proj": "Q8_0", "o_proj": "Q4_K", "down_proj": "Q6_K"}
    return kinds.get(name.rsplit(".", 1)[-1], "Q5_0")


def gguf_view(tmp_path, mix=None):
    """A tiny bf16 Qwen2 in a GGUF file's blocks: 4-bit ones, 6-bit value projections (so q, k and v are three
    products, not one); or `mix`'s (with 8-bit ones)."""
    model, path, _ = qwen2_with_gguf(tmp_path, dtype=torch.bfloat16, **({} if mix is None else {"kind_of": mix}))
    view = View(linears=quantize(model, QuantRecipe.parse("gguf"), gguf=GgufWeights(path)))
    kind = Int6Int8Linear if mix is None else Int8Int8Linear
    assert any(isinstance(m, kind) for m in view.linears.modules.values())
    return model, view


def close_to_the_loop(model, view, monkeypatch, blocks=(1, 4, 1, 7, 2)):
    fused, fused_cache = passes(model, view, blocks)
    monkeypatch.setenv(*OFF)
    loop, loop_cache = passes(model, view, blocks)
    monkeypatch.delenv(OFF[0])
    # The same products and attention; norms and SiLU may differ from torch's in a last bit now and then.
    assert (fused.float() - loop.float()).abs().max() <= 0.02 * loop.float().abs().max()
    assert (fused.argmax(-1) == loop.argmax(-1)).float().mean() >= 0.9
    for a, b in zip(fused_cache.layers, loop_cache.layers, strict=True):
        assert a.get_seq_length() == b.get_seq_length() == 20 + sum(blocks)
        assert (a.keys.float() - b.keys.float()).abs().max() <= 0.02 * b.keys.float().abs().max()


# phi3: q|k|v and gate|up are one product each; Mistral without a sliding window is Llama's layer, with one an 8-token
# window on every layer; qwen3: per-head q/k norms; gemma3: its norms, GELU, and 8-token windows with their own rope
# on every other layer. The passes reach 35 positions: far past the windows.
FAMILIES = [("llama", None), ("qwen2", None), ("phi3", None), ("mistral-v0.2", None), ("qwen3", None), ("mistral", 8),
            ("gemma3", 8), ("gemma3", None)]  # fmt: skip


@pytest.mark.parametrize(("arch", "window"), FAMILIES)
def test_fused_layers_compute_what_the_loop_computes(arch, window, monkeypatch):
    close_to_the_loop(*int4a8_view(arch, window), monkeypatch)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_fused_greedy_decoding_gives_the_layer_loops_tokens(arch, monkeypatch):
    """Plain and speculative greedy decoding of a 4-bit view (Gemma 3 with 8-token windows, some 60 positions) give
    the same tokens fused as layer by layer, and the fused stack is what runs their short passes."""
    model, view = int4a8_view(arch, 8 if arch == "gemma3" else None)
    prepare(model)
    tokenizer = tiny_tokenizer(64)
    config = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    results = {}
    for mode in ("on", "-fused"):
        monkeypatch.setenv("VIASD_KERNELS", mode)
        plain = PlainDecoder(model, tokenizer, view).generate(PROMPT, config)
        speculative = SpeculativeDecoder(model, tokenizer, PromptLookupDrafter(), gamma=4, view=view).generate(
            PROMPT, config
        )
        results[mode] = plain, speculative
    fused_plain, fused_speculative = results["on"]
    assert fused_plain.tokens == results["-fused"][0].tokens == fused_speculative.tokens
    assert results["-fused"][1].tokens == fused_plain.tokens
    assert fused_plain.stats.routes.get("fused", 0) >= 40 and "loop" not in fused_plain.stats.routes
    assert "fused" in fused_speculative.stats.routes and "loop" not in fused_speculative.stats.routes


def test_fused_layers_take_a_gguf_files_4_and_6_bit_layers(tmp_path: Path, monkeypatch):
    close_to_the_loop(*gguf_view(tmp_path), monkeypatch)


def test_fused_layers_take_a_gguf_files_8_bit_layers(tmp_path: Path, monkeypatch):
    """Q5_0 and Q8_0 blocks (8-bit products) beside Q4_K and Q6_K ones, as in gemma3-270m's file."""
    model, view = gguf_view(tmp_path, gemma3_270m_mix)
    assert applies(model, view)
    close_to_the_loop(model, view, monkeypatch)


@pytest.mark.parametrize("which", ["int4a8", "gguf", "gemma3"])
def test_each_token_gets_the_same_logits_in_any_block(which, tmp_path: Path):
    if which == "gguf":
        model, view = gguf_view(tmp_path)
    else:  # gemma3: 4-token windows, reached within the blocks
        model, view = int4a8_view("qwen2") if which == "int4a8" else int4a8_view("gemma3", 4)
    whole, whole_cache = passes(model, view, (9,))
    stepped, stepped_cache = passes(model, view, (1, 3, 1, 4))
    assert torch.equal(whole, stepped)
    for a, b in zip(whole_cache.layers, stepped_cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_plan_follows_the_view_in_place(monkeypatch):
    """Two views of one model, used by turns: each pass runs the layers of the view applied then."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    first = View(linears=quantize(model, QuantRecipe.parse("int4a8")))
    second = View(linears=quantize(model, QuantRecipe.parse("int4a8")))
    with torch.inference_mode():
        for layer in second.linears.modules.values():  # another view: other weights
            if hasattr(layer, "scale"):
                layer.scale.mul_(1.5)
    results = {}
    for mode in ("on", "-fused"):
        monkeypatch.setenv("VIASD_KERNELS", mode)
        results[mode] = [passes(model, view, (2,))[0] for view in (first, second, first)]
    for fused, loop in zip(results["on"], results["-fused"], strict=True):
        assert (fused.float() - loop.float()).abs().max() <= 0.02 * loop.float().abs().max()
    assert not torch.equal(results["on"][0], results["on"][1]) and torch.equal(results["on"][0], results["on"][2])


def test_only_low_bit_bf16_views_run_fused(monkeypatch):
    model, view = int4a8_view("qwen2")
    assert not applies(model, None)  # the model's own bf16 layers
    assert applies(model, view)
    assert not applies(model, View(mask=LayerMask.skipping(4, [1]), linears=view.linears))  # a layer skipped
    for switch in ("-fused", "-w4a8", "off"):  # off, or a kernel it calls off
        monkeypatch.setenv("VIASD_KERNELS", switch)
        assert not applies(model, view)
        assert fused_kernel.kernel_status() == "switched off (VIASD_KERNELS)"
    float_model = tiny_model("qwen2", dtype=torch.float32)
    float_view = View(linears=quantize(float_model, QuantRecipe.parse("int4a8")))
    assert not applies(float_model, float_view)
    calls = []
    monkeypatch.delenv("VIASD_KERNELS")
    real = fused_layers.run_layers
    monkeypatch.setattr(fused_layers, "run_layers", lambda *args: calls.append(args[1].shape[1]) or real(*args))
    sessions = []
    for each, each_view in ((model, view), (float_model, float_view)):
        session = KVSession(each, base_view=each_view)
        # A prompt: the model's own forward (of the view), not a short pass; too short to read its head by the model's
        # own weights even on CPUs with AMX (`QuantRecipe.own_weights_from`).
        session.forward(list(range(3, 21)))
        session.forward([5])
        session.forward([6, 7, 8])
        sessions.append(session)
    assert calls == [1, 3]  # the bf16 view's short passes; float32 models keep torch's operations
    assert sessions[0].routes == {"model": 1, "fused": 2} and sessions[1].routes == {"model": 1, "loop": 2}


def test_the_fused_stack_is_held_to_viasds_decoder_layer(monkeypatch, capsys):
    """The check at first use compares the C stack with the layer loop (passes/layer_loop.py) on a tiny model with
    4- and 6-bit layers, one product and several; a stack that disagrees is not used, and one line says so."""
    assert fused_layers._disagreement.__wrapped__() is None
    real = layer_loop.run
    monkeypatch.setattr(layer_loop, "run", lambda *args: real(*args) * 1.1)  # a reference the stack no longer meets
    assert "disagree" in fused_layers._disagreement.__wrapped__()
    monkeypatch.setattr(layer_loop, "run", real)
    model, view = int4a8_view("qwen2")
    assert applies(model, view)
    notice.warn_once.cache_clear()
    monkeypatch.setattr(fused_layers, "_disagreement", lambda: "disagree with viasd's decoder layer")
    assert not applies(model, view)
    assert "the fused layers disagree" in capsys.readouterr().err


def test_gathering_a_prepared_models_facts_builds_no_model(monkeypatch):
    """The fused stack's check on a tiny model of its own runs when a model is prepared (passes/prepare.py), so the
    facts of its passes (passes/facts.py) only read verdicts."""
    fused_layers._disagreement.cache_clear()
    model, view = int4a8_view("qwen2")
    prepare(model)
    monkeypatch.setattr(fused_layers, "_check_model", lambda: pytest.fail("gathering facts built the check's model"))
    facts = gather(model, new_cache(model), view)
    assert facts.loop and facts.fused


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_slim_view_that_skips_whole_layers_runs_fused_as_the_models_forward_runs_it(arch, monkeypatch):
    """A slim verifier that is the 4-bit view with layers skipped (via's over a file's blocks) runs its short passes
    as one C call that leaves those layers out: the logits and cache entries of the model's forward with the mask's
    stand-ins, and no entry in a skipped layer's cache."""
    model, view = int4a8_view(arch)
    prepare(model)
    layers = model.config.num_hidden_layers
    slim = View(mask=LayerMask.skipping(layers, [1]), linears=view.linears)
    assert not applies(
        model, View(mask=LayerMask(tuple(i != 1 for i in range(layers)), (True,) * layers), linears=view.linears)
    )  # fmt: skip  (attention alone skipped: not fused)
    prompt = list(range(3, 23))
    results = {}
    for mode in ("on", "-fused"):
        monkeypatch.setenv("VIASD_KERNELS", mode)
        session = KVSession(model, view)
        session.forward(prompt)
        out = [session.forward_slim([5, 9, 11], slim, keep=3), session.forward_slim([7, 2], slim, keep=2)]
        results[mode] = torch.cat(out), session
    (fused, on), (model_path, off) = results["on"], results["-fused"]
    assert on.routes == {"model": 1, "fused": 2} and off.routes == {"model": 3}  # (the prompt: the model's own)
    # transformers' forward rounds otherwise than viasd's layers: 5% of the largest logit apart with no layer skipped.
    assert (fused - model_path).abs().max() <= 0.06 * model_path.abs().max()
    assert (fused.argmax(-1) == model_path.argmax(-1)).all()
    for index, (a, b) in enumerate(zip(on.cache.layers, off.cache.layers, strict=True)):
        assert a.get_seq_length() == b.get_seq_length() == (20 if index == 1 else 25)
        assert (a.keys.float() - b.keys.float()).abs().max() <= 0.06 * b.keys.float().abs().max()
