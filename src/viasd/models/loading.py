"""Load a causal LM and its tokenizer from whatever the user names: default model, directory, GGUF, hub id.

Every failure a user can cause (a typo, a corrupt file, no network) comes out as one `ViasdError` line
with the underlying exception chained, never as a transformers traceback.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlparse

from viasd.errors import ViasdError
from viasd.models.catalog import find_default_model
from viasd.models.fetch import ensure_default_model, read_gguf, repair_command
from viasd.models.tokenizer import load_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

T = TypeVar("T")

_DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_HUB_PROBE_SECONDS = 3.0


@dataclass
class LoadedModel:
    """A model in eval mode with its tokenizer, the spec it was loaded from, and where it came from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    path: str


# ------------------------------------------------------------------------------------ device, dtype


def resolve_device(device: str | None) -> str:
    """The device to load onto: as given, else CUDA when available, else CPU."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError) as error:
        raise ViasdError(f"unknown device '{device}' (e.g. cpu, cuda, cuda:1, mps)") from error
    if kind == "cuda" and not torch.cuda.is_available():
        raise ViasdError(f"device '{device}' was asked for, but CUDA is not available here")
    return device


def parse_dtype(dtype: str, device: str) -> torch.dtype:
    """Map a dtype name to a torch dtype; "auto" is bf16, or fp16 on a GPU without bf16 support."""
    import torch

    key = dtype.strip().lower()
    if key == "auto":
        if device.startswith("cuda") and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            return torch.float16
        return torch.bfloat16
    if key not in _DTYPE_NAMES:
        choices = ", ".join(["auto", *_DTYPE_NAMES])
        raise ViasdError(f"unknown dtype '{dtype}' (choose one of: {choices})")
    return getattr(torch, _DTYPE_NAMES[key])


# ------------------------------------------------------------------------------------------ loading


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _guarded(what: str, load: Callable[[], T]) -> T:
    """Run `load`, turning any failure into a one-line ViasdError about `what`."""
    try:
        return load()
    except ViasdError:
        raise
    except Exception as error:
        raise ViasdError(f"cannot load model from {what}: {_one_line(error)}") from error


def _load_directory(
    directory: Path, dtype: torch.dtype, device_map: str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A Hugging Face directory: config.json, weights, tokenizer files."""
    from transformers import AutoModelForCausalLM

    if not (directory / "config.json").is_file():
        raise ViasdError(f"cannot load model from {directory}: the directory has no config.json")
    model = _guarded(
        str(directory),
        lambda: AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, device_map=device_map),
    )
    tokenizer = _guarded(str(directory), lambda: load_tokenizer(directory))
    return model, tokenizer


def _load_gguf(
    path: Path, dtype: torch.dtype, device_map: str | None, device: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A single GGUF file: its model as the file stores it where viasd builds its family from the blocks (its config
    and tokenizer read from the file once, models/described.py), else dequantised into a dense model."""
    from viasd.models.described import described

    stored = _stored(path, lambda: described(path), dtype, device_map, device)
    return stored if stored is not None else _guarded(str(path), lambda: read_gguf(path, dtype, device_map))


def _stored(
    path: Path, description: Callable[[], Path], dtype: torch.dtype, device_map: str | None, device: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase] | None:
    """The model of the GGUF file at `path` with its weights left in the file's blocks (models/stored.py) and its
    tokenizer, config and tokenizer from the directory `description()` gives; None (after one line saying why) where
    it must load as its dense copy instead: another device, a device map, or a family not built from blocks."""
    from transformers import AutoConfig

    from viasd.models.gguf_file import GgufError, GgufFile
    from viasd.models.memory import available_bytes, too_large
    from viasd.models.stored import build, view_bytes, why_not_stored

    try:
        file = GgufFile(path)
    except GgufError as error:
        raise ViasdError(f"cannot load model from {path}: {error.reason}") from error
    why = "a device map spreads it over devices" if device_map is not None else why_not_stored(file, device)
    if why is not None:
        print(f"{path.name}: loading its dense copy ({why})", file=sys.stderr)
        return None
    too_big = too_large(view_bytes(file), available_bytes())
    if too_big is not None:
        raise ViasdError(f"cannot load model from {path}: {too_big}")
    directory = description()
    config = _guarded(str(path), lambda: AutoConfig.from_pretrained(str(directory)))
    model = _guarded(str(path), lambda: build(file, config, dtype, device))
    tokenizer = _guarded(str(path), lambda: load_tokenizer(directory))
    return model, tokenizer


def _hub_endpoint_reachable() -> bool:
    """A quick check that the hub answers, so an offline machine fails in seconds, not after retries.

    Behind a proxy a direct connection says nothing, so the check is skipped there.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}:
        return False
    proxies = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
    if any(os.environ.get(name) for name in proxies):
        return True
    from huggingface_hub import constants

    endpoint = urlparse(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname or "", port), timeout=_HUB_PROBE_SECONDS):
            return True
    except OSError:
        return False


