"""A model's fingerprint: which weights a profile or a cached quantization was made for."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn


def model_fingerprint(model: nn.Module) -> str:
    """A stable short hash of a model's architecture and weights (config + strided weight samples). A model stored
    in its GGUF file's blocks keeps its fingerprint once computed (its weights never change, and sampling them
    reads some 20,000 rows of the file: 0.2-0.5 s a time), in the process and, for the next start, in the cache."""
    from viasd.models.stored import stored_source

    source = stored_source(model)
    if source is None:
        return _fingerprint(model, _config_text(model))
    if source.fingerprint is None:
        source.fingerprint = _remembered(model, source.file.path)
    return source.fingerprint


# Bump when what `_fingerprint` hashes changes: fingerprints remembered before are then computed again.
MEMO_VERSION = 1


def _remembered(model: nn.Module, path: Path) -> str:
    """`_fingerprint` of a model stored in the file at `path`, remembered under the file's identity and its config."""
    config = _config_text(model)
    return remembered([path], config, lambda: _fingerprint(model, config))


def remembered(files: list[Path], extra: str, compute: Callable[[], str]) -> str:
    """`compute()`, a 16-digit hex fingerprint of what `files` hold, remembered in `<cache>/fingerprints/` under the
    files' identities (path, inode, size, modification time) and `extra`: a file changed in place gets a new entry.
    The memo is only a shortcut, so a cache that cannot be read or written (or a file gone) computes it as before."""
    from viasd.cache import cache_folder
    from viasd.fileio import write_atomic

    try:
        stats = [(str(path.resolve()), path.stat()) for path in files]
    except OSError:
        return compute()
    identity = json.dumps([MEMO_VERSION, [(p, i.st_ino, i.st_size, i.st_mtime_ns) for p, i in stats], extra])
    memo = cache_folder("fingerprints") / hashlib.sha256(identity.encode()).hexdigest()[:32]
    try:
        known = memo.read_text().strip()
        if len(known) == 16 and all(c in "0123456789abcdef" for c in known):
            return known
    except OSError:
        pass
    found = compute()
    with contextlib.suppress(OSError):
        write_atomic(memo, found)
    return found


def _config_text(model: nn.Module) -> str:
    """The model's config as the fingerprint hashes it: without the fields that say how it was loaded, not what."""
    config = model.config.to_dict()
    for volatile in (
        "_name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "architectures",
        "quantization_config",
        "_attn_implementation_autoset",
        "use_cache",
    ):
        config.pop(volatile, None)
    return json.dumps(config, sort_keys=True, default=str)


def _fingerprint(model: nn.Module, config: str) -> str:
    digest = hashlib.sha256(config.encode())
    for name, sample in _samples(model):
        digest.update(name.encode())
        digest.update(torch.round(sample * 1024).to(torch.int64).numpy().tobytes())
    return digest.hexdigest()[:16]


def _samples(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Each weight's name and sample, in `named_parameters`' order: every (numel // 64)-th value, the first 64,
    rounded to bf16 (so that the fingerprint does not depend on the dtype the model was loaded in: a model of bf16
    weights and its float32 load, or a GGUF file's float32 dequantization, have one). A weight still in its GGUF
    file's blocks (models/stored.py) is sampled from them as the dense copy would hold it, whether or not that copy was
    made since, so that a model gets one fingerprint however it is loaded; a matrix shared by two modules (a tied
    head) counts once."""
    from viasd.models.stored import STORED

    seen: set[object] = set()
    for prefix, module in model.named_modules():
        entries: list[tuple[str, object]] = []
        if isinstance(module, STORED):  # sampled from the file even where its dense copy was made (held outside
            entries.append(("weight", module.file_tensor))  # `_parameters`, and a tied head's copy is a second tensor)
        entries += [(key, value) for key, value in module._parameters.items() if value is not None]
        for key, value in entries:
            identity = id(value) if isinstance(value, torch.Tensor) else (value.source.file.path, value.name)  # type: ignore[attr-defined]
            if identity in seen:
                continue
            seen.add(identity)
            name = f"{prefix}.{key}" if prefix else key
            if isinstance(value, torch.Tensor):
                flat = value.detach().reshape(-1)
                yield name, flat[:: max(1, flat.numel() // 64)][:64].to(torch.bfloat16).float().cpu()
            else:
                yield name, value.sample()  # type: ignore[attr-defined]
