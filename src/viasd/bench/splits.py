"""Calibration and report splits of the benchmark's tasks, so that a routing profile tuned on task outcomes is
never judged on the tasks it was tuned on.

A task belongs to the calibration split when the CRC-32 of its key is a multiple of 4: a fixed quarter of every
task set (40 of the 164 HumanEval problems, 9-11 of the 40 development questions of each Spec-Bench category),
the same on every machine and for any question file, with no list to keep in step.

A task made from another (an edit of a HumanEval problem, a chat built on a question: `bench/edits.py`) has the key
`CATEGORY:BASE` and lies in the split of BASE, the key it was made from: a problem and every task made from it are on
the same side, so no problem's code is in the calibration split under one key and in the report split under another.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Iterable
from typing import Literal, TypeVar

Split = Literal["all", "calibration", "report"]
SPLITS: tuple[Split, ...] = ("all", "calibration", "report")

T = TypeVar("T")

# `CATEGORY:BASE`: a derived task's key. Keys of loaded tasks start with their source and a slash (`specbench/...`),
# so a colon in a question's id never makes one look derived.
_DERIVED = re.compile(r"[a-z0-9_]+:(?=[a-z0-9_]+/)")


def base_key(key: str) -> str:
    """The key a task was made from (`edit_fix:humaneval/HumanEval/12` -> `humaneval/HumanEval/12`), else the key."""
    found = _DERIVED.match(key)
    return key[found.end() :] if found else key


def split_of(key: str) -> Split:
    """The split a task key (`humaneval/HumanEval/12`, `specbench/162`, `edit_fix:humaneval/HumanEval/12`) is in."""
    return "calibration" if zlib.crc32(base_key(key).encode("utf-8")) % 4 == 0 else "report"


def in_split(key: str, split: Split) -> bool:
    """Whether the task with this key is part of `split` ("all" holds every task)."""
    return split == "all" or split_of(key) == split


def parse_split(text: str) -> Split:
    """`--split` as given on a command line, checked once at the edge."""
    from viasd.errors import ViasdError

    for split in SPLITS:
        if text == split:
            return split
    raise ViasdError(f"--split must be one of {', '.join(SPLITS)}, got {text!r}")


def keep(items: Iterable[T], key_of: Callable[[T], str], split: Split) -> list[T]:
    """The items whose key is in `split`, in order."""
    return [item for item in items if in_split(key_of(item), split)]
