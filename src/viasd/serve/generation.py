"""Runs up to `max_active` generations at once, their model passes merged, behind a bounded queue; lets clients cancel.

Each running generation has a worker thread and a slot: its own decoders (and so its own KV sessions) built on the
engine's shared models and views. Their passes meet in a `PassBatcher` per model (passes/batching.py), which runs
the short passes that arrive together as one pass: a decoding step of one request, a verification block of another
and a chunk of a third's prompt share every weight read (continuous batching: a request joins or leaves between
two passes). Jobs beyond the running ones queue in arrival order; a job keeps its slot until its thread really
ends, even when the request that started it is gone. Admission is bounded: more than `max_queue` waiting jobs and
new requests are refused at once (503) rather than left to time out. A job is cancelled by setting its event; the
decoder notices at its next committed text (the `on_text` callback raises) and stops, which frees its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from time import perf_counter

from viasd.decode.base import GenerationConfig, GenerationResult, Resume
from viasd.decode.logprobs import TokenLogprob
from viasd.engine import Engine
from viasd.methods import MethodSpec
from viasd.passes.batching import PassBatcher, batcher_of
from viasd.passes.executor import PassExecutor, confine_openmp
from viasd.passes.prefix_cache import PrefixCache, read_prompt
from viasd.passes.session import KVSession
from viasd.serve.errors import APIError
from viasd.serve.latency import request_times
from viasd.serve.metrics import Metrics

log = logging.getLogger("viasd.serve")


class GenerationCancelled(Exception):
    """Raised inside the decoder (from `on_text`) to stop a generation whose client went away."""


# What a job streams: a text piece, the log-probabilities of the tokens committed before it (when asked for), or
# None at the end.
Piece = str | list[TokenLogprob] | None


@dataclass
class Job:
    """One submitted generation: text pieces as they are committed, then the result (or an exception)."""

    method: str
    cancel: threading.Event
    result: asyncio.Future[GenerationResult]
    pieces: asyncio.Queue[Piece] = field(default_factory=asyncio.Queue)

    def done(self) -> bool:
        return self.result.done()


def _mark_retrieved(result: asyncio.Future[GenerationResult]) -> None:
    """Silence "exception never retrieved" for jobs whose client left without awaiting the result."""
    if not result.cancelled():
        result.exception()


def _resume_exactly(cache: PrefixCache, method: str, sessions: Sequence[KVSession], prompt: Sequence[int]) -> None:
    """Start the sessions from the cache, then read the target's rest of the prompt (all of it on a miss) in passes
    of at most PACK_UP_TO tokens: where the target runs the fused layers, every position of its cache is then
    written by such a pass over the same tokens, whether this prompt was resumed or not, so a prefix hit gets a
    fresh read's bits and text (passes/prefix_cache.py, `read_prompt`)."""
    cache.resume(method, sessions, prompt)
    read_prompt(sessions[0], prompt)


