"""Committed output: applies the stop conditions token by token and streams text."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from viasd.decode.logprobs import TokenLogprob, token_logprobs, unchecked


@dataclass
class StopConditions:
    """When a generation ends: EOS tokens, stop tokens, stop strings, or the token budget.

    min_tokens: stop strings count only from then on (ending tokens are banned before, verify/penalties.py).
    include_stop: the stop string or stop token that ended the output stays in it. skip_special_tokens: special
    tokens are left out of the text.
    """

    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    include_stop: bool = False
    skip_special_tokens: bool = True


@dataclass
class OutputSink:
    """Takes tokens in commit order and decides, for every method alike, where the output ends.

    Every decoding method pushes its committed tokens here one round at a time, so the same token
    stream always yields the same output and finish reason, whatever the round boundaries. With `logprob_top`
    set (not None), each taken token's log-probability is recorded from the target logits pushed with it
    (decode/logprobs.py) and handed to `on_logprobs` before the text it makes.
    """

    tokenizer: PreTrainedTokenizerBase
    stop: StopConditions
    on_text: Callable[[str], None] | None = None
    logprob_top: int | None = None  # None: no log-probabilities recorded (nothing computed)
    on_logprobs: Callable[[list[TokenLogprob]], None] | None = None
    first_token_time: float | None = None  # time.perf_counter() when the first token (EOS too) came in
    first_tokens: int = 0  # tokens taken with the first push (a speculative first round may commit several)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when logprob_top is set
    finish_reason: str | None = None
    _emitted: int = 0
    _text: str = ""
    _stops_from: int | None = None  # where stop strings may start in the text (None: min_tokens not reached yet)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.stop.max_new_tokens - len(self.tokens)

    @property
    def text(self) -> str:
        return self._text

    def push(self, new_tokens: Iterable[int], logits: torch.Tensor | None = None) -> int:
        """Commit tokens until a stop condition fires; returns how many were taken.

        logits: the full target's raw logits of the pass that checked them, row i for the i-th token (None: the
        full target did not check them); read only when log-probabilities are recorded.
        """
        new_tokens = list(new_tokens)
        taken = 0
        first = self.first_token_time is None and not self.done
        if first:
            self.first_token_time = time.perf_counter()  # pushed by the first round that produced tokens
        for token in new_tokens:
            if self.done:
                break
            if token in self.stop.stop_token_ids:
                self.finish_reason = "stop"
                if self.stop.include_stop:
                    self.tokens.append(token)
                    taken += 1
                break
            if token in self.stop.eos_token_ids:
                self.finish_reason = "eos"
                break
            self.tokens.append(token)
            taken += 1
            if len(self.tokens) >= self.stop.max_new_tokens:
                self.finish_reason = "length"
        if first:
            self.first_tokens = taken
        if self.logprob_top is not None and taken:
            kept = new_tokens[:taken]  # the tokens taken are always the first ones pushed
            entries = unchecked(kept) if logits is None else token_logprobs(logits, kept, self.logprob_top)
            self.logprobs.extend(entries)
            if self.on_logprobs is not None:
                self.on_logprobs(entries)
        self._update_text()
        return taken

    def _update_text(self) -> None:
        skip = self.stop.skip_special_tokens
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=skip)
        if self._stops_from is None and len(self.tokens) >= self.stop.min_tokens:
            # A stop string counts once it ends in token min_tokens or later (none before min_tokens tokens).
            before = self.tokens[: max(self.stop.min_tokens - 1, 0)]
            self._stops_from = len(self.tokenizer.decode(before, skip_special_tokens=skip)) if before else 0
        found = [
            (cut, len(s))
            for s in self.stop.stop_strings
            if self._stops_from is not None and (cut := text.find(s, max(self._stops_from - len(s) + 1, 0))) >= 0
        ]
        if found:
            cut, length = min(found)
            text = text[: cut + length] if self.stop.include_stop else text[:cut]
            self.finish_reason = "stop"
        self._text = text
        if self.on_text is None:
            return
        # Hold back text that may still become a stop string, or an incomplete UTF-8 character.
        end = len(text)
        if not self.done:
            hold = max((len(s) - 1 for s in self.stop.stop_strings), default=0)
            end = max(self._emitted, end - hold)
            while end > self._emitted and text[end - 1] == "\ufffd":
                end -= 1
        if end > self._emitted:
            self.on_text(text[self._emitted : end])
            self._emitted = end
