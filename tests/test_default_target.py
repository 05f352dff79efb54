"""The default target: a model from a GGUF file runs as the file stores it (its gguf view), any other model as loaded;
`--quant none` (a variant's `quant=none`) runs the dense copy; bad input says so in one line and runs the nearest
faithful target."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize as gguf_quantize

from helpers import PROMPT, qwen2_with_gguf
from tiny import tiny_model, tiny_tokenizer
from viasd import auto
from viasd.bench.command import _target_quant_name, run_profile
from viasd.cli_options import engine_spec
from viasd.decode.base import GenerationConfig
from viasd.engine import Engine, EngineSpec
from viasd.errors import ViasdError
from viasd.methods import METHODS, parse_method
from viasd.models.loading import LoadedModel
from viasd.views.gguf import has_own_blocks, stored_view
from viasd.views.recipe import AS_STORED, DENSE, QuantRecipe

GGUF = QuantRecipe.parse("gguf")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path / "cache"))  # views made here stay here
    monkeypatch.setattr(auto, "int4a8_is_fast", lambda device: True)  # as on an x86 CPU with the kernel built


def gguf_engine(tmp_path: Path, quant: object = AS_STORED) -> Engine:
    """An engine on a tiny Qwen2 loaded from a GGUF file with Q4_K and Q6_K blocks (its weights are theirs)."""
    model, path, _ = qwen2_with_gguf(tmp_path, dtype=torch.bfloat16)
    target = LoadedModel(model, tiny_tokenizer(model.config.vocab_size), str(path), str(path))
    return Engine(EngineSpec(target=str(path), drafter="d", device="cpu", quant=quant), target=target)  # type: ignore[arg-type]


def dense_engine(tmp_path: Path, quant: object = AS_STORED) -> Engine:
    """An engine on a tiny model from a directory: no GGUF file."""
    target = LoadedModel(tiny_model("qwen2", dtype=torch.float32), tiny_tokenizer(64), str(tmp_path), str(tmp_path))
    return Engine(EngineSpec(target=str(tmp_path), drafter="d", device="cpu", quant=quant), target=target)  # type: ignore[arg-type]


def blocks_gguf(path: Path, *kinds: str) -> Path:
    """A GGUF file that stores a weight in each of `kinds` (GGML type names), and a norm as F32."""
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_block_count(1)
    weight = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    for name, kind in zip(("attn_q", "attn_k", "attn_v"), kinds, strict=False):
        quant = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(f"blk.0.{name}.weight", gguf_quantize(weight, quant), raw_dtype=quant)
    writer.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_edge_parses_the_default_and_none_once():
    assert EngineSpec().quant == AS_STORED and engine_spec("t", "d").quant == AS_STORED
    assert engine_spec("t", "d", quant="none").quant == DENSE
    assert engine_spec("t", "d", quant="gguf").quant == GGUF
    assert parse_method("plain:quant=none").get("quant") == DENSE and parse_method("plain").get("quant") is None
    with pytest.raises(ViasdError, match="or none"):
        engine_spec("t", "d", quant="bf17")
    with pytest.raises(ViasdError, match="runs as 'file', 'none' or a quantization recipe"):
        EngineSpec(quant="bf16")  # type: ignore[arg-type]


def test_a_target_from_a_gguf_file_runs_as_its_gguf_view_by_default(tmp_path, capfd):
    engine = gguf_engine(tmp_path)
    assert engine.target_recipe() == GGUF
    described = engine.describe("plain")
    assert described["target_as_run"] == "gguf view of tiny.gguf" and described["exact"]
    assert described["target_view"] != "as loaded"
    assert engine.describe("plain:quant=none")["target_as_run"] == "bf16 copy of tiny.gguf"
    assert engine.describe("plain:quant=int8")["target_as_run"] == "int8 view of the bf16 weights"
    assert not capfd.readouterr().err  # nothing to say
    # via verifies against the view its profile was calibrated on; hf-assisted the dense copy; llama.cpp the file.
    assert [name for name, m in METHODS.items() if m.target == "dense"] == ["hf-assisted"]
    assert [name for name, m in METHODS.items() if m.target == "profile"] == ["via", "via-exact"]
    assert engine.target_as_run(parse_method("llama.cpp")) == "tiny.gguf, run by llama.cpp"


def test_the_default_gguf_view_is_exact_with_respect_to_itself(tmp_path):
    engine = gguf_engine(tmp_path)
    config = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    own = engine.generate(PROMPT, "plain", config).tokens
    assert engine.generate(PROMPT, "plain:quant=gguf", config).tokens == own
    assert engine.generate(PROMPT, "lookup", config).tokens == own


def test_none_restores_the_dense_copy(tmp_path, capfd):
    engine = gguf_engine(tmp_path, quant=DENSE)
    assert engine.target_recipe() is None and engine.target_recipe(GGUF) == GGUF  # a variant's quant= still wins
    described = engine.describe("plain")
    assert described["target_as_run"] == "bf16 copy of tiny.gguf" and described["target_view"] == "as loaded"
    assert not capfd.readouterr().err


def test_a_model_without_a_gguf_file_keeps_no_view(tmp_path, capfd):
    engine = dense_engine(tmp_path)
    assert engine.target_recipe() is None and not engine.from_gguf()
    assert engine.describe("plain")["target_as_run"] == "as loaded (fp32)"
    assert not capfd.readouterr().err


def test_none_for_a_model_without_a_gguf_file_says_so_in_one_line(tmp_path, capfd):
    engine = dense_engine(tmp_path, quant=DENSE)
    assert engine.target_recipe() is None and engine.target_recipe() is None
    engine.generate(PROMPT, "plain", GenerationConfig(max_new_tokens=2))
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not come from a GGUF file" in err[0] and "runs as loaded" in err[0]


def test_a_gguf_file_without_blocks_a_kernel_takes_runs_its_dense_copy_with_one_line(tmp_path, capfd):
    path = blocks_gguf(tmp_path / "tq.gguf", "TQ2_0")
    recipe, why = stored_view(str(path), str(path))
    assert recipe is None and why is not None and "TQ2_0" in why and "dense copy" in why
    target = LoadedModel(tiny_model("qwen2", dtype=torch.float32), tiny_tokenizer(64), str(path), str(path))
    engine = Engine(EngineSpec(target=str(path), drafter="d", device="cpu"), target=target)
    out = engine.generate(PROMPT, "plain", GenerationConfig(max_new_tokens=2))
    engine.generate(PROMPT, "lookup", GenerationConfig(max_new_tokens=2))
    assert out.tokens and engine.describe("plain")["target_as_run"] == "fp32 copy of tq.gguf"
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "TQ2_0" in err[0], err  # said once, not per method


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"])
def test_a_gguf_file_with_blocks_a_kernel_takes_runs_its_gguf_view(tmp_path, kind):
    path = blocks_gguf(tmp_path / "own.gguf", kind)
    assert stored_view(str(path), str(path)) == (GGUF, None) and has_own_blocks(str(path), str(path))


def test_block_types_without_a_kernel_beside_ones_with_are_named_in_one_line(tmp_path, capfd):
    path = blocks_gguf(tmp_path / "mixed.gguf", "Q4_1", "TQ1_0", "TQ2_0")
    recipe, why = stored_view(str(path), str(path))
    assert recipe == GGUF and why is not None and "\n" not in why
    assert "TQ1_0, TQ2_0 tensors run as int8 weight-only" in why and "no kernel for TQ1_0, TQ2_0" in why
    target = LoadedModel(tiny_model("qwen2", dtype=torch.float32), tiny_tokenizer(64), str(path), str(path))
    engine = Engine(EngineSpec(target=str(path), drafter="d", device="cpu"), target=target)
    assert engine.target_recipe() == GGUF and engine.target_recipe() == GGUF
    assert capfd.readouterr().err.strip().splitlines() == [f"target: {why}"]  # said once


def test_a_default_model_whose_file_is_not_at_hand_runs_its_dense_copy(tmp_path):
    recipe, why = stored_view("qwen2.5-coder-1.5b", "somewhere")  # the test's own empty cache
    assert recipe is None and why is not None and "viasd models --fetch qwen2.5-coder-1.5b --force" in why
    assert stored_view("not-a-model", str(tmp_path)) == (None, None)


def test_auto_chooses_among_exact_methods_over_the_gguf_view(tmp_path, monkeypatch):
    seen: dict = {}

    def choose(decoder_of, names, tokenizer, key):
        seen["names"] = list(names)
        return {"chosen": "plain", "candidates": list(names), "tokens_per_second": {}, "date": "now"}

    monkeypatch.setattr(auto, "choose", choose)
    engine = gguf_engine(tmp_path)
    assert engine.describe("auto")["target_as_run"] == "gguf view of tiny.gguf"
    assert "self" in seen["names"] and not any(name.startswith("self:") for name in seen["names"])
    (tmp_path / "dense").mkdir()
    dense = gguf_engine(tmp_path / "dense", quant=DENSE)
    assert dense.describe("auto")["target_as_run"] == "bf16 copy of tiny.gguf"
    assert any(name.startswith("self:drafter_quant=") for name in seen["names"])


def test_the_bench_records_the_target_as_run_for_resume(tmp_path):
    _, path, _ = qwen2_with_gguf(tmp_path)
    assert _target_quant_name(EngineSpec(target=str(path))) == "int4a8:gguf"
    assert _target_quant_name(EngineSpec(target=str(path), quant=DENSE)) is None  # as runs before the default
    assert _target_quant_name(EngineSpec(target=str(tmp_path))) is None
    assert _target_quant_name(EngineSpec(target=str(path), quant=QuantRecipe.parse("int8"))) == "int8"


def test_the_bench_names_the_profile_via_runs_on_the_targets_blocks(tmp_path):
    """A run's summary names the routing profile `via` uses: the one calibrated on the file's blocks where the target
    runs as them (before, it named the int4a8 one whatever the target ran as)."""
    _, path, _ = qwen2_with_gguf(tmp_path)
    on_blocks = run_profile(_target_quant_name(EngineSpec(target=str(path))), "cpu")
    assert on_blocks is not None and on_blocks.name.endswith(".gguf.json")
    dense = run_profile(_target_quant_name(EngineSpec(target=str(path), quant=DENSE)), "cpu")
    assert dense is not None and dense.name.endswith(".int4a8.json")  # int4a8 runs fast here (the fixture)


def test_via_and_llama_cpp_refuse_an_explicit_quant_but_not_the_default(tmp_path):
    engine = Engine(EngineSpec(target=str(tmp_path), quant=GGUF), target=dense_engine(tmp_path).target)
    with pytest.raises(ViasdError, match="takes no --quant"):
        engine.decoder("via")
    with pytest.raises(ViasdError, match="takes no --quant"):
        engine.decoder("llama.cpp")
    with pytest.raises(ViasdError, match=r"llama\.cpp reads GGUF files"):  # the default: the next check says more
        dense_engine(tmp_path).decoder("llama.cpp")
    with pytest.raises(ViasdError, match=r"llama\.cpp reads GGUF files"):  # none: llama.cpp runs the file all the same
        dense_engine(tmp_path, quant=DENSE).decoder("llama.cpp")


def test_where_the_4_bit_kernel_does_not_run_the_default_is_the_dense_copy(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(auto, "int4a8_is_fast", lambda device: False)  # a GPU, or a CPU without viasd's kernels
    engine = gguf_engine(tmp_path)
    assert engine.target_recipe() is None and engine.target_recipe() is None
    assert engine.describe("plain")["target_as_run"] == "bf16 copy of tiny.gguf"
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not run on cpu" in err[0] and "--quant gguf" in err[0], err
    (tmp_path / "asked").mkdir()
    assert gguf_engine(tmp_path / "asked", GGUF).target_recipe() == GGUF  # asked for: the view all the same


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_help_says_what_the_default_target_is_and_how_to_name_the_dense_copy(command, monkeypatch):
    from typer.testing import CliRunner

    from viasd.cli import app

    monkeypatch.setenv("COLUMNS", "400")  # one help line per option: no wrapped words
    out = CliRunner().invoke(app, [command, "--help"])
    assert out.exit_code == 0
    assert "as its file stores it" in out.output and "'none': the model as loaded" in out.output
