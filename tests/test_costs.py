"""`viasd costs`: pass costs per view and their agreement with the model, from the command line."""

import json

import torch
from typer.testing import CliRunner

from tiny import tiny_model, tiny_tokenizer
from viasd.cli import app
from viasd.models.shapes import SHAPES, parameter_count, shape_config


def test_costs_of_views_and_their_agreement(tmp_path, monkeypatch):
    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path / "cache"))
    directory = tmp_path / "model"
    tiny_model("llama", dtype=torch.float32).save_pretrained(directory)
    tiny_tokenizer(64).save_pretrained(directory)
    out = tmp_path / "costs.json"
    args = ["costs", "--target", str(directory), "--dtype", "fp32", "--device", "cpu", "--views",
            "full,int8,int4,skip=0.25+int8", "--tokens", "1,3", "--context", "8", "--repeats", "1",
            "--agreement", "2", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    (table,) = record["seconds"].values()
    assert list(table) == ["full", "int8", "int4", "skip=0.25+int8"]
    assert all(len(v) == 2 and min(v) > 0 for v in table.values())
    (scores,) = record["agreement"].values()
    agree, positions = scores["full"]
    assert agree == positions > 40 and set(scores) == set(table)  # the model agrees with itself everywhere
    bad = CliRunner().invoke(app, ["costs", "--target", str(directory), "--views", "full,int3"])
    assert bad.exit_code == 2 and "unknown quantization" in bad.output


def test_view_agreement_counts_positions_where_a_view_keeps_the_top_token():
    from viasd.calibration.teacher import view_agreement
    from viasd.models.layer_skip import LayerMask

    model = tiny_model("qwen2")
    generator = torch.Generator().manual_seed(0)
    sequences = [(torch.randint(0, 64, (30,), generator=generator).tolist(), 10) for _ in range(3)]
    scores = view_agreement(model, {"full": None, "skip": LayerMask.skipping(4, [1, 2])}, sequences)
    assert scores["full"] == (60, 60) and 0 < scores["skip"][0] < 60


def test_named_shapes_count_their_parameters():
    # Published sizes: Qwen2.5-1.5B 1.54B (tied head), Llama-3-8B 8.03B, Gemma-2-27B 27.2B.
    for name, billions in (("qwen2.5-1.5b", 1.54), ("llama3-8b", 8.03), ("gemma2-27b", 27.2)):
        assert abs(parameter_count(shape_config(name)) / 1e9 - billions) < 0.03 * billions, name
    assert "qwen2.5-32b" in SHAPES
