"""Cache faults cost the cache, never the run or the answer: a quantized copy damaged without changing size is found
by its digests and made again, a cache folder that cannot be written or read leaves one warning line and the run goes
on without it (quantized copies in memory, `auto` probing again), and the bf16 and fp32 views of one model keep
separate copies."""

from __future__ import annotations

import copy
import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import PROMPT
from tiny import tiny_model, tiny_tokenizer
from viasd import auto
from viasd.decode.base import GenerationConfig
from viasd.engine import Engine, EngineSpec
from viasd.models.fingerprint import model_fingerprint
from viasd.models.loading import LoadedModel
from viasd.views import store
from viasd.views.recipe import QuantRecipe
from viasd.views.view import View, applied

RECIPES = ("int8", "int4a8")


def _logits(model: torch.nn.Module, linears: Any) -> torch.Tensor:
    with torch.inference_mode(), applied(model, View(linears=linears)):
        return model(input_ids=torch.tensor([PROMPT])).logits


def _quantize(model: torch.nn.Module, spec: str, root: Path, notes: list[str]) -> Any:
    return store.cached_quantize(model, QuantRecipe.parse(spec), lambda: [PROMPT], root=root, log=notes.append)


def _never(*args: object, **kwargs: object) -> None:
    pytest.fail("quantized again")


@pytest.fixture(autouse=True)
def _fresh_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no cache folder reported yet (they are reported once per process)."""
    monkeypatch.setattr(store, "_REPORTED", set(), raising=False)


# ------------------------------------------------------------------------------------ quantized copies


@pytest.mark.parametrize("spec", RECIPES)
def test_a_copy_damaged_without_changing_size_is_found_and_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str
) -> None:
    model = tiny_model("qwen2", dtype=torch.float32)
    notes: list[str] = []
    first = _quantize(model, spec, tmp_path, notes)
    path = store.cache_path(model, QuantRecipe.parse(spec), tmp_path)
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header + (len(data) - header) // 2] ^= 0x10  # one bit of one tensor, the header untouched
    path.write_bytes(bytes(data))
    remade = _quantize(model, spec, tmp_path, notes)
    assert len(notes) == 1 and "has other contents than were written" in notes[0] and "quantizing again" in notes[0]
    assert torch.equal(_logits(model, remade), _logits(model, first))
    with monkeypatch.context() as patch:  # the file was replaced by a sound one
        patch.setattr(store, "quantize", _never)
        _quantize(model, spec, tmp_path, notes)
    assert len(notes) == 1


def test_bf16_and_fp32_views_of_one_model_keep_their_own_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fingerprint is the same in both dtypes (it samples the weights in fp32), the copies are not: each dtype
    has its own file, so neither overwrites the other's and both load without quantizing again."""
    bf16 = tiny_model("qwen2", dtype=torch.bfloat16)
    fp32 = copy.deepcopy(bf16).float()
    assert model_fingerprint(bf16) == model_fingerprint(fp32)
    notes: list[str] = []
    made = {id(model): _quantize(model, "int4a8", tmp_path, notes) for model in (bf16, fp32)}
    recipe = QuantRecipe.parse("int4a8")
    assert store.cache_path(bf16, recipe, tmp_path) != store.cache_path(fp32, recipe, tmp_path)
    monkeypatch.setattr(store, "quantize", _never)
    for model in (bf16, fp32, bf16):
        again = _quantize(model, "int4a8", tmp_path, notes)
        assert torch.equal(_logits(model, again), _logits(model, made[id(model)]))
    assert notes == []


