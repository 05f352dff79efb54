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
    from viasd.views.layer_skip import LayerMask

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


TINY_SHAPES = {
    "tiny-target": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256),
    "tiny-drafter": dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=256),
}  # fmt: skip


def test_random_shapes_at_several_contexts_with_a_drafter_shape(tmp_path, monkeypatch):
    for name, fields in TINY_SHAPES.items():
        monkeypatch.setitem(SHAPES, name, fields)
    out = tmp_path / "costs.json"
    args = ["costs", "--shape", "tiny-target", "--drafter-shape", "tiny-drafter", "--views", "full,skip=0.25,skip=0.5",
            "--tokens", "1,2,20", "--context", "8,16", "--keep", "4", "--repeats", "1", "--dtype", "fp32", "--device",
            "cpu", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "timing needs no trained weights" in " ".join(result.output.split())
    record = json.loads(out.read_text())
    assert [(t["role"], t["model"], t["context"]) for t in record["tables"]] == [
        ("target", "tiny-target", 8), ("target", "tiny-target", 16),
        ("drafter", "tiny-drafter", 8), ("drafter", "tiny-drafter", 16),
    ]  # fmt: skip
    assert list(record["tables"][0]["views"]) == ["full", "skip=0.25", "skip=0.5"]
    assert list(record["tables"][2]["views"]) == ["full"]  # --drafter-shape alone times the drafter as it is
    assert all(len(v) == 3 and min(v) > 0 for t in record["tables"] for v in t["views"].values())
    assert record["contexts"] == [8, 16] and record["keep"] == 4 and record["machine"]["device"] == "cpu"
    assert "no trained weights" in record["weights"]["target"] and "no trained weights" in record["weights"]["drafter"]
    assert set(record["seconds"]) == {f"{r} tiny-{r} @ context {c}" for r in ("target", "drafter") for c in (8, 16)}
    alone = CliRunner().invoke(app, ["costs", "--shape", "tiny-target", "--drafter-views", "full", "--device", "cpu"])
    assert alone.exit_code == 2 and "--drafter-shape" in alone.output


def test_a_shape_too_large_for_the_device_is_refused_with_the_memory_it_needs(monkeypatch):
    import viasd.models.shapes as shapes

    monkeypatch.setattr(shapes, "free_memory", lambda device: 8 * 2**30)
    result = CliRunner().invoke(app, ["costs", "--shape", "qwen2.5-32b", "--dtype", "bf16", "--device", "cpu"])
    assert result.exit_code == 2
    assert "shape qwen2.5-32b needs about 61.0 GiB for its weights in bfloat16; cpu has 8.0 GiB free" in result.output


def test_timed_passes_run_the_decoders_work_and_leave_the_cache_as_a_fresh_prefix():
    """Each timing (a drafter step, a verification, a slim check) runs the decoder's own calls and puts the cache
    back: after every kind, the session holds exactly the prefix, equal to a fresh forward pass over it."""
    from viasd.calibration.costs import PassTimer
    from viasd.passes.session import KVSession
    from viasd.views.layer_skip import LayerMask

    model = tiny_model("qwen2", layers=4, dtype=torch.float32)
    head, tail = list(range(3, 15)), list(range(20, 30))
    timer = PassTimer(model, head, tail)
    fresh = KVSession(model)
    fresh.forward(head)
    slim = LayerMask.skipping(4, [1])
    for timing in (
        lambda: timer.drafter_step(1),
        lambda: timer.drafter_step(4),
        lambda: timer.verification(5, 5),
        lambda: timer.verification(6, 2),
        lambda: timer.slim_check(5, 5, slim),
        lambda: timer.slim_check(1, 1, slim),
    ):
        passes = timer.session.forward_passes
        assert timing() > 0
        assert timer.session.forward_passes == passes + 1  # one model pass per timing
        assert timer.session.tokens == head and not timer.session.pending
        for mine, theirs in zip(timer.session.cache.layers, fresh.cache.layers, strict=True):
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
