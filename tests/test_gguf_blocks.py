"""A GGUF file's own blocks (Q4_K, Q4_0 and Q4_1 as int4a8, Q6_K as 6-bit weights, Q8_0, Q5_K, Q5_0 and Q5_1 as 8-bit
ones; views/gguf.py) and the `gguf` recipe built on them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from helpers import PROMPT, assert_same_until_a_near_tie, qwen2_with_gguf, random_blocks, random_q4k, random_q6k
from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.decode.speculative import SpeculativeDecoder
from viasd.drafters.model_drafter import ModelDrafter
from viasd.errors import ViasdError
from viasd.kernels import w4a8, w6a8, w8a8
from viasd.views.gguf import (
    GgufWeights,
    has_own_blocks,
    q4_0_to_int4a8,
    q4_1_to_int4a8,
    q4k_to_int4a8,
    q5_0_to_int8a8,
    q5_1_to_int8a8,
    q5k_to_int8a8,
    q6k_to_int6a8,
    q8_0_to_int8a8,
)
from viasd.views.linears import Int4Int8Linear, Int6Int8Linear, Int8Int8Linear, Int8WeightOnlyLinear
from viasd.views.quantize import quantizable, quantize
from viasd.views.recipe import QuantRecipe
from viasd.views.store import cached_quantize
from viasd.views.view import View

Q4_K = gguf.GGMLQuantizationType.Q4_K
Q6_K = gguf.GGMLQuantizationType.Q6_K


def test_q4k_blocks_are_the_weights_the_gguf_library_reads_from_them():
    raw = random_q4k(24, 768, seed=0)
    want = torch.from_numpy(gguf_dequantize(raw, Q4_K).astype(np.float32))  # the gguf package's own reading
    four = q4k_to_int4a8(raw, 24, 768)
    assert four.packed.shape == (2, 96, 64) and four.scale.shape == four.low.shape == (2, 24, 16) and four.n == 24
    got = w4a8.dequantize(four)
    # The same codes; each group's scale d * sc and minimum dmin * m rounded once to fp16.
    assert (got - want).norm() / want.norm() < 2e-3
    x = torch.randn(3, 768)
    exact = x @ want.T
    assert (w4a8.product(x, four) - exact).norm() / exact.norm() < 0.02  # int8 activations


def test_q6k_blocks_are_the_weights_the_gguf_library_reads_from_them():
    raw = random_q6k(24, 768, seed=0)
    six = q6k_to_int6a8(raw, 24, 768)
    want = torch.from_numpy(gguf_dequantize(raw, Q6_K).astype(np.float32))
    assert torch.equal(w6a8.dequantize(six), want)  # the same codes and scales: no rounding at all
    assert six.low.shape == (2, 96, 64) and six.high.shape == (2, 48, 64) and six.sub.shape == (2, 48, 16)
    assert six.d.shape == (2, 3, 16) and int(w6a8.codes_of(six).max()) <= 63


# Per block type a kernel takes as it is: its converter and the kernel's module (format).
EXACT = {
    "Q4_0": (q4_0_to_int4a8, w4a8),
    "Q4_1": (q4_1_to_int4a8, w4a8),
    "Q8_0": (q8_0_to_int8a8, w8a8),
    "Q5_K": (q5k_to_int8a8, w8a8),
    "Q5_0": (q5_0_to_int8a8, w8a8),
    "Q5_1": (q5_1_to_int8a8, w8a8),
}


@pytest.mark.parametrize("kind", EXACT)
def test_blocks_taken_as_they_are_are_exactly_the_weights_the_gguf_library_reads(kind):
    convert, module = EXACT[kind]
    raw = random_blocks(kind, 24, 768, seed=0)
    weights = convert(raw, 24, 768)
    want = torch.from_numpy(gguf_dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32))
    assert torch.equal(module.dequantize(weights), want)  # the file's own codes, scales and minimums: no rounding
    x = torch.randn(3, 768)
    exact = x @ want.T
    assert (module.product(x, weights) - exact).norm() / exact.norm() < 0.02  # int8 activations


def test_q4_0_blocks_whose_minimum_leaves_fp16_are_refused():
    raw = random_blocks("Q4_0", 2, 64, seed=0)
    raw.reshape(-1, 18)[0, 0:2] = np.array([60000.0], dtype=np.float16).view(np.uint8)  # -8d: past fp16's range
    assert q4_0_to_int4a8(raw, 2, 64) is None


def mixed(name: str) -> str:
    """Every block type a kernel takes, and one (TQ2_0) none does, across a tiny model's layers."""
    kinds = {"q_proj": "Q4_0", "k_proj": "Q4_1", "v_proj": "Q8_0", "o_proj": "Q5_K", "gate_proj": "TQ2_0"}
    first = ".0." in name
    if name.endswith("up_proj"):
        return "Q5_0" if first else "Q5_1"
    return kinds.get(name.rsplit(".", 1)[-1], "Q4_K" if first else "Q6_K")


