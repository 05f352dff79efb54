"""A model as its GGUF file stores it (models/stored.py): the same model as the dense one transformers would make from
the file, without its dense weights, until a method asks for them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from helpers import random_blocks
from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.hf_assisted import HFAssistedDecoder
from viasd.decode.plain import PlainDecoder
from viasd.errors import ViasdError
from viasd.models.fingerprint import model_fingerprint
from viasd.models.gguf_file import GgufFile
from viasd.models.network import transformers_model
from viasd.models.stored import (
    BlockEmbedding,
    FileLinear,
    FileTensor,
    build,
    densify,
    has_dense_weights,
    is_stored,
    output_rows,
)
from viasd.views.gguf import GgufWeights
from viasd.views.quantize import quantize
from viasd.views.recipe import QuantRecipe
from viasd.views.view import View

ARCHES = {"qwen2": gguf.MODEL_ARCH.QWEN2, "llama": gguf.MODEL_ARCH.LLAMA, "qwen3": gguf.MODEL_ARCH.QWEN3}
PROMPT = [3, 17, 5, 42, 9, 30, 11, 7]


def kind_of(name: str, columns: int) -> str:
    """A Q4_K_M-like mix: Q4_K where rows are whole super-blocks, Q6_K for the value projections, Q8_0 for the
    embedding (the tiny models' rows are 256 wide: no smaller type is needed)."""
    if name.endswith("embed_tokens.weight"):
        return "Q8_0"
    if name.endswith("v_proj.weight") or name == "lm_head.weight":
        return "Q6_K"
    return "Q4_K" if columns % 256 == 0 else "Q8_0"


def write_gguf(model: torch.nn.Module, path: Path, arch: str) -> None:
    """Write every tensor of `model` into a GGUF file, matrices as blocks of `kind_of`'s types, and set the model's
    weights to what those blocks hold, so that the dense model is what transformers would read from the file.
    Llama's query and key rows are interleaved per head, as its conversion to GGUF does."""
    layers = model.config.num_hidden_layers
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_head_count(model.config.num_attention_heads)
    writer.add_head_count_kv(model.config.num_key_value_heads)
    names = gguf.get_tensor_name_map(ARCHES[arch], layers)
    heads = {"q_proj": model.config.num_attention_heads, "k_proj": model.config.num_key_value_heads}
    with torch.no_grad():
        for seed, (name, parameter) in enumerate(model.named_parameters()):
            module, _, key = name.rpartition(".")
            stored = f"{names.get_name(module)}.{key}"
            if parameter.dim() != 2:
                writer.add_tensor(stored, parameter.float().numpy())
                continue
            rows, columns = parameter.shape
            kind = gguf.GGMLQuantizationType[kind_of(name, columns)]
            raw = random_blocks(kind.name, rows, columns, seed)
            parameter.copy_(torch.from_numpy(gguf_dequantize(raw, kind).astype(np.float32)))
            part = module.rsplit(".", 1)[-1]
            if arch == "llama" and part in heads:  # GGUF row 2j + h of a head: the model's row j + h * dim / 2
                raw = raw.reshape(heads[part], 2, rows // heads[part] // 2, -1).swapaxes(1, 2).reshape(raw.shape)
            writer.add_tensor(stored, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def pair(tmp_path: Path, arch: str, dtype: torch.dtype = torch.float32, tied: bool = False):
    """A dense tiny model whose weights are a GGUF file's blocks, and the model built from that file."""
    dense = tiny_model(arch, hidden=256, layers=2, vocab_size=96, dtype=dtype)
    if tied:
        dense.config.tie_word_embeddings = True
        dense.tie_weights()
    write_gguf(dense, tmp_path / "model.gguf", arch)
    return dense, build(GgufFile(tmp_path / "model.gguf"), dense.config, dtype)


@pytest.mark.parametrize(("arch", "tied"), [("qwen2", False), ("qwen2", True), ("llama", False), ("qwen3", False)])
def test_a_stored_model_is_the_dense_model_without_its_weights(tmp_path: Path, arch: str, tied: bool):
    dense, stored = pair(tmp_path, arch, tied=tied)
    assert is_stored(stored) and not has_dense_weights(stored)
    assert model_fingerprint(stored) == model_fingerprint(dense)  # profiles and heads made for one fit the other
    ids = torch.tensor([PROMPT])
    assert torch.equal(stored.get_input_embeddings()(ids), dense.get_input_embeddings()(ids))
    rows = torch.tensor([0, 5, 95])
    assert torch.equal(output_rows(stored, rows), dense.get_output_embeddings().weight[rows])
    assert is_stored(stored)  # looking rows up made no dense copy
    # Its own weights, where a pass asks for them, are the dense model's (query and key rows in the model's order).
    with torch.inference_mode():
        assert torch.equal(stored(ids).logits, dense(ids).logits)


def test_the_gguf_view_of_a_stored_model_takes_its_blocks_and_decodes_as_the_dense_models_view(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    dense, stored = pair(tmp_path, "qwen2")
    recipe = QuantRecipe.parse("gguf")
    from_stored = quantize(stored, recipe)
    from_dense = quantize(dense, recipe, gguf=GgufWeights(tmp_path / "model.gguf"))
    assert from_stored.from_file == from_dense.from_file == len(from_stored.modules)
    config = GenerationConfig(max_new_tokens=24)
    tok = tiny_tokenizer(96)
    got = PlainDecoder(stored, tok, View(linears=from_stored)).generate(PROMPT, config).tokens
    want = PlainDecoder(dense, tok, View(linears=from_dense)).generate(PROMPT, config).tokens
    assert got == want
    assert is_stored(stored) and "dense" not in capsys.readouterr().err  # no dense copy was made, nor said


def test_densify_gives_a_stored_model_the_dense_weights_once_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    dense, stored = pair(tmp_path, "qwen2", dtype=torch.bfloat16, tied=True)
    assert densify(stored, "quant none asks for it")
    assert "making its dense bf16 copy from the file (quant none asks for it)" in capsys.readouterr().err
    assert not any(isinstance(module, (FileLinear, BlockEmbedding)) for module in stored.modules())
    assert has_dense_weights(stored) and not densify(stored, "again")
    assert stored.get_output_embeddings().weight is stored.get_input_embeddings().weight  # tied, as transformers ties
    assert model_fingerprint(stored) == model_fingerprint(dense)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        assert torch.equal(stored(ids).logits, dense(ids).logits)


def test_a_stored_model_is_built_and_run_without_transformers_model_classes(tmp_path: Path):
    """The start's import floor: a model built from a file is viasd's own modules (models/network.py), so neither
    building, preparing nor running it imports transformers' model code (torch's compiler comes with it: seconds)."""
    dense, _ = pair(tmp_path, "qwen2")
    dense.config.save_pretrained(tmp_path / "described")
    code = f"""
import json, sys, torch
from transformers import AutoConfig
from viasd.models.gguf_file import GgufFile
from viasd.models.stored import build
from viasd.passes.prepare import prepare
config = AutoConfig.from_pretrained({str(tmp_path / "described")!r})
model = prepare(build(GgufFile({str(tmp_path / "model.gguf")!r}), config, torch.bfloat16))
model(input_ids=torch.tensor([{PROMPT}]))
heavy = ("transformers.modeling_utils", "transformers.masking_utils", "torch._dynamo", "accelerate")
classes = [m for m in sys.modules if ".models." in m and ".modeling_" in m and not m.endswith(".modeling_auto")]
print(json.dumps([type(model).__module__, sorted(m for m in sys.modules if m.startswith(heavy)) + classes]))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    module, imported = json.loads(run.stdout.splitlines()[-1])
    assert module == "viasd.models.network"
    assert imported == []


def test_transformers_model_of_a_stored_models_weights_computes_what_it_does(tmp_path: Path):
    """hf-assisted runs transformers' own generate: it gets transformers' model, sharing the stored model's dense
    weights, with the same logits and greedy tokens."""
    _, stored = pair(tmp_path, "llama")
    assert densify(stored, "hf-assisted runs the dense target")
    theirs = transformers_model(stored)
    assert type(theirs).__name__ == "LlamaForCausalLM" and transformers_model(theirs) is theirs
    assert theirs.lm_head.weight.data_ptr() == stored.lm_head.weight.data_ptr()  # shared, not copied
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        assert torch.equal(theirs(ids).logits, stored(ids).logits)
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    tok = tiny_tokenizer(96)
    want = PlainDecoder(stored, tok).generate(PROMPT, config).tokens
    assert HFAssistedDecoder(theirs, tok, theirs, gamma=3).generate(PROMPT, config).tokens == want


@pytest.mark.parametrize("tied", [False, True])
def test_a_stored_models_fingerprint_holds_after_a_pass_made_some_of_its_dense_weights(tmp_path: Path, tied: bool):
    """A pass that runs a layer's own weights makes that layer's dense copy on the spot (calibration's teacher does);
    the model is still the file's, so a profile calibrated then fits the model that runs from its blocks later."""
    dense, stored = pair(tmp_path, "qwen2", tied=tied)
    assert stored.get_output_embeddings().weight is not None  # the head's copy: a second tensor where it is tied
    assert stored.model.layers[0].mlp.up_proj.weight is not None
    assert model_fingerprint(stored) == model_fingerprint(dense)


def test_pass_costs_of_a_stored_models_gguf_view_make_no_dense_copy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`viasd costs --views gguf,skip=R+gguf` on a GGUF target reads the prefix with its gguf view: a 14B model's
    dense copy (28 GB) would not fit where its blocks (9 GB) run."""
    from viasd.calibration.costs import measure_views

    _, stored = pair(tmp_path, "qwen2")
    gguf = View(linears=quantize(stored, QuantRecipe.parse("gguf")))
    seconds = measure_views(stored, {"gguf": gguf}, [1, 3], list(PROMPT) * 4, prefix=8, repeats=1, base=gguf)
    assert list(seconds) == ["gguf"] and all(s > 0 for s in seconds["gguf"])
    assert is_stored(stored) and "dense" not in capsys.readouterr().err


def test_a_file_that_does_not_hold_the_configs_model_is_refused_in_one_line(tmp_path: Path):
    pair(tmp_path, "qwen2")
    other = tiny_model("qwen2", hidden=256, layers=2, vocab_size=128)  # a vocabulary the file does not have
    with pytest.raises(ViasdError, match=r"token_embd\.weight is 96 x 256") as caught:
        build(GgufFile(tmp_path / "model.gguf"), other.config, torch.float32)
    assert "\n" not in str(caught.value)
    padded = tiny_model("qwen2", hidden=256, layers=2, vocab_size=80)  # fewer tokens than the file has rows (Qwen's)
    assert build(GgufFile(tmp_path / "model.gguf"), padded.config, torch.float32).config.vocab_size == 96
    deeper = tiny_model("qwen2", hidden=256, layers=3, vocab_size=96)
    with pytest.raises(ViasdError, match=r"no tensor for model\.layers\.2"):
        build(GgufFile(tmp_path / "model.gguf"), deeper.config, torch.float32)


@pytest.mark.parametrize("cut", [3, 100, 5000, -1000])
def test_a_truncated_or_foreign_file_is_refused_in_one_line(tmp_path: Path, cut: int):
    pair(tmp_path, "qwen2")
    data = (tmp_path / "model.gguf").read_bytes()
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(data[:cut])  # its first `cut` bytes, or all but its last -cut
    with pytest.raises(ViasdError) as caught:
        GgufFile(damaged)
    assert "\n" not in str(caught.value) and "damaged.gguf" in str(caught.value)
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(ViasdError, match="not a GGUF file"):
        GgufFile(tmp_path / "text.gguf")


def test_the_index_reads_what_the_gguf_package_reads(tmp_path: Path):
    pair(tmp_path, "llama")
    mine, theirs = GgufFile(tmp_path / "model.gguf"), gguf.GGUFReader(tmp_path / "model.gguf")
    assert mine.architecture == "llama" and mine.number("block_count") == 2
    assert set(mine.tensors) == {tensor.name for tensor in theirs.tensors}
    for tensor in theirs.tensors:
        data = np.ascontiguousarray(tensor.data)
        assert np.array_equal(np.asarray(mine.blocks(tensor.name)).reshape(-1), data.reshape(-1).view(np.uint8))
        if data.ndim == 2:
            index = np.array([0, data.shape[0] - 1, 1])
            assert np.array_equal(mine.rows(tensor.name, index), data[index].view(np.uint8))
            assert np.array_equal(mine.rows(tensor.name, np.arange(2, 5)), data[2:5].view(np.uint8))


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "Q5_0"])
def test_blocks_converted_a_chunk_of_rows_at_a_time_are_the_whole_tensors_conversion(
    monkeypatch: pytest.MonkeyPatch, kind: str
):
    from viasd.views import gguf as view_gguf

    raw = random_blocks(kind, 72, 512, seed=3)  # 72 rows: chunks of 32, 32 and 8 (a padded tile)
    whole = view_gguf.converted(kind, raw, 72, 512)
    monkeypatch.setattr(view_gguf, "_CHUNK_ROWS", 32)
    parted = view_gguf.converted(kind, raw, 72, 512)
    assert whole is not None and parted is not None and parted.n == whole.n == 72
    for got, want in zip(parted.tensors(), whole.tensors(), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0", "Q5_0"])
@pytest.mark.parametrize("rows", [16, 72, 1])
def test_the_c_repacker_lays_out_blocks_as_the_numpy_conversion_does(kind: str, rows: int):
    from viasd.views import gguf as view_gguf

    library = view_gguf.repacker()
    if isinstance(library, str):
        pytest.skip(library)
    raw = random_blocks(kind, rows, 768, seed=rows)  # three super-blocks a row; 72 rows end in a partial tile
    want = view_gguf._CONVERTERS[kind](raw, rows, 768)
    got = view_gguf._REPACKED[kind](library, raw, rows, 768)
    assert want is not None and got.n == want.n == rows
    for mine, theirs in zip(got.tensors(), want.tensors(), strict=True):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)


def test_a_stored_models_gguf_view_is_made_from_its_file_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from viasd.views import gguf as view_gguf
    from viasd.views.store import cache_path, cached_quantize

    if not view_gguf.fast_repacking():
        pytest.skip(str(view_gguf.repacker()))
    model = tiny_model("qwen2", hidden=256, layers=2, vocab_size=96, dtype=torch.float32)
    # Q4_K, Q6_K and Q8_0: every layer is one the repacker takes.
    write_gguf(model, tmp_path / "model.gguf", "qwen2")
    stored = build(GgufFile(tmp_path / "model.gguf"), model.config, torch.float32)
    recipe = QuantRecipe.parse("gguf")
    stale = cache_path(stored, recipe, tmp_path / "cache")
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"a copy an earlier viasd cached")
    made = cached_quantize(stored, recipe, lambda: [], root=tmp_path / "cache")
    assert made.from_file == len(made.modules) and not stale.exists()  # the file is the cache
    # Without the repacker the view is cached, as before (numpy's conversion takes seconds a gigabyte).
    monkeypatch.setattr(view_gguf, "fast_repacking", lambda: False)
    again = cached_quantize(stored, recipe, lambda: [], root=tmp_path / "cache")
    assert stale.is_file() and again.from_file == made.from_file
    for name, module in made.modules.items():
        for (key, mine), theirs in zip(module.named_buffers(), again.modules[name].buffers(), strict=True):
            assert torch.equal(mine, theirs), f"{name}/{key}"


def test_a_file_whose_view_does_not_fit_the_free_memory_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from viasd.models import memory
    from viasd.models.loading import load_model
    from viasd.models.stored import view_bytes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n")
    assert memory.available_bytes(meminfo) == 2048 * 1024
    assert memory.available_bytes(tmp_path / "missing") is None  # no such file: nothing known, nothing refused
    assert memory.too_large(10, None) is None and memory.too_large(10, 10) is None
    dense = tiny_model("qwen2", hidden=256, layers=2, vocab_size=96, dtype=torch.float32)
    write_gguf(dense, tmp_path / "model.gguf", "qwen2")
    needed = view_bytes(GgufFile(tmp_path / "model.gguf"))
    assert needed > 0
    monkeypatch.setattr(memory, "available_bytes", lambda: needed - 1)
    with pytest.raises(ViasdError) as refused:
        load_model(str(tmp_path / "model.gguf"))
    message = str(refused.value)
    assert "\n" not in message and "GB available" in message and "model.gguf" in message


def test_a_recipe_made_from_dense_weights_takes_a_stored_model_one_layer_at_a_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    dense, stored = pair(tmp_path, "qwen2", dtype=torch.bfloat16)
    recipe = QuantRecipe.parse("int4a8")
    from_stored, from_dense = quantize(stored, recipe), quantize(dense, recipe)
    assert is_stored(stored) and "dense" not in capsys.readouterr().err  # the model never held its dense copy
    for name, module in from_dense.modules.items():
        for mine, theirs in zip(from_stored.modules[name].buffers(), module.buffers(), strict=True):
            assert torch.equal(mine, theirs), name


def test_a_stored_models_fingerprint_is_remembered_for_its_file_and_made_again_when_the_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The next start reads the fingerprint from the cache instead of sampling the file's rows; a file changed in
    place, or a cache that cannot be written, gets the fingerprint of what the file holds now."""
    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path / "cache"))
    dense, stored = pair(tmp_path, "qwen2")
    want = model_fingerprint(dense)
    assert model_fingerprint(stored) == want
    path = tmp_path / "model.gguf"
    with monkeypatch.context() as patched:
        patched.setattr(FileTensor, "sample", lambda self, count=64: pytest.fail("sampled the file again"))
        assert model_fingerprint(build(GgufFile(path), dense.config, torch.float32)) == want
    with torch.no_grad():
        dense.model.norm.weight.add_(1.0)  # the same name, another final norm
    write_gguf(dense, path, "qwen2")
    changed = model_fingerprint(dense)
    assert changed != want and model_fingerprint(build(GgufFile(path), dense.config, torch.float32)) == changed
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path / "file" / "cache"))  # no folder can be made there
    assert model_fingerprint(build(GgufFile(path), dense.config, torch.float32)) == changed
