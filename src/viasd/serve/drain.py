"""The end of a graceful shutdown: what requests still running are told when `--shutdown-timeout` is over.

On SIGTERM or Ctrl-C uvicorn stops accepting connections and waits for the requests in flight; past its own
timeout it cancels them, which cuts a stream with no finish reason, error event or [DONE] and logs a
CancelledError traceback. So the server ends them first: when the drain's time is up, each stream still
running gets an error event and [DONE], each plain request a 503, both with code `shutting_down`, and the log
one line. Uvicorn's timeout is set a little later (`UVICORN_MARGIN`), as a backstop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

log = logging.getLogger("viasd.serve")

UVICORN_MARGIN = 3.0  # seconds uvicorn waits beyond the drain before it cancels what is left
T = TypeVar("T")


class Drained(Exception):
    """The drain ended while a request was still running."""


class Drain:
    """The grace period of a shutdown: begun from a signal handler (any thread), watched by requests on the loop."""

    def __init__(self, seconds: float, on_end: Callable[[], None] | None = None) -> None:
        self.seconds = seconds
        self.on_end = on_end  # called on the loop when the drain ends with requests still running
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ended: asyncio.Event | None = None
        self._begun = False
        self._running = 0

    @property
    def message(self) -> str:
        """What a request ended by the drain is told."""
        return f"the server shut down before this request finished (--shutdown-timeout {self.seconds:g} s)"

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Attach to the server's event loop (at the app's startup)."""
        self._loop = loop
        self._ended = asyncio.Event()

    def begin(self) -> None:
        """Start the grace period; called again (a second Ctrl-C), end it now. Safe from any thread."""
        if self._loop is None or self._loop.is_closed():
            return
        delay = 0.0 if self._begun else self.seconds
        self._begun = True
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing is running
            self._loop.call_soon_threadsafe(self._loop.call_later, delay, self._end)

    def _end(self) -> None:
        assert self._ended is not None
        if self._ended.is_set():
            return
        self._ended.set()
        if self._running:
            log.warning(
                "--shutdown-timeout (%g s) is over: %d request(s) still running ended early with a shutting_down error",
                self.seconds,
                self._running,
            )
            if self.on_end is not None:
                self.on_end()

    @contextmanager
    def running(self) -> Iterator[None]:
        """Count a request as running while in this block (the drain's log line says how many it ended)."""
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1

    async def race(self, awaitable: Awaitable[T]) -> T:
        """The awaitable's result, or `Drained` when the drain ends first (the awaitable is then cancelled: shield
        what must go on)."""
        if self._ended is None:
            return await awaitable
        if self._ended.is_set():
            raise Drained
        work = asyncio.ensure_future(awaitable)
        ended = asyncio.ensure_future(self._ended.wait())
        try:
            await asyncio.wait({work, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not work.done():
                work.cancel()
        if work.done() and not work.cancelled():
            return work.result()
        raise Drained
