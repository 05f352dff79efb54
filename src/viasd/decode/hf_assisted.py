"""Hugging Face transformers' own assisted generation, behind the Decoder interface: a reference baseline.

`target.generate(..., assistant_model=drafter)` runs the transformers implementation of speculative
decoding. Wrapping it as a Decoder gives it the same stop conditions, text handling and statistics as
the other methods. Forward hooks on both models count their forward passes and time them; the draft
counts are derived from those: in transformers' assisted generation every drafter forward pass proposes
one draft token and every target pass commits the accepted drafts plus one token of its own. A hook on
the target's inputs reads where each round starts, which gives the accepted drafts of every round.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig as HFGenerationConfig
from transformers import PreTrainedTokenizerBase, StoppingCriteria, StoppingCriteriaList

from viasd.decode.base import Decoder
from viasd.decode.output import OutputSink
from viasd.decode.stats import GenerationStats
from viasd.verify.sampling import SamplingParams


@dataclass
class _CallMeter:
    """Forward passes of one module and the wall-clock seconds spent in them."""

    calls: int = 0
    seconds: float = 0.0
    _started: float = 0.0

    def before(self, *_: Any) -> None:
        self._started = time.perf_counter()

    def after(self, *_: Any) -> None:
        self.calls += 1
        self.seconds += time.perf_counter() - self._started


@contextmanager
def metered(module: nn.Module) -> Iterator[_CallMeter]:
    """Count and time the forward passes of `module` while the block runs."""
    meter = _CallMeter()
    handles = [module.register_forward_pre_hook(meter.before), module.register_forward_hook(meter.after)]
    try:
        yield meter
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class _RoundLog:
    """Per target pass (one round of assisted generation): drafts proposed and committed length before it."""

    drafter: _CallMeter
    drafts: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    _drafter_seen: int = 0

    def before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("past_key_values")
        if cache is None:
            cache = kwargs.get("cache")
        cached = int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0
        drafts = self.drafter.calls - self._drafter_seen
        self._drafter_seen = self.drafter.calls
        self.drafts.append(drafts)
        # The pass reads the committed tokens the cache lacks, then the drafts.
        self.starts.append(cached + (int(ids.shape[-1]) if ids is not None else 0) - drafts)

    def rounds(self, final_length: int) -> list[tuple[int, int]]:
        """(drafted, accepted) per round; a round commits its accepted drafts plus one target token."""
        ends = [*self.starts[1:], final_length]
        rounds = zip(self.drafts, self.starts, ends, strict=True)
        return [(d, max(0, min(d, end - start - 1))) for d, start, end in rounds]


def draft_counts(rounds: Sequence[tuple[int, int]]) -> tuple[int, int, int]:
    """(drafted, evaluated, accepted) over rounds of (drafted, accepted).

    Drafts after the first rejected one in a round are cut off unchecked. The last round is taken as
    having no rejection: it may have been cut short by the token budget, EOS or a stop string instead.
    """
    drafted = sum(d for d, _ in rounds)
    accepted = sum(a for _, a in rounds)
    rejections = sum(1 for d, a in rounds[:-1] if a < d)
    return drafted, accepted + rejections, accepted


def hf_generation_config(
    params: SamplingParams,
    max_new_tokens: int,
    eos_ids: frozenset[int],
    pad_id: int | None,
) -> HFGenerationConfig:
    """A generation config set in full, so that no sampling default of the model's own config leaks in."""
    options: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens,
        do_sample=not params.greedy,
        # Greedy: transformers' defaults (it warns about sampling flags that differ from them).
        temperature=1.0 if params.greedy else params.temperature,
        top_p=1.0 if params.greedy else params.top_p,
        top_k=50 if params.greedy else params.top_k,  # 0 disables top-k, as in SamplingParams
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        num_beams=1,
        pad_token_id=pad_id,
        eos_token_id=sorted(eos_ids) if eos_ids else None,
    )
    if not eos_ids:  # no EOS stops this generation: keep generate from stopping at the model's own EOS
        options["min_new_tokens"] = max_new_tokens
    return HFGenerationConfig(**options)


class StopOnStrings(StoppingCriteria):
    """Stops the target's generation once its new text contains a stop string.

    transformers' own `stop_strings` option cannot be used here: in assisted generation it is handed on
    to the drafter's inner `generate`, which has no tokenizer and refuses it.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: Sequence[str], prompt_length: int) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        text = self.tokenizer.decode(input_ids[0, self.prompt_length :], skip_special_tokens=True)
        done = any(stop in text for stop in self.stops)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' advisory warnings for one call: its assisted path warns about its own internals."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


class HFAssistedDecoder(Decoder):
    """transformers' assisted generation with a small drafter model (exact in greedy decoding).

    gamma None keeps transformers' own draft policy (its default draft length, and a draft that stops
    early at a low-confidence token); a gamma fixes the draft length.
    """

    method = "hf-assisted"
    honours_penalties = False  # transformers' own logits processors differ from verify/penalties.py
    gives_logprobs = False  # its target passes are not viasd's: no logits to read them from

    def __init__(
        self,
        target: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        drafter: nn.Module,
        gamma: int | None = None,
        method: str | None = None,
    ) -> None:
        super().__init__(target, tokenizer)
        self.drafter = drafter
        self.gamma = gamma  # None keeps transformers' own draft policy
        if method:
            self.method = method

    @contextmanager
    def _draft_length(self) -> Iterator[None]:
        """transformers reads the draft policy from the drafter's generation config: fix it to gamma for one call.

        A fixed gamma also turns off transformers' early stop of a draft at a low-confidence token.
        """
        config = self.drafter.generation_config
        names = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
        saved = {name: getattr(config, name, None) for name in names}
        if self.gamma is not None:
            config.num_assistant_tokens = self.gamma
            config.num_assistant_tokens_schedule = "constant"
            config.assistant_confidence_threshold = 0.0
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(config, name, value)

    def _decode(self, prompt: list[int], sink: OutputSink, params: SamplingParams, stats: GenerationStats) -> None:
        eos = sink.stop.eos_token_ids
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = min(self.eos_ids) if self.eos_ids else 0
        config = hf_generation_config(params, sink.remaining, eos, pad)
        device = next(self.target.parameters()).device
        input_ids = torch.tensor([prompt], dtype=torch.long, device=device)
        extra: dict[str, Any] = {}
        if sink.stop.stop_strings:
            stop = StopOnStrings(self.tokenizer, sink.stop.stop_strings, len(prompt))
            extra["stopping_criteria"] = StoppingCriteriaList([stop])
        if params.seed is not None:
            torch.manual_seed(params.seed)  # transformers samples from the global generator
        with (
            metered(self.target) as target,
            metered(self.drafter) as drafter,
            self._draft_length(),
            quiet_transformers(),
        ):
            log = _RoundLog(drafter)
            hook = self.target.register_forward_pre_hook(log.before, with_kwargs=True)
            try:
                output = self.target.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    assistant_model=self.drafter,
                    generation_config=config,
                    **extra,
                )
            finally:
                hook.remove()
        sink.push(int(t) for t in output[0, len(prompt) :].tolist())
        stats.target_calls = target.calls
        stats.drafter_calls = drafter.calls
        stats.rounds = target.calls
        stats.verify_seconds = target.seconds
        stats.draft_seconds = drafter.seconds
        stats.drafted, stats.evaluated, stats.accepted = draft_counts(log.rounds(int(output.shape[-1])))
