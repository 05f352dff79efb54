"""Progress reporting of a calibration, whose steps take minutes: a log line per step, a progress bar per slow loop."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

Log = Callable[[str], None]
T = TypeVar("T")


def silent(text: str) -> None:
    """A log that keeps nothing (the default)."""


def steps(items: Sequence[T], what: str, progress: bool) -> Iterable[T]:
    """`items`, with a progress bar on stderr when `progress` is on (calibration steps take minutes)."""
    if not progress:
        return items
    from rich.console import Console
    from rich.progress import track

    return track(items, description=what, console=Console(stderr=True), transient=True)
