"""Writing a target's training data with a time budget: conversations in shards, resumed after the last shard, one
writer per folder at a time (its lock), stopped by a signal at a whole conversation."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from torch import nn
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from viasd.stopping import StopRequest
from viasd.training.conversations import Written, write_conversations
from viasd.training.dataset import DataFolder
from viasd.training.prompts import Opener, openers, stdlib_functions
from viasd.views.view import View

SHARD = 16  # conversations per shard: what an interruption can lose at most


def write_data(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    view: View | None,
    folder: DataFolder,
    seconds: float,
    tokens: int,
    rows: int,
    seed: int,
    max_request: int = 64,
    max_answer: int = 256,
    progress: bool = True,
    source: Sequence[Opener] | None = None,
    stop: StopRequest | None = None,
) -> int:
    """Add conversations to `folder` until it holds `tokens` tokens, `seconds` have passed or `stop` is asked; the
    tokens it holds. The requests are the target's own (training/prompts.py `openers`), or `source`'s, each once, in
    order (a resume goes on from the number of conversations held: as they finish out of order, it may repeat or
    skip a few). It holds the folder's writer lock throughout; a stop keeps every finished conversation."""
    with folder.writing():
        return _write(model, tokenizer, view, folder, seconds, tokens, rows, seed, max_request, max_answer, progress,
                      source, stop)  # fmt: skip


def _write(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    view: View | None,
    folder: DataFolder,
    seconds: float,
    tokens: int,
    rows: int,
    seed: int,
    max_request: int,
    max_answer: int,
    progress: bool,
    source: Sequence[Opener] | None,
    stop: StopRequest | None,
) -> int:
    held = folder.tokens()
    if held >= tokens or seconds <= 0 or stop:
        return held
    first = folder.conversations()
    opener: Callable[[int], Opener | None]
    if source is None:
        functions = stdlib_functions()
        opener = lambda i: openers(1, seed * 7_919 + i, functions)[0]  # noqa: E731
    else:
        opener = lambda i: source[i] if i < len(source) else None  # noqa: E731
    end = time.monotonic() + seconds
    # Progress in tokens towards `tokens`, or for `source` in its requests.
    total, initial, unit = (tokens, held, "tok") if source is None else (len(source), first, "request")
    bar = tqdm(total=total, initial=initial, unit=unit, desc="writing data", disable=not progress, dynamic_ncols=True)
    pending: list[Written] = []
    try:
        conversations = write_conversations(
            model, tokenizer, view, opener, first, rows=rows, max_request=max_request, max_answer=max_answer,
            seed=seed, until=None if stop is None else stop.__bool__,
        )  # fmt: skip
        for written in conversations:
            pending.append(written)
            bar.update(len(written.tokens) if source is None else 1)
            if len(pending) == SHARD:
                folder.save(pending)
                held += sum(len(w.tokens) for w in pending)
                pending = []
                if held >= tokens or time.monotonic() >= end:
                    break
        else:  # the requests ran out, or a stop was asked: the last shard holds fewer
            if pending:
                folder.save(pending)
                held += sum(len(w.tokens) for w in pending)
    finally:
        bar.close()
    return held
