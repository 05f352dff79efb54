"""viasd's forward (passes/loop.py) beside the model's own: with the kernels off (VIASD_KERNELS=off) every pass is the
model's own arithmetic, bit for bit, in every dtype and in quantized views; with them on, float32 passes still are,
and bf16 passes keep the kernels' contracts (within bf16 noise, each token the same in any block). A model the loop
does not cover runs its own forward and says so once; sessions take the loop only where it applies."""

import pytest
import torch
from transformers import DynamicCache

from helpers import own_and_short, ragged_stack
from tiny import LOOP_ARCHITECTURES, tiny_model
from viasd.kernels import attention as short_attention
from viasd.kernels import notice
from viasd.kernels.build import Library
from viasd.kernels.packed_attention import PACK_UP_TO
from viasd.passes import loop as short_pass
from viasd.passes.prepare import prepare
from viasd.passes.session import KVSession, new_cache
from viasd.views.layer_skip import LayerMask, skipping
from viasd.views.quantize import quantize
from viasd.views.recipe import QuantRecipe
from viasd.views.view import View, applied


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("arch", LOOP_ARCHITECTURES)
def test_with_the_kernels_off_the_loop_is_the_models_own_arithmetic(arch, dtype, monkeypatch):
    monkeypatch.setenv("VIASD_KERNELS", "off")  # every operation its torch reference
    model = tiny_model(arch, dtype=dtype)
    assert short_pass.covers(model)
    for view in (None, View(linears=quantize(model, QuantRecipe.parse("int4a8")))):
        pairs, own, short = own_and_short(model, view)
        for want, got in pairs:
            assert torch.equal(got, want)
        for a, b in zip(own.layers, short.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("recipe", [None, "int4a8", "int8"])
def test_in_float32_the_loop_is_the_models_own_arithmetic_with_the_kernels_on(recipe):
    """float32 attention is torch's (the kernel is bf16's); a view's products are the same modules in both paths."""
    model = tiny_model("qwen2", dtype=torch.float32)
    view = None if recipe is None else View(linears=quantize(model, QuantRecipe.parse(recipe)))
    pairs, _, _ = own_and_short(model, view, seed=1)
    for want, got in pairs:
        assert torch.equal(got, want)


@pytest.mark.skipif(not isinstance(short_attention.kernel(), Library), reason="no attention kernel here")
@pytest.mark.parametrize("arch", LOOP_ARCHITECTURES)
def test_bf16_short_passes_attending_in_c_agree_with_the_model_and_with_themselves(arch):
    """With the attention kernel a bf16 pass is no longer the model's own bits, but within bf16 noise of them, and
    a token gets the same logits whatever block it comes in (what exact greedy verification needs): compared here
    on a 4-bit view, whose products are also the same for each token in every block."""
    model = tiny_model(arch, dtype=torch.bfloat16)
    view = View(linears=quantize(model, QuantRecipe.parse("int4a8")))
    pairs, _, _ = own_and_short(model, view, seed=2)
    for want, got in pairs:
        # bf16 noise through 4 layers of a peaked tiny model: 5-11% of the largest logit over seeds 0-3 of these
        # families (the kernel's correctly rounded attention against torch's); a wrong rotation or mask is far more.
        assert (got.float() - want.float()).abs().max() <= 0.125 * want.float().abs().max()
    tokens = torch.tensor([[5, 9, 11, 3, 7, 30, 2, 8]])
    stepped, blocked = new_cache(model), new_cache(model)
    stack = ragged_stack(model, view)
    with torch.inference_mode(), applied(model, view):
        for cache in (stepped, blocked):
            model(input_ids=torch.tensor([list(range(3, 23))]), cache=cache, use_cache=True, logits_to_keep=1)
        whole = short_pass.short_pass(model, tokens, blocked, 8, *stack)
        steps = [short_pass.short_pass(model, tokens[:, at : at + size], stepped, size, *stack)
                 for at, size in ((0, 1), (1, 4), (5, 1), (6, 2))]  # fmt: skip
    assert torch.equal(torch.cat(steps, dim=1), whole)
    for a, b in zip(stepped.layers, blocked.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_what_the_loop_does_not_cover_runs_the_models_own_forward_and_says_so_once(capsys):
    notice.warn_once.cache_clear()
    for arch in ("gemma", "gemma2", "gemma"):
        assert not short_pass.covers(tiny_model(arch))
    assert "not gemma" in short_pass.why_not(tiny_model("gemma"))
    chunked = tiny_model("qwen2")
    chunked.config.layer_types = ["chunked_attention"] * len(chunked.model.layers)
    chunked.config.attention_chunk_size = 4
    assert "not chunked_attention" in short_pass.why_not(chunked)
    partial = tiny_model("phi3")
    partial.config.rope_parameters["partial_rotary_factor"] = 0.5
    assert "partial_rotary_factor" in short_pass.why_not(partial)
    assert not short_pass.covers(tiny_model("llama", packed=False))  # transformers' own attention
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3  # gemma's, once; gemma2's; transformers' own attention
    assert all(line.startswith("viasd: viasd's short passes do not run this model") for line in lines)
    renamed = tiny_model("llama")  # a release that renames a class: the loop no longer mirrors it
    renamed.model.layers[0].mlp.__class__ = type("LlamaFeedForward", (type(renamed.model.layers[0].mlp),), {})
    assert "LlamaFeedForward" in short_pass.why_not(renamed) and not short_pass.covers(renamed)
    assert short_pass.covers(tiny_model("llama"))


def test_the_loop_runs_on_in_place_cache_layers_of_a_model_without_hooks():
    model = tiny_model("llama")
    cache = new_cache(model)
    assert short_pass.runs_on(model, cache)
    assert not short_pass.runs_on(model, DynamicCache())  # layers made lazily: not the model's shape
    handle = model.register_forward_pre_hook(lambda module, args: None)  # it would not see a short pass
    assert not short_pass.runs_on(model, cache)
    handle.remove()
    assert short_pass.runs_on(model, cache)


def test_sessions_take_short_passes_for_steps_and_the_model_for_prompts_and_skipping_views(monkeypatch):
    model = tiny_model("qwen2")
    calls = []
    real = short_pass.short_pass
    monkeypatch.setattr(short_pass, "short_pass", lambda *args: calls.append(args[1].shape[1]) or real(*args))
    session = KVSession(model)
    session.forward(list(range(3, 3 + PACK_UP_TO + 1)))  # a prompt longer than a short pass
    session.forward([5])
    session.forward([6, 7, 8])
    session.forward_slim([9, 10], LayerMask.skipping(4, [1, 2]))  # a slim view skips layers
    assert calls == [1, 3]


def test_a_prepared_model_is_covered_whatever_view_another_pass_has_applied():
    """A session made while another generation's pass runs a layer-skipping view must not read the stand-ins (read
    then, a skipped layer has no attention to look at): a prepared model keeps the verdict read at load."""
    model = prepare(tiny_model("qwen2"))
    with skipping(model, LayerMask.skipping(4, [1])):
        assert short_pass.covers(model) and KVSession(model).short_passes
