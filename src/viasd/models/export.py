"""A default model's dense bf16 copy as a Hugging Face directory, for runtimes that read no GGUF blocks (vLLM's CPU
build). viasd itself never needs one: it runs the file's blocks (models/stored.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from viasd.models.fetch import (
    _exclusive_lock,
    _resolve_cache_dir,
    _say,
    _swap_in,
    ensure_default_model,
    find_default_model_entry,
)
from viasd.models.loading import load_model


def ensure_dense_directory(name: str, cache_dir: str | os.PathLike[str] | None = None, progress: bool = True) -> Path:
    """A Hugging Face directory with default model `name`'s dense bf16 weights, for runtimes that read no GGUF blocks
    (vLLM's CPU build): `<cache>/dense/<name>/`, made once from the GGUF file (one line says so) and written whole or
    not at all; viasd itself never needs it. An entry an earlier viasd converted with weights is itself such a
    directory."""
    import torch

    from viasd.models.network import transformers_model
    from viasd.models.stored import densify

    entry = find_default_model_entry(name)
    described_dir = ensure_default_model(name, cache_dir=cache_dir, progress=progress)
    if any(described_dir.glob("*.safetensors")):
        return described_dir
    final = _resolve_cache_dir(cache_dir) / "dense" / entry.name
    if (final / "config.json").is_file() and any(final.glob("*.safetensors")):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(final.parent / f".{entry.name}.lock", progress):
        if (final / "config.json").is_file() and any(final.glob("*.safetensors")):
            return final
        _say(f"{entry.name}: writing its dense bf16 copy for runtimes that need one ({final})", progress)
        loaded = load_model(name, device="cpu", dtype="bf16", cache_dir=cache_dir)
        densify(loaded.model, "a runtime that reads no GGUF blocks asks for it")
        work_dir = Path(tempfile.mkdtemp(prefix=f".{entry.name}.partial-", dir=final.parent))
        try:
            with torch.no_grad():
                transformers_model(loaded.model).save_pretrained(work_dir / "model")  # its classes write it
            loaded.tokenizer.save_pretrained(work_dir / "model")
            _swap_in(work_dir / "model", final, work_dir)
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
    return final
