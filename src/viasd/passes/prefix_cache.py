"""A prefix cache across generations: finished generations' committed KV entries, kept by their tokens, so that a
later prompt that starts the same way (a chat client resends the whole conversation every turn) reads only the rest.

Entries hold copies: `keep` copies a decoder's sessions' committed entries out, `resume` copies an entry's leading
positions into fresh caches. No request ever holds an entry's tensors, so none can change them (copy on use), and an
entry's memory is exactly its tensors' bytes, which the cache bounds, evicting the least recently used entries. An
entry larger than the whole bound is not kept: /metrics counts these refusals, and the first is logged in one line.

What a resumed session holds (each of a decoder's sessions: the target's, a drafter's) is what `KVSession` promises
of its committed tokens: positions [0, L) hold the entries a pass of its base view over those tokens writes (their
rotary embeddings are those of the same positions), with no pending (slim) entries and no features (a draft head
drafts from the feature of a position its session computes again). A sliding-window layer keeps only the positions
near its end, so an entry serves a cut there only where it still holds that cut's window. The last `REREAD` prompt
tokens are always read again, so every method computes the logits it starts from, and no method crops a resumed
session (a sliding-window layer may not be cropped further back than its last pass).

Reused entries were written by the passes of the earlier generation (its decoding steps, its prompt's pass), not by
one pass over the new prompt, so they may round differently in the last bits, as in any prefix cache; and where a
quantized view reads a long prompt's head by the model's own weights (passes/route.py, `split`), the reused
positions an earlier generation decoded hold the view's entries instead.

Exact reuse (`exact_reuse`, `read_prompt`): where the target's passes of 1 to PACK_UP_TO tokens all run viasd's
fused low-bit layers (the default GGUF view on a CPU), a row of such a pass is the same bits in any block. If the
prompt's head is then read in passes of at most PACK_UP_TO tokens, fresh or after a resumed prefix alike, every
position of the target's cache is written by such a pass over the same tokens before it, whatever the passes' cuts:
its decoding steps and verification blocks are such passes too. A resumed prompt's entries, logits and text are
then a fresh read's, bit for bit (`viasd chat` and `viasd serve` read so).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from viasd.kernels.packed_attention import PACK_UP_TO
from viasd.passes.cache_layer import GrowingLayer
from viasd.passes.route import Stack
from viasd.passes.session import KVSession, common_prefix_length, new_cache
from viasd.views.view import View

REREAD = 2  # prompt tokens at the end that are always read again (see the module docstring)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerCopy:
    """One cache layer's entries of positions [start, start + length); `window`: a sliding layer's window (None:
    full attention, start 0)."""

    keys: torch.Tensor
    values: torch.Tensor
    start: int
    window: int | None

    @property
    def length(self) -> int:
        return self.keys.shape[-2]

    def serves(self, cut: int) -> bool:
        """Whether the layer's state at `cut` tokens can be made from this copy: the positions it attends to then."""
        if cut > self.start + self.length:
            return False
        if self.window is None:
            return self.start == 0
        return max(0, cut - self.window + 1) >= self.start


@dataclass(frozen=True)
class SessionCopy:
    """A session's committed tokens and the entries of each of its cache layers, with the model and view that wrote
    them (a copy resumes only a session of the same model and view)."""

    model: torch.nn.Module
    view: View | None
    tokens: tuple[int, ...]
    layers: tuple[LayerCopy, ...]

    @property
    def nbytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)

    def serves(self, cut: int) -> bool:
        return cut <= len(self.tokens) and all(layer.serves(cut) for layer in self.layers)


def copy_session(session: KVSession) -> SessionCopy | None:
    """A copy of `session`'s committed entries; None where it holds none or a cache layer of a kind it cannot copy."""
    tokens = tuple(session.tokens)
    committed = len(tokens)
    if not committed:
        return None
    layers = []
    with torch.inference_mode():
        for layer in session.cache.layers:
            if not layer.is_initialized:
                return None
            if type(layer) is GrowingLayer:
                start, window = 0, None
            elif type(layer) is DynamicSlidingWindowLayer:
                start, window = layer.get_seq_length() - layer.keys.shape[-2], layer.sliding_window
            else:
                return None
            held = max(0, committed - start)  # beyond the committed tokens: pending entries, never copied
            keys = layer.keys[..., :held, :].clone()
            values = layer.values[..., :held, :].clone()
            layers.append(LayerCopy(keys, values, min(start, committed), window))
    return SessionCopy(session.model, session.base_view, tokens, tuple(layers))


