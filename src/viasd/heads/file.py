"""A draft head's file: its weights and vocabulary, the target it was trained for, and a digest of its contents.

A safetensors file whose metadata names the format, the head's shape, the target's fingerprint (a head drafts from
one target's features: another target's would be noise) and tokenizer, how it was trained, and an xxh3-128 digest
of every tensor's bytes: a damaged, truncated or foreign file is refused in one line, never half-used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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
    return DraftHead(HeadConfig(**config), token_ids)


def load_head(path: Path) -> HeadFile:
    """Read a head file, checking its format and digest (one-line ViasdError when it fails either)."""
    try:
        with safe_open(path, "pt") as opened:
            metadata = opened.metadata() or {}
            tensors = {name: opened.get_tensor(name) for name in opened.keys()}  # noqa: SIM118 (not a dict)
    except FileNotFoundError:
        raise ViasdError(f"no draft head at {path}") from None
    except (OSError, SafetensorError, ValueError) as error:
        raise ViasdError(f"draft head {path} cannot be read ({error}): train it again") from None
    if metadata.get("format") != FORMAT:
        raise ViasdError(f"{path} is not a viasd draft head (format {metadata.get('format')!r}, want {FORMAT})")
    if metadata.get("digest") != digest(tensors):
        raise ViasdError(f"draft head {path} is damaged (its contents do not match their digest): train it again")
    try:
        head = build_head(json.loads(metadata["config"]), tensors["token_ids"])
        head.load_state_dict(tensors)
        training = json.loads(metadata.get("training", "{}"))
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise ViasdError(f"draft head {path} does not hold a head viasd can build ({error})") from None
    return HeadFile(
        head.to(torch.bfloat16).eval(),
        metadata.get("target", ""),
        metadata.get("vocabulary", ""),
        training,
        metadata["digest"],
    )
