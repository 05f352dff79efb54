"""Quantized views: the kernels compute what the quantized weights say, smoothing earns its place, views swap in
and out without touching the model's own weights, and exact methods stay exact with quantized models."""

import pytest
import torch
from torch import nn

from helpers import PROMPT, assert_cache_equals, assert_same_until_a_near_tie, fresh_cache
from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.decode.round import RoundPolicy
from viasd.decode.speculative import SpeculativeDecoder
from viasd.decode.tiered import TieredDecoder
from viasd.drafters.model_drafter import ModelDrafter
from viasd.errors import ViasdError
from viasd.kernels import w4a8
from viasd.passes.session import KVSession
from viasd.verify.gates import Gate
from viasd.views.layer_skip import LayerMask
from viasd.views.linears import Int4Int8Linear, Int4WeightOnlyLinear, Int8DynamicLinear, Int8WeightOnlyLinear
from viasd.views.quantize import quantize
from viasd.views.recipe import QuantRecipe
from viasd.views.view import View, applied


def linear(inp=256, out=96, seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    layer = nn.Linear(inp, out, bias=True)
    return layer.to(dtype)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize(
    ("kind", "bound"),
    [("int8", 0.02), ("int8wo", 0.01), ("int4", 0.12), ("int4a8", 0.12)],
    ids=["int8", "int8wo", "int4", "int4a8"],
)
def test_quantized_linears_approximate_the_layer_for_blocks_and_single_tokens(kind, bound):
    layer = linear()
    module = {
        "int8": lambda: Int8DynamicLinear.from_linear(layer),
        "int8wo": lambda: Int8WeightOnlyLinear.from_linear(layer),
        "int4": lambda: Int4WeightOnlyLinear.from_linear(layer, 64),
        "int4a8": lambda: Int4Int8Linear.from_linear(layer),
    }[kind]()
    x = torch.randn(2, 7, 256, dtype=torch.bfloat16)
    with torch.inference_mode():
        want, got = layer(x), module(x)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert rel_error(got, want) < bound
        # A row's result does not depend on the other rows of the block (what exact verification relies on).
        assert torch.equal(module(x[:1, 3:4]), got[:1, 3:4])


def test_int4_kernel_computes_the_dequantised_weights():
    layer = linear(dtype=torch.float32)
    module = Int4WeightOnlyLinear.from_linear(layer, 64)
    # Dequantise by hand from the same recipe: asymmetric 4-bit groups of 64 along the input.
    groups = layer.weight.detach().reshape(96, 4, 64)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = (high - low) / 15
    dequant = (torch.round((groups - low) / scale) * scale + low).reshape(96, 256)
    x = torch.randn(5, 256)
    with torch.inference_mode():
        want = x.bfloat16().float() @ dequant.T + layer.bias
        assert rel_error(module(x), want) < 0.01


def test_an_int4a8_layer_computes_its_weights_product_through_the_kernel_or_its_reference():
    """The module's product is the 4-bit product of its own weights (kernels/w4a8.py: the kernel and its torch
    reference are tested in test_lowbit.py), its bias added, whatever the rows' shape."""
    layer = linear(inp=512, out=160, dtype=torch.float32)
    module = Int4Int8Linear.from_linear(layer)
    assert rel_error(w4a8.dequantize(module.weights), layer.weight) < 0.1
    x = torch.randn(2, 3, 512)
    with torch.inference_mode():
        got = module(x)
    want = w4a8.reference(x.reshape(6, 512), module.weights) + layer.bias
    assert got.shape == (2, 3, 160) and rel_error(got.reshape(6, 160), want) < 1e-5


def test_a_mixed_recipe_quantizes_the_named_layers_to_int8():
    """int4a8m: int4a8 everywhere but the LM head and the MLP down projections, which get int8 (as Q4_K_M keeps
    its sensitive layers at more bits); its name round-trips and fits a method variant."""
    recipe = QuantRecipe.parse("int4a8m")
    assert recipe.name == "int4a8:int8=lm_head,*.mlp.down_proj" and QuantRecipe.parse(recipe.name) == recipe
    model = tiny_model("qwen2", dtype=torch.float32)
    modules = quantize(model, recipe).modules
    assert isinstance(modules["lm_head"], Int8DynamicLinear)
    assert isinstance(modules["model.layers.1.mlp.down_proj"], Int8DynamicLinear)
    assert isinstance(modules["model.layers.1.mlp.up_proj"], Int4Int8Linear)
    with pytest.raises(ViasdError, match="int8 already"):
        QuantRecipe.parse("int8:int8=lm_head")
    from viasd.methods import parse_method

    assert parse_method("plain:quant=int4a8m").options["quant"] == recipe  # parsed once, into the recipe


def test_int4a8_refuses_layers_it_cannot_group():
    with pytest.raises(ViasdError, match="multiple of 32"):
        Int4Int8Linear.from_linear(nn.Linear(80, 8))
    with pytest.raises(ViasdError, match="fixed at 32"):
        QuantRecipe.parse("int4a8:group=128")


def test_smoothing_tames_an_outlier_channel():
    layer = linear(dtype=torch.float32)
    x = torch.randn(16, 256)
    x[:, 17] *= 80.0  # one activation channel far larger than the rest, as in the MLP down projections
    ranges = x.abs().amax(dim=0)
    from viasd.views.quantize import smoothing

    plain = Int8DynamicLinear.from_linear(layer)
    smooth = Int8DynamicLinear.from_linear(layer, smoothing(ranges, layer.weight, 0.5))
    with torch.inference_mode():
        want = layer(x)
        assert rel_error(smooth(x), want) < 0.5 * rel_error(plain(x), want)


def test_recipes_parse_and_refuse_bad_values():
    recipe = QuantRecipe.parse("int8:smooth=0.5:keep=*.mlp.down_proj,lm_head")
    assert recipe == QuantRecipe("int8", ("*.mlp.down_proj", "lm_head"), 0.5)
    assert QuantRecipe.parse(recipe.name) == recipe and QuantRecipe.parse("int4:group=32").group_size == 32
    assert recipe.keeps("model.layers.3.mlp.down_proj") and not recipe.keeps("model.layers.3.mlp.up_proj")
    for text, message in (
        ("int3", "unknown quantization"),
        ("int8:smooth=2", "smoothing must be in"),
        ("int4:smooth=0.5", "smoothing applies to int8"),
        ("int4:group=48", "group size"),
        ("int8:speed=9", "bad quantization option"),
    ):
        with pytest.raises(ViasdError, match=message):
            QuantRecipe.parse(text)


def test_a_view_swaps_quantized_layers_in_and_leaves_the_model_as_it_was():
    model = tiny_model("qwen2", dtype=torch.float32)
    params = {name: (p.data_ptr(), p.clone()) for name, p in model.named_parameters()}
    q = quantize(model, QuantRecipe("int8", keep=("lm_head",)), [PROMPT])
    assert "lm_head" not in q.modules and len(q.modules) == 4 * 7  # q, k, v, o, gate, up, down per layer
    # No copy of the model's own weights: its tensors are the same, unchanged; the copies are int8.
    for name, p in model.named_parameters():
        assert p.data_ptr() == params[name][0] and torch.equal(p, params[name][1])
    linear_bytes = sum(m.weight_t.numel() * 4 for m in q.modules.values())  # their fp32 originals
    assert q.nbytes() < 0.35 * linear_bytes
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        with applied(model, View(linears=q)):
            inside = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert torch.equal(before, after) and not torch.equal(before, inside)
    assert rel_error(inside, before) < 0.15  # random tiny layers amplify rounding more than trained ones
    # A quantized view with layers skipped too: the copies of a skipped layer are simply not used.
    both = View(mask=LayerMask.skipping(4, [2]), linears=q)
    with torch.inference_mode(), applied(model, both):
        skipped = model(input_ids=ids).logits
    assert not torch.equal(skipped, inside) and torch.equal(model(input_ids=ids).logits, before)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_exact_methods_stay_exact_with_a_quantized_drafter_and_a_quantized_target(arch):
    target = tiny_model(arch, dtype=torch.float32)
    drafter_model = tiny_model(arch, layers=2, seed=1, dtype=torch.float32)
    tok = tiny_tokenizer(64)
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(PROMPT, config)
    for kind in ("int8", "int8wo", "int4", "int4a8"):
        drafter = ModelDrafter(drafter_model, View(linears=quantize(drafter_model, QuantRecipe(kind))))
        small = SpeculativeDecoder(target, tok, drafter, gamma=4).generate(PROMPT, config)
        assert small.tokens == plain.tokens, kind
    # The target's own int8 view drafting for it (no second model): exact, and a far better guesser.
    own = View(linears=quantize(target, QuantRecipe("int8")))
    out = SpeculativeDecoder(target, tok, ModelDrafter(target, own), gamma=4).generate(PROMPT, config)
    assert out.tokens == plain.tokens and out.stats.rejection_rate < 0.5 * small.stats.rejection_rate
    # A quantized target is another model: SD reproduces plain decoding of that model. Attention over a block
    # and over one token differ in the last bits, and now and then that moves an activation across a rounding
    # boundary of its int8 code; so the two may part, but only where that model nearly ties.
    fast = PlainDecoder(target, tok, view=own).generate(PROMPT, config)
    sd = SpeculativeDecoder(target, tok, ModelDrafter(drafter_model), gamma=4, view=own).generate(PROMPT, config)
    assert_same_until_a_near_tie(target, own, sd.tokens, fast.tokens)
    assert KVSession(target, own).base_view == own
    # Likewise for the int4 x int8 target, whose blocks go through the compiled kernel where there is one.
    four = View(linears=quantize(target, QuantRecipe("int4a8")))
    fast = PlainDecoder(target, tok, view=four).generate(PROMPT, config)
    sd = SpeculativeDecoder(target, tok, ModelDrafter(drafter_model), gamma=4, view=four).generate(PROMPT, config)
    assert_same_until_a_near_tie(target, four, sd.tokens, fast.tokens)


def test_a_quantized_slim_view_keeps_the_target_cache_equal_to_a_fresh_pass():
    """VIA-SD with the target's int8 view as its slim verifier: pending entries written by the quantized view
    never leak into the target's committed cache (docs/design.md, "Caches")."""
    target = tiny_model("qwen2", dtype=torch.float32)
    own = View(linears=quantize(target, QuantRecipe("int8")))
    drafter = ModelDrafter(tiny_model("qwen2", layers=2, seed=1, dtype=torch.float32))
    policy = RoundPolicy(Gate("confidence", (0.02, 0.6)), cap=6)
    via = TieredDecoder(target, tiny_tokenizer(64), drafter, [own], policy)
    for n in (7, 25):
        out = via.generate(PROMPT, GenerationConfig(max_new_tokens=n, ignore_eos=True))
        assert out.stats.tiers["slim"].calls > 0
        session = via.session
        assert session.tokens == (PROMPT + out.tokens)[: len(session.tokens)]
        assert_cache_equals(session.cache, fresh_cache(target, session.tokens), len(session.tokens), atol=1e-5)


@pytest.mark.parametrize(
    "spec", ["int8", "int8:smooth=0.5:keep=lm_head", "int8wo", "int4:group=32", "int4a8", "int4a8m"]
)
def test_quantized_copies_are_cached_once_and_a_damaged_file_is_made_again(tmp_path, monkeypatch, spec):
    from viasd.views import store as quant_cache

    model = tiny_model("qwen2", dtype=torch.float32)
    recipe = QuantRecipe.parse(spec)
    notes: list[str] = []
    first = quant_cache.cached_quantize(model, recipe, lambda: [PROMPT], root=tmp_path, log=notes.append)
    path = quant_cache.cache_path(model, recipe, tmp_path)
    assert path.is_file() and not notes
    ids = torch.tensor([PROMPT])

    def logits(linears):
        with torch.inference_mode(), applied(model, View(linears=linears)):
            return model(input_ids=ids).logits

    with monkeypatch.context() as patch:
        patch.setattr(quant_cache, "quantize", lambda *a, **k: pytest.fail("quantized again"))
        again = quant_cache.cached_quantize(model, recipe, lambda: [PROMPT], root=tmp_path, log=notes.append)
    assert torch.equal(logits(again), logits(first)) and not notes
    # A truncated file, or one of another model, is refused and replaced.
    truncated = path.with_name("truncated")  # a new file: the copies loaded above may still map the old one
    truncated.write_bytes(path.read_bytes()[:-100])
    truncated.replace(path)
    remade = quant_cache.cached_quantize(model, recipe, lambda: [PROMPT], root=tmp_path, log=notes.append)
    assert len(notes) == 1 and "cannot be used" in notes[0] and torch.equal(logits(remade), logits(first))
    other = tiny_model("qwen2", dtype=torch.float32, seed=4)
    foreign = quant_cache.cache_path(other, recipe, tmp_path)
    foreign.parent.mkdir(parents=True, exist_ok=True)
    foreign.write_bytes(path.read_bytes())
    quant_cache.cached_quantize(other, recipe, lambda: [PROMPT], root=tmp_path, log=notes.append)
    assert len(notes) == 2 and "another model" in notes[1]


@pytest.mark.parametrize("kind", ["int8", "int4a8"])
def test_siblings_computed_together_equal_their_own_products(kind):
    """q, k and v (and gate and up) read one input: quantized once and multiplied in one product, each gets exactly
    what its own product would give."""
    model = tiny_model("qwen2", dtype=torch.float32)
    q = quantize(model, QuantRecipe(kind))
    attention = q.modules["model.layers.1.self_attn.q_proj"]
    assert (
        attention.siblings is not None and attention.siblings is q.modules["model.layers.1.self_attn.v_proj"].siblings
    )
    x = torch.randn(3, 5, 64)
    with torch.inference_mode():
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            module = q.modules[f"model.layers.1.{name}"]
            assert torch.allclose(module(x), module.product(x), atol=1e-5), name
    if kind == "int4a8":  # the members' codes are slices of the stacked layer's: no second copy in memory
        stacked = attention.siblings.fused.packed
        assert attention.packed.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()


def test_a_long_pass_of_a_weight_only_view_reads_the_prompt_with_the_models_own_weights():
    """On a CPU a long block is cheaper in bf16 than through int4 weight-only kernels: the positions of a pass that
    need no logits are read by the model's own weights, the rest by the view. Plain decoding and sd of the int4
    model still agree token for token, and the cache is what those two passes write."""
    target = tiny_model("qwen2", dtype=torch.float32)
    int4 = View(linears=quantize(target, QuantRecipe("int4")))
    start = QuantRecipe("int4").own_weights_from("cpu")
    assert start is not None and QuantRecipe("int4").own_weights_from("cuda") is None
    prompt = (PROMPT * 8)[: start + 6]
    session = KVSession(target, int4)
    logits = session.forward(prompt, keep=1)
    assert session.forward_passes == 1 and session.routes == {"split": 1}  # one pass, run in two parts
    own = KVSession(target)
    own.forward(prompt[:-1])
    with torch.inference_mode(), applied(target, int4):
        want = target(input_ids=torch.tensor([prompt[-1:]]), cache=own.cache, use_cache=True).logits[0, -1:]
    assert torch.allclose(logits, want.float(), atol=1e-5)
    assert_cache_equals(session.cache, own.cache, len(prompt), atol=1e-6)
    # A short pass (a block to verify) runs wholly in the view.
    whole = KVSession(target, int4)
    short = prompt[: start - 1]
    with torch.inference_mode(), applied(target, int4):
        ref = target(input_ids=torch.tensor([short])).logits[0, -1:]
    assert torch.allclose(whole.forward(short, keep=1), ref.float(), atol=1e-5)
    # Exactness survives the split: sd of the int4 target reproduces plain decoding of it on the long prompt.
    tok, config = tiny_tokenizer(64), GenerationConfig(max_new_tokens=30, ignore_eos=True)
    fast = PlainDecoder(target, tok, view=int4).generate(prompt, config)
    drafter = ModelDrafter(tiny_model("qwen2", layers=2, seed=1, dtype=torch.float32))
    sd = SpeculativeDecoder(target, tok, drafter, gamma=4, view=int4).generate(prompt, config)
    assert sd.tokens == fast.tokens