def resume_session(session: KVSession, copy: SessionCopy, cut: int) -> None:
    """Make `session` hold the copy's first `cut` tokens and their entries, in caches of its own (the copy is only
    read)."""
    assert copy.serves(cut) and copy.model is session.model
    cache = new_cache(session.model)
    with torch.inference_mode():
        for layer, part in zip(cache.layers, copy.layers, strict=True):
            if cut == 0:
                continue
            held = cut - part.start
            # `update` copies into the layer's own store (a sliding layer: a new tensor, by concatenation).
            layer.update(part.keys[..., :held, :], part.values[..., :held, :])
            if isinstance(layer, DynamicSlidingWindowLayer):
                layer.cumulative_length = cut  # it holds positions [start, cut): the window at cut and some before
    session.adopt(cache, copy.tokens[:cut])


def resumable_cut(copy: SessionCopy, prompt: Sequence[int]) -> int:
    """How many of `prompt`'s leading tokens a session resumed from `copy` starts with (0: none)."""
    cut = min(common_prefix_length(copy.tokens, prompt), len(prompt) - REREAD)
    return cut if cut > 0 and copy.serves(cut) else 0


def exact_reuse(sessions: Sequence[KVSession], method: str = "this method") -> str | None:
    """None where kept entries are the bits a fresh read writes: the target's (first) session's passes of 1 and of
    PACK_UP_TO tokens run viasd's fused low-bit layers alone or merged (their rows do not depend on the pass); else
    why not, in words."""
    if not sessions:
        return f"{method} runs no KV session of viasd's"
    target = sessions[0]
    for tokens in (1, PACK_UP_TO):
        if any(leg.stack is not Stack.FUSED for leg in target.route(tokens, target.base_view, 1).legs):
            view = target.base_view.describe() if target.base_view is not None else "loaded"
            return (
                f"the target runs as {view}, not on viasd's fused low-bit layers, so kept entries would round "
                "otherwise than a fresh read"
            )
    return None


def read_prompt(session: KVSession, prompt: Sequence[int]) -> int:
    """Read `prompt` on the target's `session` (just reset or resumed: it holds a prefix of the prompt) up to its
    last REREAD tokens, which the decoder reads for its logits, in passes of at most PACK_UP_TO tokens; returns how
    many tokens the session held before.

    Where `exact_reuse` holds, this makes a prompt's entries the same bits however much of it was resumed. Cost, by
    counting (Zen 4, 2 cores, the default 1.5B target): a fused pass costs about 18 ms plus 2.6 ms a row, so pieces
    of 16 read about 3.7 ms a token, where the model's own forward over a whole prompt read 5.5-7.3 ms a token (the
    edit workload's prompts of 68-1,438 tokens); a server's batcher read prompts in merged fused chunks of 32,
    about 3.2 ms a token: pieces of 16 add one weight read (18 ms) per 32 tokens there, a seventh more."""
    first, stop = session.committed, len(prompt) - REREAD
    for begin in range(first, stop, PACK_UP_TO):
        session.forward(prompt[begin : min(begin + PACK_UP_TO, stop)])
    return first


@dataclass(frozen=True)
class PrefixCacheCounts:
    """What the cache did so far and holds now, for /metrics."""

    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    evictions: int = 0
    refused: int = 0  # finished generations not kept: their entries alone exceed the capacity
    entries: int = 0
    bytes: int = 0
    capacity_bytes: int = 0


