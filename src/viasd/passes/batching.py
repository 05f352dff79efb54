"""Passes of several generations merged into one: the model's side of continuous batching.

How concurrent requests share passes starts here; the rest is in passes/executor.py (the one thread that runs a
server's passes), passes/costs.py (a pass's measured cost by rows), decode/load.py (the draft length under load)
and serve/generation.py (admission, worker threads, the batchers' lifetime): docs/design.md, section 6.

Each generation runs its own decoder on its own thread (any method: plain, speculative, VIA-SD) and asks for
passes through its KV sessions as it always does. A `PassBatcher` attached to a model sits under those sessions:
the short passes (decoding steps, verification blocks, chunks of a prompt) that the generations ask for at about
the same time, with the same view of the model, run as one ragged pass (passes/loop.py), whose products read each
weight once for all of them; any other pass (a layer-skipping view, an architecture the loop does not cover) runs
alone. One pass runs on the model at a time, so views never swap their layers under another pass.

Waiting: the first generation to ask leads. It waits until every generation the batcher knows to be active has
asked (they are all between two passes), or `window` seconds, whichever comes first, then runs what is waiting,
at most `max_rows` rows in one pass; the others wait for their results. With an executor the leader hands the
pass to the executor's thread and waits too (a server runs every pass on one thread: see passes/executor.py), and
the window only counts while the executor is idle: generations still drafting then join the next pass.
A sequence's tokens never depend on what else is in its pass (the kernels are row-independent; with torch's
references a product over more rows may round its last bits another way), so a request's output is what it would
get alone.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from viasd.passes import loop
from viasd.passes.costs import PassCosts
from viasd.passes.executor import PassExecutor
from viasd.passes.features import head_inputs
from viasd.passes.loop import Segment
from viasd.passes.route import Leg, Stack
from viasd.views.view import View, applied

BATCHER = "_viasd_pass_batcher"  # the attribute under which a model keeps its batcher
# Tokens per queued chunk of a prompt read by the model's own weights (PassBatcher.own_chunk). Measured on the 2-core
# Xeon, the default target's bf16 forward after 200 tokens: 32 tokens 229 ms, 128 tokens 469 ms, 256 tokens 575 ms;
# so a chunk of 256 holds the model 2.5x as long as one of 32 and reads 3.2x as many tokens a second.
OWN_CHUNK = 256


@dataclass(eq=False)
class _Request:
    """One pass a session asked for: a segment of a ragged pass with `view`, or any pass (`alone`) to run by itself."""

    view: View | None
    segment: Segment | None = None
    leg: Leg | None = None  # a segment's leg of its pass's route: which code runs its layers
    alone: Callable[[], Any] | None = None
    result: Any = None
    seconds: float = 0.0  # what the pass it ran in cost (merged passes cost every request of theirs the whole)
    error: BaseException | None = None
    done: bool = False

    @property
    def rows(self) -> int:
        return 0 if self.segment is None else len(self.segment.ids)


@dataclass(eq=False)
class PassBatcher:
    """Merges the short passes of concurrent generations on one model (see the module docstring)."""

    model: nn.Module
    max_rows: int = 64  # rows (tokens of all sequences) per pass
    chunk: int = 32  # the most tokens of one sequence in a pass: longer ones (prompts) go in chunks of this many
    # The most tokens of one queued chunk of a prompt read by the model's own (bf16) weights, which never merge with
    # other passes: a bf16 product streams its weights, so a longer chunk reads a prompt several times faster and
    # holds the model somewhat longer (`OWN_CHUNK`).
    own_chunk: int = OWN_CHUNK
    window: float = 0.015  # how long a pass waits for stragglers while nothing else runs
    executor: PassExecutor | None = None  # the thread the passes run on (passes/executor.py); None: the leader's
    adapt_drafts: bool = True  # speculative generations choose their draft length from the load (decode/load.py)
    _costs: dict[int, PassCosts] = field(default_factory=dict)  # by id of the view: seconds per pass, by rows
    passes: int = 0  # passes run, merged or alone
    merged_rows: int = 0  # rows that ran in a pass with another sequence's
    _active: int = 0
    _busy: bool = False
    _waiting: list[_Request] = field(default_factory=list)
    _condition: threading.Condition = field(default_factory=threading.Condition)
    _weight: int = 0  # the model's parameters: which model's passes are cheaper

    def __post_init__(self) -> None:
        self._weight = sum(parameter.numel() for parameter in self.model.parameters())
        if self.executor is not None:  # the batchers of one executor share a lock and see each other's queues
            self._condition = self.executor.condition
            self.executor.batchers.append(self)

    def attach(self) -> PassBatcher:
        """Make every KV session of the model route its passes here."""
        self.model.__dict__[BATCHER] = self
        return self

    def detach(self) -> None:
        self.model.__dict__.pop(BATCHER, None)
        if self.executor is not None and self in self.executor.batchers:
            self.executor.batchers.remove(self)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Count a generation as active while the block runs: a leader waits for the active ones to ask."""
        with self._condition:
            self._active += 1
        try:
            yield
        finally:
            with self._condition:
                self._active -= 1
                self._condition.notify_all()

    @property
    def queued(self) -> int:
        """Passes waiting here (read with the lock held)."""
        return len(self._waiting)

    @property
    def weight(self) -> int:
        """The model's parameters: which model's passes are cheaper."""
        return self._weight

    @property
    def sequences(self) -> int:
        """Generations active on the model now (each one, between two of its passes, will ask for another)."""
        return self._active

    def costs(self, view: View | None) -> PassCosts:
        """The measured costs of ragged passes with `view` (views are long-lived: the engine's, or a decoder's)."""
        with self._condition:
            return self._costs.setdefault(id(view), PassCosts())

    def segment(
        self, view: View | None, segment: Segment, leg: Leg
    ) -> tuple[tuple[torch.Tensor, torch.Tensor | None], float]:
        """The logits of `segment` and the features its output head read (passes/features.py; None where its leg
        records none, or it kept no logits), run in a ragged pass with whatever else is waiting for the same view and
        stack (the `leg` of its route that it is), and the seconds that pass took."""
        return self._submit(_Request(view, segment=segment, leg=leg))

    def alone(self, run: Callable[[], Any]) -> tuple[Any, float]:
        """`run()` (a pass that cannot be merged), when no other pass is running on the model, and its seconds."""
        return self._submit(_Request(None, alone=run))

    def _submit(self, request: _Request) -> tuple[Any, float]:
        with self._condition:
            self._waiting.append(request)
            self._condition.notify_all()
            while not request.done:
                if self._busy:
                    self._condition.wait()
                    continue
                self._busy = True
                self._gather()
                batch = self._take()
                self._condition.release()
                try:
                    if self.executor is None:
                        self._run(batch)
                    else:
                        self.executor.run(functools.partial(self._run, batch))
                finally:
                    self._condition.acquire()
                    self._busy = False
                    self._condition.notify_all()
        if request.error is not None:
            raise request.error
        return request.result, request.seconds

    def _gather(self) -> None:
        """Wait (lock held) until the pass is ready (`_ready`), or `window` seconds have passed with the executor
        idle: while it runs other passes (the drafter's, another view's), waiting costs nothing, and the
        generations still drafting join this pass instead of needing one of their own."""
        deadline = time.monotonic() + self.window
        while not self._ready():
            left = deadline - time.monotonic()
            if left <= 0:
                if self.executor is None or not self.executor.busy:
                    return
                deadline = time.monotonic() + self.window
                left = self.window
            self._condition.wait(left)

    def _ready(self) -> bool:
        """Whether the pass may start (lock held): see `ready`."""
        if self.executor is None:
            return ready(self._active, len(self._waiting), self._weight, [])
        others = [(peer.queued, peer.weight) for peer in self.executor.batchers if peer is not self]
        return ready(self._active, len(self._waiting), self._weight, others)

    def _take(self) -> list[_Request]:
        """The next pass's requests (lock held): see `next_pass`."""
        batch = next_pass(self._waiting, self.max_rows)
        for request in batch:
            self._waiting.remove(request)
        return batch

    def _run(self, batch: list[_Request]) -> None:
        """Run one pass for `batch` (lock not held) and hand every request its result or the error."""
        start = time.perf_counter()
        try:
            if batch[0].alone is not None:
                outcomes = [batch[0].alone()]
            else:
                segments = [request.segment for request in batch]
                leg = batch[0].leg
                assert leg is not None, "a segment comes with its leg"
                # The output head's inputs are recorded only where a segment's leg says a draft head follows it.
                capture = any(request.leg is not None and request.leg.features for request in batch)
                with (
                    torch.inference_mode(),
                    applied(self.model, batch[0].view),
                    head_inputs(self.model, capture) as seen,
                ):
                    logits = loop.ragged_pass(self.model, segments, leg.stack, leg.attention_kernel)  # type: ignore[arg-type]
                # The head read every segment's kept rows in one call, in order.
                rows = seen[-1].split([s.keep for s in segments]) if seen else [None] * len(batch)  # type: ignore[union-attr]
                outcomes = [
                    (row_logits, row if request.leg is not None and request.leg.features else None)
                    for request, row_logits, row in zip(batch, logits, rows, strict=True)
                ]
                self.costs(batch[0].view).record(sum(request.rows for request in batch), time.perf_counter() - start)
                if len(batch) > 1:
                    self.merged_rows += sum(request.rows for request in batch)
            seconds = time.perf_counter() - start
            for request, outcome in zip(batch, outcomes, strict=True):
                request.result, request.seconds = outcome, seconds
        except BaseException as error:  # every request of the pass sees the pass's error
            for request in batch:
                request.error = error
        finally:
            self.passes += 1
            for request in batch:
                request.done = True


