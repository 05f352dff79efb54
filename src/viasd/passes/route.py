"""Which code runs a pass: one decision, taken once at the top of the pass, from explicit facts.

A pass (a session's `forward` or `forward_slim`: a prompt, a decoding step, a verification block) runs as one of
these routes (docs/design.md draws them):

* `model`: the model's own forward (transformers', or viasd's modules for a model built from a file), alone: any
  architecture, view, length or hook.
* `loop`: viasd's loop over the model's modules, layer by layer (passes/loop.py), alone.
* `fused`: viasd's loop with every decoder layer in one C call (passes/fused.py), alone.
* `batched`: a segment of a ragged pass (loop or fused) that a batcher merges with other generations' passes.
* `queued`: the model's own forward (or, for a pass the batcher would not merge, the loop), alone, in turn with
  the batcher's merged passes (one pass on a model at a time).
* `chunked`: a long pass (a prompt) as batched passes of the batcher's chunk size, so that it stalls nobody (a
  quantized view's head in queued chunks of the model's own weights, as `split` reads it: those never merge, and
  go in longer chunks, `own_chunk`, since a bf16 product streams its weights: 256 rows cost 2.5x what 32 do).
* `split`: a prompt of a quantized view: the positions that need no logits with the model's own weights, the rest
  with the view (`QuantRecipe.own_weights_from`).

`decide` is a pure function of the pass's length and `Facts`, which passes/facts.py gathers from the pass's model,
cache, view and batcher for every caller: sessions (`KVSession.route`), training's conversations, calibration's
teacher. The route imports none of the stacks it chooses between: they sit above it and read its `Stack`. The
executing code (passes/session.py, passes/batching.py, passes/loop.py) runs the route's legs as they say, including
whether a leg records features for a draft head, and checks nothing again.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from viasd.kernels.packed_attention import PACK_UP_TO


class Stack(Enum):
    """Which code runs a leg's decoder layers."""

    MODEL = "model"  # the model's own forward (transformers', or models/network.py's)
    LOOP = "loop"  # viasd's loop, layer by layer, over the model's modules (passes/loop.py, passes/layer_loop.py)
    FUSED = "fused"  # viasd's loop, all layers in one C call (passes/fused.py)


class Schedule(Enum):
    """How a leg is run beside other generations' passes."""

    ALONE = "alone"  # no batcher: on the caller's thread, by itself
    BATCHED = "batched"  # a segment of the batcher's next ragged pass (passes/batching.py)
    QUEUED = "queued"  # by itself, when the batcher runs no other pass


class Kind(Enum):
    """A route's name, by which passes are counted (`KVSession.routes`, `--json`'s `routes`)."""

    MODEL = "model"
    LOOP = "loop"
    FUSED = "fused"
    BATCHED = "batched"
    QUEUED = "queued"
    CHUNKED = "chunked"
    SPLIT = "split"


@dataclass(frozen=True)
class Leg:
    """One pass that a route runs: the pass's tokens [start, stop), the logits of their last `keep` positions (the
    pass's result, unless `own_weights`), with the view or, where `own_weights`, the model's own weights; where
    `features`, the features of those positions too (passes/features.py)."""

    start: int
    stop: int
    keep: int
    schedule: Schedule
    stack: Stack
    attention_kernel: bool = False  # LOOP: each layer's attention by viasd's C kernel (FUSED: always; MODEL: never)
    own_weights: bool = False
    # The final hidden states the output head reads at the kept positions (the one layer a draft head drafts from),
    # recorded for the head that follows the pass; False: no capture hook is installed.
    features: bool = False


@dataclass(frozen=True)
class Route:
    """How one pass runs: its legs, in order (one, or the chunks of a prompt, or a split's two parts)."""

    kind: Kind
    legs: tuple[Leg, ...]


@dataclass(frozen=True)
class Facts:
    """What a pass's route depends on besides its length, as it stands when the pass starts."""

    loop: bool  # viasd's loop runs this model on this cache (passes/loop.py `covers` and `runs_on`)
    chunk: int | None = None  # the attached batcher's most tokens of one sequence per pass; None: no batcher
    own_chunk: int | None = None  # its most tokens per queued chunk of the model's own weights; None: `chunk`
    skips: bool = False  # the view skips layers: only the model's own forward, or the fused stack, runs it
    # the view's decoder layers run as one C call (passes/fused.py `fits`; one that skips whole layers leaves them out)
    fused: bool = False
    attention_kernel: bool = False  # the attention kernel takes the model's shapes and dtype
    own_weights_from: int | None = None  # the view reads positions without logits by the model's weights from here
    features: bool = False  # a draft head follows the pass: its legs record the features of their kept positions
    masked: bool = False  # the pass brings its own attention mask (teacher forcing): only the model's forward takes it