@dataclass
class _Entry:
    key: str
    sessions: tuple[SessionCopy | None, ...]
    nbytes: int

    def covers(self, other: _Entry) -> bool:
        """Whether this entry serves every cut `other` serves (each session's tokens extend `other`'s, no sliding
        windows), so `other` is no longer needed."""
        for mine, theirs in zip(self.sessions, other.sessions, strict=True):
            if theirs is None:
                continue
            if mine is None or mine.tokens[: len(theirs.tokens)] != theirs.tokens:
                return False
            if any(layer.window is not None for layer in mine.layers):
                return False
        return True


def _distinct(sessions: Sequence[KVSession]) -> tuple[KVSession, ...]:
    return tuple({id(session): session for session in sessions}.values())


class PrefixCache:
    """Finished generations' KV entries, by method and tokens, within `capacity_bytes`, least recently used first
    out. Thread-safe: generations on several worker threads keep and resume entries."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("the prefix cache's capacity must be >= 0")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest use first
        self._next = 0
        self._lock = threading.Lock()
        self._bytes = 0
        self._hits = self._misses = self._reused = self._evictions = self._refused = 0

    def resume(self, key: str, sessions: Sequence[KVSession], prompt: Sequence[int]) -> int:
        """Start `sessions` (a decoder's, built for `key`, just reset) from the kept entry of `key` that shares the
        longest prefix with `prompt`; returns how many prompt tokens the first session (the target's) starts with."""
        sessions = _distinct(sessions)
        if not sessions or not self.capacity_bytes:
            return 0
        with self._lock:
            best, reach = None, 0
            for number, entry in self._entries.items():
                if entry.key != key or len(entry.sessions) != len(sessions):
                    continue
                first = entry.sessions[0]
                cut = resumable_cut(first, prompt) if first is not None else 0
                if cut > reach:
                    best, reach = number, cut
            if best is None:
                self._misses += 1
                return 0
            self._entries.move_to_end(best)
            entry = self._entries[best]
            self._hits += 1
            self._reused += reach
        for session, copy in zip(sessions, entry.sessions, strict=True):
            if copy is None or copy.model is not session.model or copy.view != session.base_view:
                continue
            cut = resumable_cut(copy, prompt)
            if cut:
                resume_session(session, copy, cut)
        return reach

    def keep(self, key: str, sessions: Sequence[KVSession]) -> None:
        """Keep copies of `sessions`' committed entries (a finished generation's, decoded for `key`), evicting the
        least recently used entries to stay within the capacity; an entry larger than the capacity is not kept."""
        sessions = _distinct(sessions)
        if not sessions or not self.capacity_bytes:
            return
        copies = tuple(copy_session(session) for session in sessions)
        if copies[0] is None:
            return
        entry = _Entry(key, copies, sum(copy.nbytes for copy in copies if copy is not None))
        if entry.nbytes > self.capacity_bytes:
            self._refuse(entry, len(copies[0].tokens))
            return
        with self._lock:
            for number, old in list(self._entries.items()):
                if old.key == key and len(old.sessions) == len(copies) and entry.covers(old):
                    self._drop(number)  # superseded, not evicted: the new entry serves all it served
            while self._bytes + entry.nbytes > self.capacity_bytes:
                self._drop(next(iter(self._entries)))
                self._evictions += 1
            self._entries[self._next] = entry
            self._next += 1
            self._bytes += entry.nbytes

    def _refuse(self, entry: _Entry, tokens: int) -> None:
        """Count an entry too large to keep; the first one is said in the log."""
        with self._lock:
            self._refused += 1
            first = self._refused == 1
        if first:
            log.warning(
                "prefix cache: a finished generation's KV entries (%d tokens, %.1f MiB) exceed the whole cache "
                "(%.1f MiB): not kept, so prompts that start the same way are read in full (a larger "
                "--prefix-cache-mb keeps them; viasd_prefix_cache_refused_total counts them)",
                tokens, entry.nbytes / 2**20, self.capacity_bytes / 2**20,
            )  # fmt: skip

    def _drop(self, number: int) -> None:
        self._bytes -= self._entries.pop(number).nbytes

    def counts(self) -> PrefixCacheCounts:
        with self._lock:
            return PrefixCacheCounts(
                self._hits,
                self._misses,
                self._reused,
                self._evictions,
                self._refused,
                len(self._entries),
                self._bytes,
                self.capacity_bytes,
            )