def test_the_gguf_recipe_runs_every_block_type_a_kernel_takes_and_comes_back_from_the_cache(tmp_path: Path):
    model, path, in_blocks = qwen2_with_gguf(tmp_path, kind_of=mixed)
    recipe = QuantRecipe.parse("gguf")
    made = cached_quantize(model, recipe, list, root=tmp_path / "q", gguf=lambda: GgufWeights(path))
    expected = {"Q4_0": Int4Int8Linear, "Q4_1": Int4Int8Linear, "Q4_K": Int4Int8Linear, "Q6_K": Int6Int8Linear,
                "Q8_0": Int8Int8Linear, "Q5_K": Int8Int8Linear, "Q5_0": Int8Int8Linear, "Q5_1": Int8Int8Linear,
                "TQ2_0": Int8WeightOnlyLinear}  # fmt: skip
    layers = quantizable(model)
    for name in in_blocks:
        module = made.modules[name]
        assert type(module) is expected[mixed(name)], name
        if mixed(name) in EXACT:
            assert torch.equal(EXACT[mixed(name)][1].dequantize(module.weights), layers[name].weight), name
    assert made.from_file == len(in_blocks) - 2  # the two gate projections (TQ2_0) have no kernel

    def unusable() -> GgufWeights:
        raise AssertionError("a sound cache needs no GGUF file")

    loaded = cached_quantize(model, recipe, list, root=tmp_path / "q", gguf=unusable)
    assert loaded.from_file == made.from_file
    assert {n: type(m) for n, m in loaded.modules.items()} == {n: type(m) for n, m in made.modules.items()}
    with torch.inference_mode():
        for name in in_blocks:
            x = torch.randn(1, 5, layers[name].in_features)
            assert torch.equal(loaded.modules[name](x), made.modules[name](x)), name
    view = View(linears=loaded)
    tok, config = tiny_tokenizer(64), GenerationConfig(max_new_tokens=30, ignore_eos=True)
    fast = PlainDecoder(model, tok, view=view).generate(PROMPT, config)
    drafter = ModelDrafter(tiny_model("qwen2", hidden=256, layers=1, seed=1, dtype=torch.float32))
    sd = SpeculativeDecoder(model, tok, drafter, gamma=4, view=view).generate(PROMPT, config)
    assert_same_until_a_near_tie(model, view, sd.tokens, fast.tokens)


def test_the_gguf_recipe_takes_the_files_blocks_and_makes_the_rest_int8(tmp_path: Path):
    model, path, in_blocks = qwen2_with_gguf(tmp_path)
    source = GgufWeights(path)
    linears = quantize(model, QuantRecipe.parse("gguf"), gguf=source)
    assert QuantRecipe.parse("gguf").name == "int4a8:gguf" and linears.from_file == len(in_blocks) > 0
    layers = quantizable(model)
    for name, module in linears.modules.items():
        if name.endswith("v_proj"):  # the file's 6-bit blocks, as they are
            assert isinstance(module, Int6Int8Linear)
            weight = w6a8.dequantize(module.weights)
            assert torch.equal(weight, layers[name].weight)
        elif name in in_blocks:
            assert isinstance(module, Int4Int8Linear)
            weight = w4a8.dequantize(module.weights)
            assert (weight - layers[name].weight).norm() / layers[name].weight.norm() < 2e-3
        else:  # the file keeps this one in float32: int8 weights, not a 4-bit rounding
            assert isinstance(module, Int8WeightOnlyLinear)
    # Blocks that are not this weight (another layer's) are refused, not used.
    down, up = "model.layers.0.mlp.down_proj", "model.layers.0.mlp.up_proj"
    assert source.int4a8(up, layers[up].weight) is not None
    assert source.int4a8(up, layers["model.layers.1.mlp.up_proj"].weight) is None
    assert source.int4a8(down, layers[down].weight) is not None
    value = "model.layers.0.self_attn.v_proj"
    assert source.int4a8(value, layers[value].weight) is None  # 6-bit blocks are not 4-bit ones
    assert source.int6a8(value, layers[value].weight) is not None
    assert source.int6a8(value, layers["model.layers.1.self_attn.v_proj"].weight) is None
    # Without a file the recipe says what it needs.
    with pytest.raises(ViasdError, match="GGUF file"):
        quantize(model, QuantRecipe.parse("gguf"))
    with pytest.raises(ViasdError, match="int4a8:gguf"):
        QuantRecipe.parse("int8:gguf")