def decide(tokens: int, keep: int, facts: Facts) -> Route:
    """The route of a pass of `tokens` tokens whose last `keep` positions need logits (0 < keep <= tokens).

    Which weights write a position's KV entries depends only on whether its logits are needed in a long pass (the
    view's own, or the model's where `own_weights_from` says so), never on a batcher: a chunked pass reads a split's
    head with the model's weights too, so a generation's cache, and so its tokens, are what they are alone.
    """
    if facts.masked:  # one leg, whole: the loop and the fused stack build their own masks, and a split cuts one
        leg = Leg(0, tokens, keep, Schedule.ALONE if facts.chunk is None else Schedule.QUEUED, Stack.MODEL,
                  features=facts.features)  # fmt: skip
        return Route(Kind.MODEL if facts.chunk is None else Kind.QUEUED, (leg,))
    head = tokens - keep
    split = facts.own_weights_from is not None and head > 0 and facts.own_weights_from <= head
    # The batcher's chunk where it may merge this pass's parts (viasd's loop runs them), else None.
    chunk = facts.chunk if facts.loop and not facts.skips and facts.chunk else None
    if chunk is not None and tokens > chunk:
        parts = [(0, head, True), (head, tokens, False)] if split else [(0, tokens, False)]
        legs = []
        for first, last, own in parts:
            step = (facts.own_chunk or chunk) if own else chunk
            for start in range(first, last, step):
                stop = min(start + step, last)
                # Of this chunk's positions, the kept ones: a block of `keep` may start in an earlier chunk.
                wanted = 1 if own else min(stop - start, max(0, keep - (tokens - stop)))  # own: 1, see split
                legs.append(_leg(start, stop, wanted, facts, own_weights=own))
        return Route(Kind.CHUNKED, tuple(legs))
    if split:  # keep=1 for the head: the model's own forward reads 0 as "every position"
        return Route(Kind.SPLIT, (_leg(0, head, 1, facts, own_weights=True), _leg(head, tokens, keep, facts, False)))
    leg = _leg(0, tokens, keep, facts, own_weights=False)
    if leg.schedule is Schedule.BATCHED:
        return Route(Kind.BATCHED, (leg,))
    if leg.schedule is Schedule.QUEUED:
        return Route(Kind.QUEUED, (leg,))
    return Route(Kind(leg.stack.value), (leg,))


def _leg(start: int, stop: int, keep: int, facts: Facts, own_weights: bool) -> Leg:
    """One leg: merged where a batcher takes it, else alone or queued; viasd's loop for short passes of the models,
    views and caches it runs, the model's own forward otherwise."""
    tokens = stop - start
    looped = facts.loop and (own_weights or not facts.skips or facts.fused)
    # The model's own weights are never low-bit ones: only a view's layers run fused.
    stack = Stack.FUSED if facts.fused and not own_weights else Stack.LOOP
    kernel = facts.attention_kernel and stack is Stack.LOOP
    # The model's own (bf16 or float32) weights never merge: torch's products round a row differently by how many
    # rows the product has (oneDNN with AMX or AVX-512 BF16, BLAS in float32), so a generation's prompt must be read
    # in the same passes as it would be alone. The low-bit views' kernels are row-independent and do merge.
    # A view that skips layers is never merged: the batcher's passes run every layer.
    if facts.chunk is not None and looped and not own_weights and not facts.skips and 0 < tokens <= facts.chunk:
        return Leg(start, stop, keep, Schedule.BATCHED, stack, kernel, own_weights, facts.features)
    schedule = Schedule.ALONE if facts.chunk is None else Schedule.QUEUED
    if looped and 0 < tokens <= PACK_UP_TO:
        return Leg(start, stop, keep, schedule, stack, kernel, own_weights, facts.features)
    return Leg(start, stop, keep, schedule, Stack.MODEL, False, own_weights, facts.features)
