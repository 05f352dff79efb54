"""A benchmark task: one conversation, its references and how its answers start and stop (made by bench/tasks.py
from the questions file and HumanEval, and by bench/edits.py for the edit workload)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Task:
    """One benchmark conversation.

    `references` holds one reference per turn (None where there is none); `prefix` is text the answer
    of every turn starts with (fed to the model, not part of the generated text); `stop` are stop strings.
    """

    key: str
    source: str
    category: str
    turns: tuple[str, ...]
    references: tuple[Any, ...] = ()
    prefix: str = ""
    stop: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def reference(self, turn: int) -> Any:
        return self.references[turn] if turn < len(self.references) else None
