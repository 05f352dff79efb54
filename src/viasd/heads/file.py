"""A draft head's file: its weights and vocabulary, the target it was trained for, and a digest of its contents.

A safetensors file whose metadata names the format, the head's shape, the target's fingerprint (a head drafts from
one target's features: another target's would be noise) and tokenizer, how it was trained, and an xxh3-128 digest
of every tensor's bytes: a damaged, truncated or foreign file is refused in one line, never half-used. The metadata is
not under the digest, so every field of it is checked before it is used (a hand-edited or damaged config is refused
in one line too, and a method then drafts with the next-best drafter, methods/drafting.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from viasd.errors import ViasdError
from viasd.fileio import write_atomic
from viasd.heads.attention import AttentionHead, AttentionHeadConfig
from viasd.heads.network import DraftHead, HeadConfig

FORMAT = "viasd-draft-head/1"


@dataclass(frozen=True)
class HeadFile:
    """A head as read from its file, with what its metadata says."""

    head: DraftHead | AttentionHead
    target: str  # the fingerprint of the target it drafts for
    vocabulary: str  # the fingerprint of that target's tokenizer
    training: dict[str, Any]
    digest: str  # of its tensors: which head, for records and the `auto` probe


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """xxh3-128 over every tensor's name and bytes, in name order."""
    hasher = xxhash.xxh3_128()
    for name in sorted(tensors):
        hasher.update(name.encode())
        hasher.update(tensors[name].detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def save_head(
    path: Path, head: DraftHead | AttentionHead, target: str, vocabulary: str, training: dict[str, Any]
) -> None:
    """Write the head (its weights in bfloat16) atomically."""
    tensors = {
        name: t.detach().to(torch.bfloat16 if t.is_floating_point() else t.dtype).contiguous()
        for name, t in head.state_dict().items()
    }
    metadata = {
        "format": FORMAT,
        "config": json.dumps(head.config.to_dict()),
        "target": target,
        "vocabulary": vocabulary,
        "training": json.dumps(training, sort_keys=True),
        "digest": digest(tensors),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, save(tensors, metadata=metadata))
    except OSError as error:
        raise ViasdError(f"cannot write the draft head to {path}: {error.strerror or error}") from None


def build_head(config: dict[str, Any], token_ids: torch.Tensor) -> DraftHead | AttentionHead:
    """A head of the design and shape its file's config names (the chain head when it names none)."""
    if config.get("design", "chain") == "attention":
        return AttentionHead(AttentionHeadConfig(**config), token_ids)
    return DraftHead(HeadConfig(**{k: v for k, v in config.items() if k != "design"}), token_ids)


def head_config(text: str | None) -> dict[str, Any]:
    """The metadata's config: a JSON object naming a design and the fields of its shape, each a positive number
    (ValueError says what is wrong)."""
    try:
        config = json.loads(text) if text is not None else None
    except ValueError:
        raise ValueError("its config is not JSON") from None
    if not isinstance(config, dict):
        raise ValueError(f"its config is {_json_kind(config)}, not a JSON object")
    design = config.get("design", "chain")
    if design not in ("chain", "attention"):
        raise ValueError(f"its config names an unknown design {design!r}")
    shape = {f.name: f for f in fields(AttentionHeadConfig if design == "attention" else HeadConfig)}
    unknown = sorted(set(config) - set(shape) - {"design"})
    if unknown:
        raise ValueError(f"its config has fields no {design} head has ({', '.join(unknown)})")
    if "hidden" not in config:
        raise ValueError("its config does not give the head's hidden size")
    for name, value in config.items():
        if name == "design":
            continue
        whole = shape[name].type in ("int", int)
        number = isinstance(value, int) if whole else isinstance(value, (int, float)) and math.isfinite(value)
        if isinstance(value, bool) or not number or value <= 0:
            raise ValueError(
                f"its config's {name} is {json.dumps(value)}, not a positive {'integer' if whole else 'number'}"
            )
    if design == "attention":
        heads, kv_heads, head_dim = (config.get(k, shape[k].default) for k in ("heads", "kv_heads", "head_dim"))
        if heads % kv_heads or head_dim % 2:
            raise ValueError("its config's heads are not a multiple of its kv_heads, or its head_dim is odd")
    return config


def _json_kind(value: Any) -> str:
    """What a JSON value is, for a message: null, a list, a string, ..."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list"}.get(
        type(value), type(value).__name__
    )


def _training(text: str | None) -> dict[str, Any]:
    """How the head was trained (a JSON object), or nothing where the metadata says otherwise: it only informs."""
    try:
        training = json.loads(text) if text is not None else {}
    except ValueError:
        return {}
    return training if isinstance(training, dict) else {}


def _checked_head(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> DraftHead | AttentionHead:
    """The head the config describes, holding the file's tensors: its shapes are compared on the meta device first,
    so a config that does not fit them allocates nothing (ValueError says what does not fit)."""
    token_ids = tensors.get("token_ids")
    if token_ids is None or token_ids.dim() != 1 or token_ids.is_floating_point():
        raise ValueError("it holds no vocabulary (token_ids)")
    with torch.device("meta"):
        shaped = build_head(config, torch.empty(token_ids.shape, dtype=torch.long))
    wanted = {name: tuple(t.shape) for name, t in shaped.state_dict().items()}
    held = {name: tuple(t.shape) for name, t in tensors.items()}
    if wanted != held:
        differing = sorted(n for n in set(wanted) | set(held) if wanted.get(n) != held.get(n))
        raise ValueError(f"its config does not fit its tensors ({', '.join(differing[:3])})")
    head = build_head(config, token_ids)
    head.load_state_dict(tensors)
    return head


def load_head(path: Path) -> HeadFile:
    """Read a head file, checking its format, its digest and every field of its metadata (one-line ViasdError when
    any fails)."""
    if path.is_dir():
        raise ViasdError(f"{path} is a folder, not a draft head: name the head's .safetensors file")
    try:
        with safe_open(path, "pt") as opened:
            metadata = opened.metadata() or {}
            tensors = {name: opened.get_tensor(name) for name in opened.keys()}  # noqa: SIM118 (not a dict)
    except FileNotFoundError:
        raise ViasdError(f"no draft head at {path}") from None
    except OSError as error:
        raise ViasdError(f"draft head {path} cannot be read ({error.strerror or error}): train it again") from None
    except (SafetensorError, ValueError) as error:
        raise ViasdError(f"draft head {path} cannot be read ({error}): train it again") from None
    if metadata.get("format") != FORMAT:
        raise ViasdError(f"{path} is not a viasd draft head (format {metadata.get('format')!r}, want {FORMAT})")
    if metadata.get("digest") != digest(tensors):
        raise ViasdError(f"draft head {path} is damaged (its contents do not match their digest): train it again")
    try:
        head = _checked_head(head_config(metadata.get("config")), tensors)
    except (TypeError, ValueError, RuntimeError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ViasdError(f"draft head {path} does not hold a head viasd can build: {message}; train it again") from None
    return HeadFile(
        head.to(torch.bfloat16).eval(),
        metadata.get("target", ""),
        metadata.get("vocabulary", ""),
        _training(metadata.get("training")),
        metadata["digest"],
    )
