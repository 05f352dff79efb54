"""Every kind of view of every catalog model runs twice in a row, as users run it: the first `viasd generate` makes
its quantized copy and caches it, the second reads it from the cache, and both give the same greedy tokens.

`generate --target smollm2-135m --method plain --quant gguf` once answered on the run that made the copy and died
with a segmentation fault (exit 139) on every later one: the copy read from the cache was mapped 8 bytes past a
64-byte boundary, where torch's int8 weight-only kernel cannot read it (tests/test_cached_copies.py). The models
come from viasd's own cache (fetched there on first use); the copies go to a cache folder of this module's own.
Two processes per model and kind: about 4, 9 and 11 minutes for the three catalog models on 2 busy cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from viasd.cache import CACHE_ENV_VAR
from viasd.models.catalog import DEFAULT_MODELS
from viasd.models.fetch import default_cache_dir

pytestmark = pytest.mark.real

KINDS = ("int8", "int8wo", "int4", "int4a8", "gguf")  # gguf: the blocks of the GGUF file each catalog model is
TOKENS = {"qwen2.5-coder-1.5b": 3}  # the default target is slow on a CPU: a few tokens show the copy answers


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache folder whose models are viasd's own (linked, so nothing is fetched twice) and whose quantized
    copies and kernels are this module's."""
    root = tmp_path_factory.mktemp("cache")
    models = default_cache_dir()
    models.mkdir(parents=True, exist_ok=True)
    (root / "models").symlink_to(models, target_is_directory=True)
    return root


def _generate(cache: Path, model: str, kind: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "viasd", "generate", "Say hello in French.", "--target", model]
    command += ["--method", "plain", "--quant", kind, "-n", str(TOKENS.get(model, 6)), "--json"]
    env = {**os.environ, CACHE_ENV_VAR: str(cache), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)


def _copies(cache: Path) -> list[Path]:
    return list((cache / "quantized").rglob("*.safetensors"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model", [entry.name for entry in DEFAULT_MODELS])
def test_every_view_of_every_catalog_model_runs_twice_in_a_row(cache: Path, model: str, kind: str) -> None:
    before = _copies(cache)
    made = _generate(cache, model, kind)
    assert made.returncode == 0, f"making the {kind} copy: exit status {made.returncode}\n{made.stderr[-3000:]}"
    (copy,) = set(_copies(cache)) - set(before)  # the one file this run cached
    written = copy.stat().st_mtime_ns
    read = _generate(cache, model, kind)
    assert read.returncode == 0, f"reading the {kind} copy: exit status {read.returncode}\n{read.stderr[-3000:]}"
    assert copy.stat().st_mtime_ns == written and "quantizing again" not in read.stderr, read.stderr  # it was read
    first, second = json.loads(made.stdout), json.loads(read.stdout)
    assert second["tokens"] == first["tokens"] and len(first["tokens"]) > 0
