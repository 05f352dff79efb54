"""What a GGUF file says of its model besides its weights: the transformers config, the tokenizer and its chat
template, written once as a small Hugging Face directory (a few MB, no weights).

transformers reads them from the file's metadata (the whole vocabulary and its merges: seconds), so they are kept in
viasd's cache under a key of the file's path, size and modification time (`<cache>/gguf-described/<key>/`), written
whole or not at all; a default model's are written by its fetch (models/fetch.py). An unwritable cache costs the
time at each start, never the run.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

from viasd.cache import cache_folder

DESCRIBED = "gguf-described"
DESCRIBED_VERSION = 2  # raised when what is written changes (2: the config names its architecture)


def describe_gguf(path: Path, out_dir: Path) -> None:
    """Write the config and tokenizer that transformers reads from the GGUF file at `path` into `out_dir`."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    for marker in ("quantization_config",):
        if hasattr(config, marker):
            delattr(config, marker)
    if not getattr(config, "architectures", None):  # the file names no class: name its causal LM's, as hub configs do
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _key(path: Path) -> str:
    stat = path.stat()
    key = f"{DESCRIBED_VERSION}\0{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def described(path: Path) -> Path:
    """The directory holding the config and tokenizer of the GGUF file at `path`: from the cache, else read from the
    file now and cached (in a temporary folder when the cache cannot be written)."""
    folder = cache_folder(DESCRIBED) / _key(path)
    if (folder / "config.json").is_file():
        return folder
    print(f"{path.name}: reading its config and tokenizer from the file (once)", file=sys.stderr)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".partial-", dir=folder.parent))
    except OSError:
        work = Path(tempfile.mkdtemp(prefix="viasd-described-"))
        describe_gguf(path, work)
        return work
    try:
        describe_gguf(path, work / "out")
        try:
            (work / "out").rename(folder)
        except OSError:
            if not (folder / "config.json").is_file():  # not another process's finished copy: keep ours in place
                return work / "out"
    finally:
        if folder.is_dir():
            shutil.rmtree(work, ignore_errors=True)
    return folder
