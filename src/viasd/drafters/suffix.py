"""Suffix drafting: copy what followed the longest earlier match of the context's tail, in the prompt, the answer so
far and (in a server, where allowed) recent requests' prompts and answers, as long as the match says it is safe.

Edits, the second turn of a chat and an agent's next step copy long runs of their input or of earlier answers
(SuffixDecoding, arXiv 2411.04975). Prompt lookup copies at most `gamma` tokens per round from the latest match of a
short n-gram; here the match is the longest one found (every earlier occurrence of the tail's last SEED tokens,
extended backwards), and a match of m tokens may draft up to m tokens, past gamma, up to `reach`: a long match is
a long run being copied, and a block of 16 rows costs the target a few single steps, not 16 (the reach stops at
15 drafts: a verification of 16 rows is the longest that viasd's fused passes run, exactly as a single step).
Where the tail has no match of SEED tokens the drafter is prompt lookup as published (the last 1-2 tokens, up to
gamma).

A copy run: the source position the last copied draft came from (the copy pointer). The pointer advances over the
emitted tokens that follow the source; while they all do, the run goes on from there even where the tail has no
SEED match (a copy resumed from a short match). At the first emitted token that differs (an edit: a renamed word,
a paragraph joined on one line) the run waits at that source position for up to RESYNC_AFTER tokens, and a tail of
1-2 tokens found in the next RESYNC_WINDOW source tokens resumes it there: the word-boundary matches shorter than
the seed with which an edited copy goes on, which a hybrid would otherwise hand to its model. A run resumed so whose
first draft is wrong at once is over (new text, not the copy). Replaying the edit workload's recorded answers (13
tasks, the head taken to emit 2 tokens a round) counted the hybrid's rounds 315 before, 304 after (chat revisions
68 and 64, renames 72 and 67).

Cache invariant: an index maps every SEED-gram of a sequence to the positions where it ends, in order; the current
sequence's index covers its first `indexed` tokens and is extended as the context grows, rebuilt when the context
is not an extension of what it indexed (a new generation). Finished sequences go to a `SuffixStore`, bounded in
tokens, oldest dropped first, shared by the generations of one engine; it holds token ids only. Only greedy
generations draft from it: a seeded sampling request's text depends on its drafts, and must not depend on which
requests came before it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from viasd.drafters.base import Proposal
from viasd.drafters.prompt_lookup import lookup_continuation
from viasd.verify.sampling import SamplingParams

if TYPE_CHECKING:
    from viasd.passes.session import KVSession

SEED = 3  # tokens of the tail every candidate match starts from
LONGEST = 64  # the most tokens a match is extended backwards (longer ones are as good as long)
CANDIDATES = 32  # the latest occurrences of the seed tried per sequence
SHORT_MATCH = 2  # without a seed match: prompt lookup's 2- and 1-gram matches, up to gamma
RESYNC_WINDOW = 16  # source tokens after a copy run's break where a short tail match resumes it
RESYNC_AFTER = 16  # emitted tokens after a copy run's break past which it is over


@dataclass
class Index:
    """Where each SEED-gram of one token sequence ends: its positions, in order (the sequence's own copy kept)."""

    tokens: list[int] = field(default_factory=list)
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def extend(self, tokens: Sequence[int]) -> None:
        """Index `tokens` appended to the sequence."""
        start = len(self.tokens)
        self.tokens.extend(tokens)
        for end in range(max(start + 1, SEED), len(self.tokens) + 1):  # the ends not indexed before
            self.ends.setdefault(tuple(self.tokens[end - SEED : end]), []).append(end)

    def matches(self, tail: Sequence[int], before: int | None = None) -> list[tuple[int, int]]:
        """(match length, end) of the latest CANDIDATES occurrences of `tail`'s last SEED tokens ending before
        `before` (None: anywhere), each extended backwards against `tail` up to LONGEST tokens."""
        found = self.ends.get(tuple(tail[-SEED:]), [])
        out = []
        for end in reversed(found):
            if before is not None and end >= before:
                continue
            length = SEED
            while length < min(LONGEST, end, len(tail)) and self.tokens[end - length - 1] == tail[-length - 1]:
                length += 1
            out.append((length, end))
            if len(out) == CANDIDATES:
                break
        return out


def followed(source: Sequence[int], position: int, emitted: Sequence[int]) -> int:
    """How many of `emitted`'s leading tokens are `source`'s from `position` on (a copy run's accepted tokens)."""
    count = 0
    while count < len(emitted) and position + count < len(source) and source[position + count] == emitted[count]:
        count += 1
    return count


def resync(source: Sequence[int], position: int, tail: Sequence[int]) -> tuple[int, int] | None:
    """(match length, end) of the first occurrence of `tail`'s last SHORT_MATCH (else 1) tokens within
    `source[position : position + RESYNC_WINDOW]` that some token follows: where a copy run broken at `position` goes
    on; None where it is not found there."""
    stop = min(len(source) - 1, position + RESYNC_WINDOW)  # the last token in the window must have a successor
    for length in range(min(SHORT_MATCH, len(tail)), 0, -1):
        wanted = list(tail[-length:])
        for end in range(position + length, stop + 1):
            if list(source[end - length : end]) == wanted:
                return length, end
    return None


@dataclass
class CopyRun:
    """Where the last copied draft came from: `source[position]` is the token the copy expects after the first `seen`
    tokens of the context (after a break: the source token the edit replaced); `length`: the tokens matched or
    copied since the run began; `shared`: the source is another request's (greedy rounds only)."""

    source: list[int]
    position: int
    seen: int
    length: int
    shared: bool


def continue_run(run: CopyRun, context: Sequence[int]) -> tuple[CopyRun, tuple[int, int] | None] | None:
    """The run after `context` (an extension of the one it saw) and, where the copy goes on, (match length, source
    position of the next draft); None where the run is over: more than RESYNC_AFTER tokens since its break, or a
    run resumed from a short match broken at its first token. A pure function of its arguments: the drafter's
    proposals depend on the committed tokens only."""
    emitted = context[run.seen :]
    count = followed(run.source, run.position, emitted)
    position, seen = run.position + count, run.seen + count
    if count == len(emitted):  # every token since follows the source: the run goes on
        return CopyRun(run.source, position, seen, run.length + count, run.shared), (run.length + count, position)
    if len(context) - seen > RESYNC_AFTER or (count == 0 and 0 < run.length <= SHORT_MATCH):
        return None
    broken = CopyRun(run.source, position, seen, 0, run.shared)  # it waits at the source token an edit replaced
    found = resync(run.source, position, context[seen:])
    if found is None:
        return broken, None
    length, end = found
    return CopyRun(run.source, end, len(context), length, run.shared), (length, end)


class SuffixStore:
    """Finished generations' token sequences (prompt and answer), at most `tokens` tokens in all, oldest dropped
    first; shared by the drafters of one engine, across threads."""

    def __init__(self, tokens: int) -> None:
        self.capacity = tokens
        self._sequences: OrderedDict[int, Index] = OrderedDict()
        self._held = 0
        self._next = 0
        self.version = 0  # changes with every sequence kept: a drafter's last search is stale after it
        self._lock = threading.Lock()

    def add(self, tokens: Sequence[int]) -> None:
        """Keep a finished sequence (a longer one than the store holds is not kept)."""
        if self.capacity <= 0 or len(tokens) <= SEED or len(tokens) > self.capacity:
            return
        index = Index()
        index.extend(tokens)
        with self._lock:
            self._sequences[self._next] = index
            self._next += 1
            self.version += 1
            self._held += len(tokens)
            while self._held > self.capacity:
                _, dropped = self._sequences.popitem(last=False)
                self._held -= len(dropped.tokens)

    def clear(self) -> None:
        """Forget every kept sequence (the bench, after its warm-up generated the timed tasks' own answers)."""
        with self._lock:
            self._sequences.clear()
            self._held = 0
            self.version += 1

    def matches(self, tail: Sequence[int]) -> list[tuple[int, list[int], int]]:
        """(match length, the sequence, end) of the tail's matches in every kept sequence."""
        with self._lock:
            kept = list(self._sequences.values())
        return [(length, index.tokens, end) for index in kept for length, end in index.matches(tail)]

    @property
    def held(self) -> int:
        return self._held


class SuffixDrafter:
    """Copies from the longest match of the context's tail (see the module docstring); deterministic proposals.

    reach: the most tokens a long match may draft in a round (past gamma). store: finished sequences to match in as
    well (None: the current one alone). short: without a seed match, copy from prompt lookup's 1- and 2-gram matches
    (alone), or propose nothing (in a hybrid, whose model drafts then).
    """

    def __init__(
        self, reach: int = 15, store: SuffixStore | None = None, short: bool = True, name: str = "suffix"
    ) -> None:
        if reach < 1:
            raise ValueError("need reach >= 1")
        self.name = name
        self.short = short
        self.reach_most = reach
        self.store = store
        self.index = Index()
        self.epoch = 0  # which index `_best` was found in (a new one each time the index starts again)
        # The last search: (epoch, context length, store version) and what it found.
        self._best: tuple[tuple[int, int, int], tuple[int, list[int]]] | None = None
        self.run: CopyRun | None = None  # the copy run of this generation (module docstring)
        self.forward_passes = 0
        self.pass_seconds = 0.0

    @property
    def sessions(self) -> tuple[KVSession, ...]:
        """None: it runs no model."""
        return ()

    def describe(self) -> str:
        shared = f", {self.store.capacity} tokens of earlier requests" if self.store else ""
        return f"suffix ({SEED}-gram seeds, up to {self.reach_most} tokens a round{shared})"

    def follow(self, target: object) -> None:
        """It reads the tokens, not the target's passes."""

    def reset(self, prompt_length: int | None = None, budget: int | None = None) -> None:
        """A new generation: the one before it goes to the store."""
        if self.store is not None and len(self.index.tokens) > SEED:
            self.store.add(self.index.tokens)
        self.index, self.epoch, self.run = Index(), self.epoch + 1, None

    def _follow(self, context: Sequence[int]) -> None:
        """Index the context: extend the current index, or start again where the context is not its extension."""
        known = self.index.tokens
        if len(context) < len(known) or context[: len(known)] != known:
            self.index, self.epoch, self.run = Index(), self.epoch + 1, None
            known = self.index.tokens
        if len(context) > len(known):
            self.index.extend(context[len(known) :])

    def best(self, context: Sequence[int], shared: bool = True) -> tuple[int, list[int]]:
        """(match length, the tokens following the longest match), the current sequence first, then (`shared`) the
        store's; the latest wins a tie. Without a seed match, the copy run's next tokens where it goes on (its
        length: the tokens it copied, or its short match's), else (0, []). Asked twice a round (`reach`,
        `propose`): found once."""
        self._follow(context)
        store = self.store if shared else None
        key = (self.epoch, len(context), store.version if store is not None else -1)
        if self._best is not None and self._best[0] == key:
            return self._best[1]
        length, source, end, other = 0, self.index.tokens, 0, False
        for found, at in self.index.matches(context, before=len(context)):
            if found > length:
                length, end = found, at
        if store is not None:
            for found, tokens, at in store.matches(context):
                if found > length and at < len(tokens):
                    length, source, end, other = found, tokens, at, True
        if length:
            self.run = CopyRun(source, end, len(context), length, other)
        elif self.run is not None and (shared or not self.run.shared):
            self.run, found = continue_run(self.run, context) or (None, None)
            if self.run is not None and found is not None:
                (length, end), source = found, self.run.source
        following = list(source[end : end + LONGEST]) if length else []
        best = (length, following) if following else (0, [])
        self._best = (key, best)
        return best

    def reach(self, context: Sequence[int], params: SamplingParams) -> int:
        """How many tokens this round may draft past gamma: the match's length (a long run being copied), at most
        `reach` and what follows the match; 0 without a seed match."""
        length, following = self.best(context, params.greedy)
        return min(length, self.reach_most, len(following))

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator, stop: float = 0.0
    ) -> Proposal:
        """What followed the longest match, up to k tokens (and the match's length, where that is more than a short
        one's gamma); prompt lookup's short matches where there is none."""
        following = self.best(context, params.greedy)[1]
        if not following:
            copied = lookup_continuation(context, k, SHORT_MATCH, 1) if self.short else []
            return Proposal(copied, source=self.name)
        return Proposal(following[:k], source=self.name)
