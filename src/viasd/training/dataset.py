"""The draft head's training data on disk: shards of conversations the target wrote, with its features.

One folder per target (`<cache>/heads/<fingerprint>/data`): `settings.json` says how the data was written (a resume
with other settings is refused), and each `shard-NNNNN.safetensors` holds whole conversations, written atomically,
so an interrupted run loses at most the conversations still being written and continues after the last shard.

One run writes a folder at a time: a writer holds its lock (`writing`) while it adds conversations, and a second is
refused in one line, since both would write the same conversations from the same count. A shard is never written
over another (a taken name means the next number), nor the settings over another run's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from viasd.errors import ViasdError
from viasd.fileio import exclusive, write_new
from viasd.jsonio import parse_json
from viasd.training.conversations import Written


@dataclass(frozen=True)
class TrainingSet:
    """Every conversation of a data folder, concatenated.

    tokens [N]; starts [C + 1] (conversation c is tokens[starts[c]:starts[c + 1]]); feature_at [M] (the token
    position, in `tokens`, whose feature row this is: the target's state that predicted tokens[at + 1]);
    features [M, hidden]; answer [N] (whether a token is part of an answer).
    """

    tokens: torch.Tensor
    starts: torch.Tensor
    feature_at: torch.Tensor
    features: torch.Tensor
    answer: torch.Tensor

    @property
    def conversations(self) -> int:
        return len(self.starts) - 1


def joined(sets: Sequence[TrainingSet]) -> TrainingSet:
    """The training sets one after another, as one (positions and conversation starts offset)."""
    tokens, starts, feature_at = [], [torch.zeros(1, dtype=torch.int64)], []
    offset = 0
    for part in sets:
        tokens.append(part.tokens)
        starts.append(part.starts[1:] + offset)
        feature_at.append(part.feature_at + offset)
        offset += len(part.tokens)
    return TrainingSet(
        torch.cat(tokens),
        torch.cat(starts),
        torch.cat(feature_at),
        torch.cat([part.features for part in sets]),
        torch.cat([part.answer for part in sets]),
    )


class DataFolder:
    """The shards of one target's training data, and the settings they were written with."""

    def __init__(self, path: Path, settings: dict[str, Any]) -> None:
        self.path = path
        self.settings = settings
        manifest = path / "settings.json"
        if not manifest.exists():
            try:
                write_new(manifest, json.dumps(settings, indent=1, sort_keys=True).encode())
                return
            except FileExistsError:
                pass  # another run wrote it first: its settings must be these
            except OSError as error:
                raise ViasdError(f"cannot write the training data to {path}: {error.strerror or error}") from None
        try:
            found = parse_json(manifest.read_bytes())
        except (OSError, ValueError) as error:
            raise ViasdError(f"cannot read {manifest} ({error}); remove the folder to write the data again") from None
        if found != settings:
            changed = sorted(k for k in set(found) | set(settings) if found.get(k) != settings.get(k))
            raise ViasdError(
                f"the training data in {path} was written with other settings ({', '.join(changed)}): "
                "use the same settings, or another --data folder"
            )

    def writing(self) -> AbstractContextManager[None]:
        """The folder's writer lock, held for a block; a one-line ViasdError where another process holds it."""
        return exclusive(
            self.path / ".writer.lock",
            lambda by: (
                f"another viasd train-drafter{by} is writing the training data in {self.path}: wait for it to "
                "end, then run again (it goes on from that run's data)"
            ),
        )

    def shards(self) -> list[Path]:
        return sorted(self.path.glob("shard-*.safetensors"))

    def conversations(self) -> int:
        """How many conversations the shards hold (the next one written is this number)."""
        return sum(_count(shard, "answer_from") for shard in self.shards())

    def tokens(self) -> int:
        return sum(_count(shard, "tokens") for shard in self.shards())

    def save(self, written: Sequence[Written]) -> Path:
        """A shard of finished conversations, written whole or not at all."""
        tokens, starts, answer_from, feature_at, features = [], [0], [], [], []
        for conversation in written:
            offset = starts[-1]
            tokens += conversation.tokens
            starts.append(offset + len(conversation.tokens))
            answer_from.append(conversation.answer_from)
            feature_at += [offset + p for p in conversation.positions]
            features.append(conversation.features)
        tensors = {
            "tokens": torch.tensor(tokens, dtype=torch.int32),
            "starts": torch.tensor(starts, dtype=torch.int64),
            "answer_from": torch.tensor(answer_from, dtype=torch.int32),
            "feature_at": torch.tensor(feature_at, dtype=torch.int64),
            "features": torch.cat(features).to(torch.bfloat16).contiguous(),
        }
        data, number = save(tensors), len(self.shards())
        while True:
            path = self.path / f"shard-{number:05d}.safetensors"
            try:
                write_new(path, data)
                return path
            except FileExistsError:
                number += 1  # taken since the count: never written over
            except OSError as error:
                raise ViasdError(f"cannot write {path}: {error.strerror or error}") from None

    def load(self) -> TrainingSet:
        """All shards as one training set."""
        shards = [_load(shard) for shard in self.shards()]
        if not shards:
            raise ViasdError(f"no training data in {self.path}: write it first (viasd train-drafter)")
        tokens, starts, feature_at, features, answer = [], [torch.zeros(1, dtype=torch.int64)], [], [], []
        offset = 0
        for shard in shards:
            n = int(shard["tokens"].numel())
            tokens.append(shard["tokens"].long())
            starts.append(shard["starts"][1:] + offset)
            feature_at.append(shard["feature_at"] + offset)
            features.append(shard["features"])
            flags = torch.zeros(n, dtype=torch.bool)
            for c, begin in enumerate(shard["answer_from"].tolist()):
                a, b = int(shard["starts"][c]), int(shard["starts"][c + 1])
                flags[a + max(begin, 0) : b] = begin >= 0
            answer.append(flags)
            offset += n
        return TrainingSet(
            torch.cat(tokens), torch.cat(starts), torch.cat(feature_at), torch.cat(features), torch.cat(answer)
        )


def _load(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (OSError, SafetensorError, ValueError) as error:
        raise ViasdError(f"training data shard {path} is damaged ({error}); remove it to write it again") from None


def _count(path: Path, name: str) -> int:
    """The length of one tensor of a shard, read from its header."""
    try:
        with safe_open(path, "pt") as opened:
            return int(opened.get_slice(name).get_shape()[0])
    except (OSError, SafetensorError, ValueError, KeyError) as error:
        raise ViasdError(f"training data shard {path} is damaged ({error}); remove it to write it again") from None