class GenerationService:
    """The queue in front of the engine: admission, the worker threads and their slots, the pass batchers,
    cancellation, metrics."""

    def __init__(self, engine: Engine, metrics: Metrics, max_queue: int, max_active: int = 1,
                 max_rows: int = 64, adaptive_drafts: bool = True,
                 executor: PassExecutor | None = None,
                 prefix_cache: PrefixCache | None = None, exact: frozenset[str] = frozenset(),
                 cached: frozenset[str] | None = None) -> None:  # fmt: skip
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.max_active = max_active
        self.max_rows = max_rows
        self.adaptive_drafts = adaptive_drafts
        self.prefix_cache = prefix_cache  # finished generations' KV, resumed by later prompts that start the same way
        self.exact = exact  # methods whose resumed prompts are a fresh read's bits (passes/prefix_cache.py)
        self.cached = cached  # the methods the prefix cache serves (None: all)
        self.executor = executor  # with one, every pass runs on its thread and the workers keep OpenMP to themselves
        self._workers = ThreadPoolExecutor(
            max_workers=max_active,
            thread_name_prefix="viasd-generate",
            initializer=confine_openmp if executor is not None else None,  # once per worker thread
        )
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(max_active):
            self._slots.put(slot)
        self._batchers: list[PassBatcher] = []
        self._lock = threading.Lock()
        self._pending = 0  # admitted jobs whose thread work has not ended (waiting + running)
        self._running = 0
        self._cancels: set[threading.Event] = set()
        self._closed = False

    @property
    def capacity(self) -> int:
        """Jobs that may be in the service at once: `max_active` running plus `max_queue` waiting."""
        return self.max_queue + self.max_active

    @contextlib.contextmanager
    def _batched(self) -> Iterator[None]:
        """While a generation runs: every loaded model has a pass batcher (with one generation at a time and no
        executor there is nothing for one to do: none), and the generation counts as active in each."""
        if self.max_active == 1 and self.executor is None:
            yield
            return
        with self._lock:
            for loaded in self.engine.loaded_models:
                if batcher_of(loaded.model) is None:
                    self._batchers.append(
                        PassBatcher(
                            loaded.model,
                            max_rows=self.max_rows,
                            executor=self.executor,
                            adapt_drafts=self.adaptive_drafts,
                        ).attach()
                    )
            batchers = list(self._batchers)
        with contextlib.ExitStack() as stack:
            for batcher in batchers:
                stack.enter_context(batcher.active())
            yield

    def depth(self) -> tuple[int, int]:
        """(waiting, running) jobs now."""
        with self._lock:
            return self._pending - self._running, self._running

    def submit(self, prompt_ids: Sequence[int], spec: MethodSpec, config: GenerationConfig) -> Job:
        """Queue a generation with the method `spec` (as parsed when the server started), or refuse it with 503 when
        the queue is full; call from the event loop."""
        loop = asyncio.get_running_loop()
        method = spec.name
        with self._lock:
            if self._closed:
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if self._pending >= self.capacity:
                raise APIError(
                    503,
                    f"the server is busy: {self._pending} requests are already running or queued "
                    f"(limit {self.capacity}, --max-queue {self.max_queue}); retry later",
                    code="queue_full",
                    headers={"Retry-After": "1"},
                )
            self._pending += 1
            cancel = threading.Event()
            self._cancels.add(cancel)
        prompt = list(prompt_ids)
        arrived = perf_counter()  # the request's latencies count from here (serve/latency.py)

        def on_text(piece: str) -> None:
            if cancel.is_set():
                raise GenerationCancelled
            loop.call_soon_threadsafe(pieces.put_nowait, piece)

        def on_logprobs(entries: list[TokenLogprob]) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, entries)

        def work() -> GenerationResult:
            with self._lock:
                self._running += 1
            try:
                if cancel.is_set():
                    raise GenerationCancelled
                slot = self._slots.get()  # a worker thread has one: there are as many slots as threads
                started = perf_counter()
                try:
                    with self._batched():
                        result = self._generate(prompt, spec, config, on_text, on_logprobs, slot)
                finally:
                    self._slots.put(slot)
            except GenerationCancelled:
                if self._closed:  # the drain's end or the app's shutdown: they say so, once for all
                    log.debug("stopped a %s generation: the server is shutting down", method)
                else:
                    log.info("stopped a %s generation: its client went away", method)
                self.metrics.record_cancelled(method)
                raise
            except Exception:
                self.metrics.record_failed(method)
                raise
            finally:
                with self._lock:
                    self._running -= 1
            ended, generating = perf_counter(), result.stats.total_seconds
            times = request_times(arrived, started, ended, result.first_token_seconds, generating, len(result.tokens))
            self.metrics.record(method, result.stats, times)
            return result

        def finished(future: Future[GenerationResult]) -> None:
            with self._lock:
                self._pending -= 1
                self._cancels.discard(cancel)
            if future.cancelled():  # dropped from the queue before it started
                self.metrics.record_cancelled(method)
            with contextlib.suppress(RuntimeError):  # the event loop is already closed
                loop.call_soon_threadsafe(pieces.put_nowait, None)

        pieces: asyncio.Queue[Piece] = asyncio.Queue()
        try:
            future = self._workers.submit(work)
        except RuntimeError as error:  # executor shut down between the check above and now
            with self._lock:
                self._pending -= 1
                self._cancels.discard(cancel)
            raise APIError(503, "the server is shutting down", code="shutting_down") from error
        future.add_done_callback(finished)
        result = asyncio.wrap_future(future, loop=loop)
        result.add_done_callback(_mark_retrieved)
        return Job(method=method, cancel=cancel, result=result, pieces=pieces)

    def _generate(self, prompt: list[int], spec: MethodSpec, config: GenerationConfig, on_text: Callable[[str], None],
                  on_logprobs: Callable[[list[TokenLogprob]], None], slot: int) -> GenerationResult:  # fmt: skip
        """One generation on `slot`'s decoder, started from the prefix cache and kept there when it ends."""
        cache, method = self.prefix_cache, spec.name
        decoder = self.engine.decoder(spec, slot)
        logprobs = on_logprobs if config.logprobs is not None else None
        if cache is None or (self.cached is not None and method not in self.cached):
            return decoder.generate(prompt, config, on_text=on_text, on_logprobs=logprobs)
        resume: Resume = functools.partial(cache.resume, method)
        if method in self.exact:
            resume = functools.partial(_resume_exactly, cache, method)
        result = decoder.generate(prompt, config, on_text=on_text, resume=resume, on_logprobs=logprobs)
        cache.keep(method, decoder.sessions())
        return result

    def close(self, wait: bool = True) -> None:
        """Refuse new jobs, cancel the ones still queued or running, and (optionally) wait for the thread."""
        with self._lock:
            self._closed = True
            for cancel in self._cancels:
                cancel.set()
        self._workers.shutdown(wait=wait, cancel_futures=True)
        if wait:
            for batcher in self._batchers:
                batcher.detach()