def _load_hub(
    repo_id: str, dtype: torch.dtype, device_map: str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A hub id: from the hub when reachable, else from the local hub cache, else a clear error."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    online = _hub_endpoint_reachable()
    options: dict[str, Any] = {} if online else {"local_files_only": True}
    try:
        model = AutoModelForCausalLM.from_pretrained(repo_id, dtype=dtype, device_map=device_map, **options)
        tokenizer = AutoTokenizer.from_pretrained(repo_id, **options)
    except Exception as error:
        hub = "could not provide it" if online else "is unreachable"
        raise ViasdError(
            f"cannot load model '{repo_id}': not a default model name, local directory or .gguf file, "
            f"and the hub {hub} ({_one_line(error)})"
        ) from error
    return model, tokenizer


def _shelved(directory: Path, spec: str, cache_dir: str | os.PathLike[str] | None) -> Path | None:
    """A default model's verified GGUF file where it is at hand: kept in its directory, or shelved in the cache."""
    entry = find_default_model(spec)
    if entry is None:
        return None
    for place in (directory / entry.gguf_filename, _cache_root(cache_dir) / "gguf" / entry.gguf_filename):
        if place.is_file() and place.stat().st_size == entry.size:
            return place
    return None


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    from viasd.models.fetch import default_cache_dir

    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _load_any(
    spec: str, dtype: torch.dtype, device_map: str | None, cache_dir: str | os.PathLike[str] | None, device: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, Path | None]:
    """Dispatch on what `spec` names; returns model, tokenizer and local path (None for hub ids)."""
    if find_default_model(spec) is not None:
        directory = ensure_default_model(spec, cache_dir=cache_dir)
        try:
            file = _shelved(directory, spec, cache_dir)
            stored = None if file is None else _stored(file, lambda: directory, dtype, device_map, device)
            if stored is not None:
                return (*stored, directory)
            if file is not None and not any(directory.glob("*.safetensors")):  # its dense copy, made from the file
                return (*_guarded(str(file), lambda: read_gguf(file, dtype, device_map)), directory)
            return (*_load_directory(directory, dtype, device_map), directory)
        except ViasdError as error:  # files the manifest cannot vouch for (same size, or no manifest)
            raise ViasdError(f"{error}; if the cached copy is damaged, repair it: {repair_command(spec)}") from error
    path = Path(spec).expanduser()
    if path.is_dir():
        return (*_load_directory(path, dtype, device_map), path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ViasdError(f"cannot load model from {path}: expected a directory or a .gguf file")
        return (*_load_gguf(path, dtype, device_map, device), path)
    if spec.lower().endswith(".gguf") or not _HUB_ID.match(spec):
        raise ViasdError(f"cannot load model '{spec}': no such file or directory")
    return (*_load_hub(spec, dtype, device_map), None)


def load_model(
    spec: str,
    *,
    device: str | None = None,
    dtype: str = "auto",
    device_map: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """Load a model and tokenizer in eval mode from a default model name, directory, .gguf file or hub id.

    `device_map` (e.g. "auto") is handed to transformers to spread the model over devices; without it
    the model is moved to `device` (default: CUDA if available, else CPU). The model is as transformers made it:
    `viasd.passes.prepare` readies it for viasd's passes (the engine does).
    """
    target_device = resolve_device(device)
    torch_dtype = parse_dtype(dtype, target_device)
    model, tokenizer, path = _load_any(spec, torch_dtype, device_map, cache_dir, target_device)
    if device_map is None:
        model = _guarded(spec, lambda: model.to(target_device))
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, name=spec, path=str(path) if path else spec)


# ------------------------------------------------------------------------------------- vocabularies


def _head_size(loaded: LoadedModel) -> int:
    """Rows of the output embedding: the number of logits the model produces per position."""
    from torch import nn

    head = loaded.model.get_output_embeddings()
    if isinstance(head, nn.Linear):  # a stored head's size without making its dense copy
        return int(head.out_features)
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(loaded.model.config.vocab_size)


def is_padding(token: str, index: int) -> bool:
    """Whether a vocabulary entry is llama.cpp's padding (`[PAD151943]` at id 151943): its converter fills a GGUF
    file's vocabulary up to the head's width with them (Qwen2.5 7B to 152064, 0.5B to 151936); no text encodes to
    them, so two files of one tokenizer padded to other widths still mean the same by every id."""
    return token == f"[PAD{index}]"


def has_padding(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's vocabulary holds llama.cpp's padding entries (`is_padding`)."""
    return any(is_padding(token, index) for token, index in tokenizer.get_vocab().items())


def _id_to_token(loaded: LoadedModel) -> dict[int, str]:
    vocab = loaded.tokenizer.get_vocab().items()
    return {index: token for token, index in vocab if not is_padding(token, index)}


def vocabulary_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of a tokenizer's token -> id map: equal for tokenizers that mean the same by every id. Remembered
    in the cache for a tokenizer read from a directory's files (hashing 150k entries costs 0.3 s of a start)."""
    import hashlib
    import json

    from viasd.models.fingerprint import remembered

    def compute() -> str:
        items = sorted(tokenizer.get_vocab().items())
        return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]

    folder = Path(getattr(tokenizer, "name_or_path", "") or "")
    files = [folder / name for name in ("tokenizer.json", "tokenizer_config.json")]
    if not folder.parts or not all(file.is_file() for file in files):
        return compute()  # not read from files viasd can name (built in memory, or a hub id): nothing to key it by
    return remembered(files, f"vocabulary {type(tokenizer).__name__} {len(tokenizer)}", compute)


def check_same_vocabulary(a: LoadedModel, b: LoadedModel) -> int:
    """Refuse a model pair whose token ids mean different things; return the shared logit width.

    Both tokenizers must map every id they share to the same token, and every id either can produce
    must have a logit in both heads. Heads may be padded to different sizes (Qwen2.5 7B vs 0.5B), so
    the width both heads share is returned for callers to slice logits to.
    """
    width = min(_head_size(a), _head_size(b))
    tokens_a, tokens_b = _id_to_token(a), _id_to_token(b)
    shared = tokens_a.keys() & tokens_b.keys()
    differing = sorted(index for index in shared if tokens_a[index] != tokens_b[index])
    if differing or not shared:
        example = ""
        if differing:
            first = differing[0]
            example = f" (e.g. id {first}: {tokens_a[first]!r} vs {tokens_b[first]!r})"
        raise ViasdError(
            f"models '{a.name}' and '{b.name}' do not share a tokenizer: {len(differing)} of "
            f"{len(shared)} shared token ids map to different tokens{example}"
        )
    largest = max(max(tokens_a), max(tokens_b))
    if largest >= width:
        raise ViasdError(
            f"models '{a.name}' and '{b.name}' do not share a vocabulary: token id {largest} has no logit "
            f"in a model head of {width} entries"
        )
    return width
