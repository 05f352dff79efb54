"""The one thread that runs a server's model passes, so that OpenMP keeps a single team of threads.

OpenMP (libgomp: torch's and viasd's kernels share it) gives every thread that starts parallel regions a team of
workers of its own. Once the teams hold more threads than the machine has cores, every region's workers sleep and
wake instead of spinning: measured on a 2-core machine, a parallel region then costs 4x, a decoding step of the
4-bit target 2x. A server has many threads (one per generation, the HTTP loop), so it runs every pass on the thread
that loaded the models (`PassExecutor.serve`), and its generation threads keep OpenMP to one thread of their own
(`confine_openmp`): they sample and keep books; the products run on the executor.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

T = TypeVar("T")

OPENMP_LIBRARIES = ("libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.dylib")


class Peer(Protocol):
    """A pass batcher whose passes run on an executor, as the others there see it (passes/batching.py)."""

    @property
    def queued(self) -> int:
        """Passes waiting at it."""
        ...

    @property
    def weight(self) -> int:
        """Its model's parameters: which model's passes are cheaper."""
        ...


@dataclass(eq=False)
class _Job:
    run: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class PassExecutor:
    """Runs callables on the thread that made it, for any thread that asks (`run`), while that thread `serve`s."""

    def __init__(self) -> None:
        self._owner = threading.get_ident()
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._running = False
        self.jobs_run = 0
        # The pass batchers whose passes run here share this lock, so each sees what waits in the others.
        self.condition = threading.Condition()
        self.batchers: list[Peer] = []

    @property
    def busy(self) -> bool:
        """Whether a job is running or waiting: a pass that waits for more rows costs nothing while this holds."""
        return self._running or not self._jobs.empty()

    def run(self, fn: Callable[[], T]) -> T:
        """`fn()` on the executor's thread (at once when called there), its result or its exception returned here."""
        if threading.get_ident() == self._owner:
            return fn()
        job = _Job(fn)
        self._jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[no-any-return]

    def serve(self, until: Callable[[], bool], poll: float = 0.05) -> None:
        """Run the jobs others hand in until `until()` is true; call on the executor's thread. `poll` bounds how
        long a finished `until` (or a signal handler, which Python runs on the main thread) waits."""
        if threading.get_ident() != self._owner:
            raise RuntimeError("PassExecutor.serve must run on the thread that made the executor")
        while not until():
            try:
                job = self._jobs.get(timeout=poll)
            except queue.Empty:
                continue
            self._running = True
            try:
                job.result = job.run()
            except BaseException as error:  # the caller gets it; the executor goes on with the next job
                job.error = error
            finally:
                self._running = False
                self.jobs_run += 1
                job.done.set()


def confine_openmp() -> bool:
    """Keep the calling thread's OpenMP regions to one thread (its own), so that it starts no team of workers.

    torch sets each thread's OpenMP thread count when the thread first asks for it; this asks first, then sets the
    count to 1 in the OpenMP runtime torch loaded. False when no such runtime is found (nothing changed)."""
    torch.get_num_threads()  # torch's per-thread setting happens now, not later over ours
    for name in OPENMP_LIBRARIES:
        try:
            runtime = ctypes.CDLL(name)  # the copy already loaded by torch, when its name matches
        except OSError:
            continue
        setter = getattr(runtime, "omp_set_num_threads", None)
        if setter is not None:
            setter(1)
            return True
    return False
