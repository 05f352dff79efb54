"""Writing a target's training data with a time budget: conversations in shards, resumed after the last shard."""

from __future__ import annotations

import time
from collections.abc import Callable

from torch import nn
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

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
) -> int:
    """Add conversations to `folder` until it holds `tokens` tokens or `seconds` have passed; the tokens it holds."""
    held = folder.tokens()
    if held >= tokens or seconds <= 0:
        return held
    first = folder.conversations()
    functions = stdlib_functions()
    opener: Callable[[int], Opener] = lambda i: openers(1, seed * 7_919 + i, functions)[0]  # noqa: E731
    end = time.monotonic() + seconds
    bar = tqdm(total=tokens, initial=held, unit="tok", desc="writing data", disable=not progress, dynamic_ncols=True)
    pending: list[Written] = []
    try:
        conversations = write_conversations(
            model, tokenizer, view, opener, first, rows=rows, max_request=max_request, max_answer=max_answer, seed=seed
        )
        for written in conversations:
            pending.append(written)
            bar.update(len(written.tokens))
            if len(pending) == SHARD:
                folder.save(pending)
                held += sum(len(w.tokens) for w in pending)
                pending = []
                if held >= tokens or time.monotonic() >= end:
                    break
    finally:
        bar.close()
    return held
