"""Stopping on a signal: SIGTERM (what `timeout`, container stops and service managers send) stops a command as
Ctrl-C (SIGINT) does, so that whatever a command saves on the one it saves on the other.

`stop_signals` makes either raise `Stopped`, a KeyboardInterrupt, at once: `finally` blocks and `except
KeyboardInterrupt` run as for Ctrl-C. `deferred_stop` lets a loop end the step it is in and save its state whole: the
first signal only asks (`StopRequest.signum`), a second one stops at once. Signal handlers can only be set on the
main thread; elsewhere both leave signals as they are.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """A command stopped by SIGINT or SIGTERM; its exit status is 128 + `signum`, as a shell reports a signal's."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


def signal_name(signum: int) -> str:
    """SIGINT, SIGTERM, ... (the number where Python has no name for it)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass
class StopRequest:
    """A stop asked for by a signal, for a loop to see where its state is whole: `signum` (0: none asked)."""

    signum: int = 0

    def __bool__(self) -> bool:
        return self.signum != 0

    @property
    def name(self) -> str:
        return signal_name(self.signum)


@contextmanager
def stop_signals() -> Iterator[None]:
    """While inside, SIGINT and SIGTERM raise `Stopped` (with the signal) wherever the main thread is."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise Stopped(signum)

    with _handling(stop):
        yield


@contextmanager
def deferred_stop() -> Iterator[StopRequest]:
    """While inside, the first SIGINT or SIGTERM is recorded in the request the block gets (its loop saves and ends);
    a second one raises `Stopped` at once."""
    request = StopRequest()

    def ask(signum: int, frame: FrameType | None) -> None:
        if request:
            raise Stopped(signum)
        request.signum = signum

    with _handling(ask):
        yield request


@contextmanager
def _handling(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    """`handler` for SIGINT and SIGTERM inside the block (on the main thread), the previous handlers after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