def test_a_cached_gguf_quantization_comes_back_with_its_mixed_layers(tmp_path: Path):
    model, path, in_blocks = qwen2_with_gguf(tmp_path)
    recipe = QuantRecipe.parse("gguf")
    made = cached_quantize(model, recipe, list, root=tmp_path / "q", gguf=lambda: GgufWeights(path))

    def unusable() -> GgufWeights:
        raise AssertionError("a sound cache needs no GGUF file")

    loaded = cached_quantize(model, recipe, list, root=tmp_path / "q", gguf=unusable)
    assert loaded.from_file == made.from_file == len(in_blocks)
    assert {n: type(m) for n, m in loaded.modules.items()} == {n: type(m) for n, m in made.modules.items()}
    x = torch.randn(1, 5, 256)
    with torch.inference_mode():
        for name in ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"):
            assert torch.equal(loaded.modules[name](x), made.modules[name](x))


def test_exact_methods_stay_exact_on_the_gguf_view_of_a_target(tmp_path: Path):
    model, path, _ = qwen2_with_gguf(tmp_path)
    view = View(linears=quantize(model, QuantRecipe.parse("gguf"), gguf=GgufWeights(path)))
    tok, config = tiny_tokenizer(64), GenerationConfig(max_new_tokens=30, ignore_eos=True)
    fast = PlainDecoder(model, tok, view=view).generate(PROMPT, config)
    drafter = ModelDrafter(tiny_model("qwen2", hidden=256, layers=1, seed=1, dtype=torch.float32))
    sd = SpeculativeDecoder(model, tok, drafter, gamma=4, view=view).generate(PROMPT, config)
    assert_same_until_a_near_tie(model, view, sd.tokens, fast.tokens)


def test_whether_a_models_file_has_4bit_blocks_is_read_from_the_file(tmp_path: Path):
    _, path, _ = qwen2_with_gguf(tmp_path)
    assert has_own_blocks("tiny", str(path))
    plain = gguf.GGUFWriter(tmp_path / "f32.gguf", "qwen2")
    plain.add_tensor("blk.0.attn_q.weight", np.zeros((4, 256), dtype=np.float32))
    plain.write_header_to_file()
    plain.write_kv_data_to_file()
    plain.write_tensors_to_file()
    plain.close()
    assert not has_own_blocks("tiny", str(tmp_path / "f32.gguf"))
    assert not has_own_blocks("tiny", str(tmp_path))  # a directory: no file to read


def test_query_and_key_rows_a_llama_conversion_interleaved_are_put_back_in_the_models_order(tmp_path: Path):
    """Llama-family GGUF files store each query and key head's rows with the two halves of its rotary dimensions
    interleaved; the view takes those blocks in the model's row order, and still refuses rows in any other."""
    model = tiny_model("llama", hidden=256, layers=1)
    heads = {"q_proj": model.config.num_attention_heads, "k_proj": model.config.num_key_value_heads}
    writer = gguf.GGUFWriter(tmp_path / "llama.gguf", "llama")
    writer.add_block_count(1)
    writer.add_head_count(heads["q_proj"])
    writer.add_head_count_kv(heads["k_proj"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 1)
    layers = quantizable(model)
    with torch.no_grad():
        for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
            name = f"model.layers.0.self_attn.{part}"
            rows, columns = layers[name].weight.shape
            raw = random_blocks("Q4_1", rows, columns, i)
            layers[name].weight.copy_(torch.from_numpy(gguf_dequantize(raw, gguf.GGMLQuantizationType.Q4_1)))
            if part in heads:  # GGUF row 2j + h of a head: the model's row j + h * dim / 2
                raw = raw.reshape(heads[part], 2, rows // heads[part] // 2, -1).swapaxes(1, 2).reshape(raw.shape)
            writer.add_tensor(f"{names.get_name(name)}.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    source = GgufWeights(tmp_path / "llama.gguf")
    for part in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{part}"
        four = source.int4a8(name, layers[name].weight)
        assert four is not None and torch.equal(w4a8.dequantize(four), layers[name].weight), part
    query = "model.layers.0.self_attn.q_proj"
    assert source.int4a8(query, layers[query].weight.flip(0)) is None  # rows in another order: not taken