def ready(active: int, waiting: int, weight: int, others: list[tuple[int, int]]) -> bool:
    """Whether a batcher's pass may start, with `waiting` of `active` generations waiting at it and (waiting,
    weight) at the other batchers of its executor: once every active generation waits somewhere, unless a cheaper
    model (a drafter: fewer parameters) has passes waiting. Those run first, so that the generations still drafting
    reach this pass in time to share it; the window (`PassBatcher._gather`) bounds the wait otherwise."""
    if waiting + sum(count for count, _ in others) < active:
        return False
    return not any(count and other < weight for count, other in others)


def next_pass(waiting: list[_Request], max_rows: int) -> list[_Request]:
    """The requests of the next pass, from those waiting in arrival order: the oldest always (so none starves),
    and if it is a segment, every waiting segment of the same view and stack after it, in order, up to `max_rows`
    rows (the oldest alone may exceed them). Segments of one view have one stack (passes/route.py decides it from the
    view and the model); the check keeps a pass from running a segment by another's route."""
    first = waiting[0]
    if first.segment is None:
        return [first]
    batch, rows = [], 0
    for request in waiting:
        if (
            request.segment is not None
            and request.view is first.view
            and _stack(request) == _stack(first)
            and (not batch or rows + request.rows <= max_rows)
        ):
            batch.append(request)
            rows += request.rows
    return batch


def _stack(request: _Request) -> tuple[Stack, bool] | None:
    return None if request.leg is None else (request.leg.stack, request.leg.attention_kernel)


def batcher_of(model: nn.Module) -> PassBatcher | None:
    """The batcher the model's sessions route their passes through, if one is attached."""
    return model.__dict__.get(BATCHER)