def test_a_read_only_cache_folder_makes_the_copies_in_memory_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def read_only(path: object, data: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(store, "write_atomic", read_only)
    model = tiny_model("qwen2", dtype=torch.float32)
    notes: list[str] = []
    for spec in (*RECIPES, *RECIPES):
        linears = _quantize(model, spec, tmp_path / "quantized", notes)
        assert torch.equal(_logits(model, linears), _logits(model, store.quantize(model, QuantRecipe.parse(spec))))
    assert len(notes) == 1, notes
    assert "cannot cache quantized copies in" in notes[0] and "Read-only file system" in notes[0]
    assert "made in memory" in notes[0]


@pytest.mark.parametrize("where", ["root", "fingerprint"])
def test_a_cache_path_that_is_not_a_directory_makes_the_copies_in_memory_with_one_line(
    tmp_path: Path, where: str
) -> None:
    model = tiny_model("qwen2", dtype=torch.float32)
    root = tmp_path / "quantized"
    if where == "root":
        root.write_text("a file where the folder should be")
    else:
        root.mkdir()
        (root / model_fingerprint(model)).write_text("a file")
    notes: list[str] = []
    for spec in (*RECIPES, *RECIPES):
        _quantize(model, spec, root, notes)
    assert len(notes) == 1 and "cannot cache quantized copies" in notes[0], notes


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes to read-only folders")
def test_a_folder_without_write_permission_makes_the_copies_in_memory(tmp_path: Path) -> None:
    root = tmp_path / "quantized"
    root.mkdir()
    root.chmod(0o500)
    try:
        notes: list[str] = []
        for spec in RECIPES:
            _quantize(tiny_model("qwen2", dtype=torch.float32), spec, root, notes)
        assert len(notes) == 1 and "Permission denied" in notes[0], notes
    finally:
        root.chmod(0o700)


# ---------------------------------------------------------------------------------------- auto's cache

NAMES = ["plain", "lookup"]
RATES = {"plain": 10.0, "lookup": 12.5}


def _choose(cache: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], list[str], list[int]]:
    """auto.choose with a fake probe: the record, the lines logged, and one item per probe."""
    probes: list[int] = []
    lines: list[str] = []

    def probe(decoder_of: object, names: list[str], tokenizer: object, log: object) -> dict[str, float]:
        probes.append(1)
        return dict(RATES)

    monkeypatch.setattr(auto, "probe", probe)
    record = auto.choose(
        lambda name: pytest.fail("no decoder needed"), NAMES, None, "key", cache=cache, log=lines.append
    )
    return record, lines, probes


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"{ torn", "not JSON"),
        (b"\xff\xfe not text", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),  # past the parser's recursion limit
        (json.dumps({"chosen": "lookup", "candidates": NAMES}).encode(), "no tokens_per_second, date"),
        (json.dumps({"chosen": "x", "candidates": NAMES, "tokens_per_second": RATES, "date": ""}).encode(), "other"),
        (json.dumps({"chosen": "lookup", "candidates": NAMES, "tokens_per_second": 5, "date": ""}).encode(), "timings"),
        (b" " * (2 << 20), "too large"),
    ],
)
def test_an_unusable_probe_record_is_probed_again_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: bytes, why: str
) -> None:
    (tmp_path / "key.json").write_bytes(content)
    record, lines, probes = _choose(tmp_path, monkeypatch)
    assert record["chosen"] == "lookup" and record["tokens_per_second"] == RATES and len(probes) == 1
    assert len(lines) == 1 and "cannot be used" in lines[0] and why in lines[0], lines
    again, lines, probes = _choose(tmp_path, monkeypatch)  # saved: read, not probed
    assert again["chosen"] == "lookup" and "cached" in again and not probes and not lines


def test_a_probe_record_that_is_a_directory_is_probed_again_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "key.json").mkdir()
    record, lines, probes = _choose(tmp_path, monkeypatch)
    assert record["chosen"] == "lookup" and len(probes) == 1
    assert len(lines) == 1 and "cannot be used" in lines[0], lines


def test_an_unwritable_probe_cache_is_not_saved_to_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "auto"
    cache.write_text("a file where the folder should be")
    record, lines, probes = _choose(cache, monkeypatch)
    assert record["chosen"] == "lookup" and len(probes) == 1
    faults = [line for line in lines if "cannot save" in line]
    assert len(faults) == 1 and len(lines) == 2, lines  # the usual "timing" line, and the fault

    def read_only(path: object, data: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(auto, "write_atomic", read_only)
    record, lines, probes = _choose(tmp_path / "elsewhere", monkeypatch)
    assert record["chosen"] == "lookup" and [line for line in lines if "cannot save" in line and "Read-only" in line]


def test_an_engine_whose_cache_folders_are_files_still_runs_auto_with_one_line_per_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole path: `auto` probes with quantized views while neither its cache nor the quantized copies' can be
    written: it picks a method and generates, and stderr has one line for each cache."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "auto").write_text("x")
    (cache / "quantized").write_text("x")
    monkeypatch.setenv("VIASD_CACHE_DIR", str(cache))
    monkeypatch.setattr(auto, "PROBE_PROMPTS", ("t3 t4 t5", "t9 t8 t7 t6"))
    tok = tiny_tokenizer(64)
    target = LoadedModel(tiny_model("qwen2"), tok, "t", "t")
    drafter = LoadedModel(tiny_model("qwen2", layers=2, seed=1), tok, "d", "d")
    tiny = Engine(EngineSpec(target="t", drafter="d"), target=target, drafter=drafter)
    config = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    prompt = [3, 4, 5, 6, 7, 3, 4, 5, 9, 12]
    out = tiny.generate(prompt, "auto", config)
    assert out.tokens == tiny.generate(prompt, "plain", config).tokens
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if "cannot cache quantized copies" in line]) == 1, err
    assert len([line for line in err.splitlines() if "auto: cannot save the choice" in line]) == 1, err
    assert "Traceback" not in err
