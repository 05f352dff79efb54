"""The decoder interface shared by every method, and what a generation returns."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from viasd.decode.logprobs import TokenLogprob, token_logprobs, unchecked
from viasd.decode.output import OutputSink, StopConditions
from viasd.decode.stats import GenerationStats
from viasd.errors import UnsupportedParameter, ViasdError
from viasd.verify.sampling import SamplingParams
from viasd.views.view import View

if TYPE_CHECKING:
    from viasd.passes.session import KVSession


@dataclass
class GenerationConfig:
    """What to generate: budget, sampling, extra stop strings and stop tokens, and how the text is written.

    stop_token_ids end the generation like EOS (even with ignore_eos). include_stop_str_in_output keeps the stop
    string (or stop token) that ended it in the output; skip_special_tokens leaves special tokens out of the text.
    logprobs: record each output token's target log-probability and this many alternatives (None: none, nothing
    computed); prompt_logprobs: the prompt's too (it needs logprobs; max_new_tokens may then be 0: scoring only).
    """

    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < (0 if self.prompt_logprobs else 1):
            raise ViasdError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ViasdError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs and self.logprobs is None:
            raise ViasdError("prompt_logprobs needs logprobs")
        if self.sampling.penalties.min_tokens > self.max_new_tokens:
            raise ViasdError(
                f"min_tokens ({self.sampling.penalties.min_tokens}) must not exceed max_new_tokens "
                f"({self.max_new_tokens})"
            )
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ViasdError(f"stop token ids must be integers >= 0, got {list(self.stop_token_ids)}")


@dataclass
class GenerationResult:
    """Generated tokens (EOS excluded), their text (cut at a stop string) and the statistics."""

    tokens: list[int]
    text: str
    stats: GenerationStats
    first_token_seconds: float | None = None  # from the start of decoding to the first token committed (EOS too)
    logprobs: list[TokenLogprob] | None = None  # one per token, when asked for (GenerationConfig.logprobs)
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token, the first without a number

    @property
    def finish_reason(self) -> str:
        return self.stats.finish_reason


def eos_token_ids(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every token id that ends a generation for this model (generation config and tokenizer)."""
    ids: set[int] = set()
    gen_cfg = getattr(model, "generation_config", None)
    for value in (getattr(gen_cfg, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def context_limit(model: nn.Module) -> int | None:
    """Maximum sequence length the model supports, when its config says."""
    config = getattr(model, "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if value else None


def decision_generator(params: SamplingParams, device: torch.device) -> torch.Generator:
    """The random generator of a generation's token decisions: on the model's device when they are made there
    (`SamplingParams.on_device`), else on the CPU."""
    return params.generator(device if params.on_device(device) else "cpu")


# Starts a decoder's sessions (target first), just reset, from kept entries of the prompt's leading tokens.
Resume = Callable[[Sequence["KVSession"], Sequence[int]], object]


class Decoder(ABC):
    """One decoding method over a target model, run as `view` (None: as it is; a quantized view makes a
    faster, different model). Subclasses implement `_decode`."""

    method: str = "decoder"
    # Whether the method applies min_p and the penalties (verify/penalties.py); those that cannot refuse them.
    honours_penalties: bool = True
    # Whether it can report the target's log-probabilities (its passes are viasd's); those that cannot refuse them.
    gives_logprobs: bool = True

    def __init__(self, target: nn.Module, tokenizer: PreTrainedTokenizerBase, view: View | None = None) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.view = view
        self.eos_ids = eos_token_ids(target, tokenizer)
        self.context_limit = context_limit(target)

    def generate(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig | None = None,
        on_text: Callable[[str], None] | None = None,
        resume: Resume | None = None,
        on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
    ) -> GenerationResult:
        """Generate a continuation of `prompt_ids`; `on_text` receives the text as it is committed (`on_logprobs` the
        log-probabilities of its tokens just before, when asked for). `resume` may start the decoder's sessions, once
        reset, from kept entries of the prompt's leading tokens (a prefix cache's)."""
        config = config or GenerationConfig()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ViasdError("the prompt is empty")
        budget = config.max_new_tokens
        if self.context_limit is not None:
            if len(prompt) >= self.context_limit:
                raise ViasdError(f"the prompt has {len(prompt)} tokens; the model's context holds {self.context_limit}")
            budget = min(budget, self.context_limit - len(prompt))
        if not self.honours_penalties and (name := config.sampling.first_set()) is not None:
            raise UnsupportedParameter(name, f"method {self.method!r} cannot honour {name}; leave it out")
        if not self.gives_logprobs and config.logprobs is not None:
            message = f"method {self.method!r} cannot report the target's log-probabilities; leave logprobs out"
            raise UnsupportedParameter("logprobs", message)
        stop = StopConditions(
            max_new_tokens=budget,
            eos_token_ids=frozenset() if config.ignore_eos else self.eos_ids,
            stop_strings=tuple(config.stop_strings),
            stop_token_ids=frozenset(config.stop_token_ids),
            min_tokens=config.sampling.penalties.min_tokens,
            include_stop=config.include_stop_str_in_output,
            skip_special_tokens=config.skip_special_tokens,
        )
        sink = OutputSink(self.tokenizer, stop, on_text, logprob_top=config.logprobs, on_logprobs=on_logprobs)
        stats = GenerationStats(method=self.method, prompt_tokens=len(prompt))
        # The penalties learn where the output starts and which tokens min_tokens bans: every token that ends it;
        # a grammar alike (where it lets them end the output), with a matcher of this generation's own.
        ends = stop.eos_token_ids | stop.stop_token_ids
        grammar = config.sampling.grammar
        bound = config.sampling.penalties.bound(len(prompt), ends)
        params = replace(config.sampling, penalties=bound, grammar=grammar and grammar.bound(len(prompt), ends))
        sessions = {id(session): session for session in self.sessions()}.values()  # each once
        before = [dict(session.routes) for session in sessions]
        start = time.perf_counter()
        self.reset(len(prompt), budget)
        if resume is not None:
            resume(self.sessions(), prompt)
        scored = self._score_prompt(prompt, config.logprobs or 0) if config.prompt_logprobs else None
        if budget:
            self._decode(prompt, sink, params, stats)
        stats.total_seconds = time.perf_counter() - start
        for session, counted in zip(sessions, before, strict=True):
            for route, count in session.routes.items():
                if count > counted.get(route, 0):
                    stats.routes[route] = stats.routes.get(route, 0) + count - counted.get(route, 0)
        stats.new_tokens = len(sink.tokens)
        stats.finish_reason = sink.finish_reason or "length"
        first = None if sink.first_token_time is None else sink.first_token_time - start
        stats.first_token_seconds = stats.total_seconds if first is None else first
        stats.first_tokens = sink.first_tokens
        logprobs = None if config.logprobs is None else list(sink.logprobs)
        return GenerationResult(list(sink.tokens), sink.text, stats, first, logprobs, scored)

    def _score_prompt(self, prompt: list[int], top: int) -> list[TokenLogprob]:
        """Every prompt token's log-probability under the target given the tokens before it (the first has none),
        from one pass of the target's session over the whole prompt (its logits at every position: only when asked).
        The decoding that follows re-reads just the last prompt token."""
        session = self.sessions()[0]  # the target's, as this method runs it
        logits = session.extend_to(prompt, keep=len(prompt))
        return [*unchecked(prompt[:1]), *token_logprobs(logits[:-1], prompt[1:], top)]

    def describe(self) -> dict[str, Any]:
        """What runs: the target's view (and, in subclasses, the drafter, slim views, profile), for statistics and
        run records."""
        return {"target_view": self.view.describe() if self.view is not None else "as loaded"}

    def sessions(self) -> tuple[KVSession, ...]:
        """The KV sessions this decoder's model passes run on (target, drafter): their passes are counted by route
        in each generation's statistics. None for decoders that run no pass of viasd's."""
        return ()

    def reset(self, prompt_length: int, budget: int) -> None:
        """Start a new generation of at most `budget` tokens after a prompt of `prompt_length`: every session empty
        (subclasses tell their drafter too)."""
        for session in self.sessions():
            session.reset()

    @abstractmethod
    def _decode(self, prompt: list[int], sink: OutputSink, params: SamplingParams, stats: GenerationStats) -> None:
        """Push committed tokens into `sink` until it is done, filling in `stats`."""
