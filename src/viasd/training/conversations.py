"""Training data the target writes itself: a user's request, then its own answer, with its features at every step.

Each conversation starts from the chat template up to the user's turn and an opener (training/prompts.py); the
target samples the rest of the request (temperature 0.8, top-p 0.95), then answers it greedily, as it answers in a
benchmark. Many conversations are written at once: one ragged pass per step serves all of them (passes/loop.py),
and a finished conversation's place goes to a new one, so the passes stay full. Every step records the features
the output head read (passes/features.py): the training inputs of a draft head, from the passes that made the
tokens, so nothing is computed twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedTokenizerBase

from viasd.errors import ViasdError
from viasd.passes.facts import gather
from viasd.passes.features import head_inputs
from viasd.passes.loop import Segment, ragged_pass
from viasd.passes.route import Kind, Leg, decide
from viasd.passes.session import new_cache
from viasd.training.prompts import Opener
from viasd.verify.sampling import SamplingParams, draw, warp_probs
from viasd.views.view import View, applied

CHUNK = 32  # the most tokens of one conversation in a pass (a request's opening text goes in chunks)
REQUEST = SamplingParams(temperature=0.8, top_p=0.95)  # how the target writes the user's requests


@dataclass(frozen=True)
class Template:
    """The chat template around one user turn: ids before the request, and after it up to the answer."""

    before: list[int]
    after: list[int]
    stops: frozenset[int]  # ids that end a turn

    @staticmethod
    def of(tokenizer: PreTrainedTokenizerBase) -> Template:
        if not getattr(tokenizer, "chat_template", None):
            raise ViasdError("training a draft head needs a chat model: this tokenizer has no chat template")
        marker = "VIASDREQUESTMARK"
        text = str(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
            )
        )
        before, found, after = text.partition(marker)
        if not found:
            raise ViasdError("this model's chat template does not show where a user's message goes")
        encode = lambda part: [int(t) for t in tokenizer(part, add_special_tokens=False)["input_ids"]]  # noqa: E731
        after_ids = encode(after)
        stops = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
        if after_ids:
            stops.add(after_ids[0])  # the template's end-of-turn token (Qwen's <|im_end|>)
        return Template(encode(before), after_ids, frozenset(stops))


@dataclass
class Conversation:
    """One conversation being written: its tokens, the features computed so far (by position), where the answer
    starts, and the tokens not yet fed to the model."""

    index: int
    tokens: list[int]
    waiting: list[int]
    cache: DynamicCache
    answer_from: int = -1  # -1: still writing the request
    features: dict[int, torch.Tensor] = field(default_factory=dict)
    done: bool = False


@dataclass(frozen=True)
class Written:
    """A finished conversation: its tokens, the answer's first position, and feature rows by position."""

    index: int
    tokens: list[int]
    answer_from: int
    positions: list[int]
    features: torch.Tensor  # [len(positions), hidden]


def _start(index: int, opener: Opener, template: Template, tokenizer: PreTrainedTokenizerBase, model: nn.Module):
    text = [int(t) for t in tokenizer(opener.text, add_special_tokens=False)["input_ids"]]
    tokens = template.before + text
    conversation = Conversation(index, list(tokens), list(tokens), new_cache(model))
    if opener.complete:  # a whole request: the answer follows at once
        conversation.tokens += template.after
        conversation.waiting += template.after
        conversation.answer_from = len(conversation.tokens)
    return conversation


def write_conversations(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    view: View | None,
    openers: Callable[[int], Opener | None],
    first: int,
    rows: int = 24,
    max_request: int = 160,
    max_answer: int = 320,
    seed: int = 0,
    until: Callable[[], bool] | None = None,
) -> Iterator[Written]:
    """Conversations `first`, `first + 1`, ... written `rows` at a time (openers(i) starts conversation i), yielded
    as each finishes; the caller stops when it has enough, or the openers run out (None: no conversation i), or
    `until()` is true before a pass (the unfinished ones are dropped)."""
    template = Template.of(tokenizer)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + first)
    live: list[Conversation] = []
    for i in range(first, first + rows):
        opener = openers(i)
        if opener is not None:
            live.append(_start(i, opener, template, tokenizer, model))
    following = first + rows
    while live and not (until is not None and until()):
        parts = [(c, c.waiting[:CHUNK]) for c in live]
        logits, features = _step(model, view, parts)
        greedy = logits.argmax(dim=-1)
        # Only rows that finish their fed text while writing a request sample (a warped draw over the whole
        # vocabulary costs as much as the pass's attention): answers are greedy.
        asking = [row for row, (c, ids) in enumerate(parts) if c.answer_from < 0 and len(ids) == len(c.waiting)]
        drawn = draw(warp_probs(logits[asking], REQUEST), generator).tolist() if asking else []
        sampled = dict(zip(asking, drawn, strict=True))
        for row, (conversation, ids) in enumerate(parts):
            del conversation.waiting[: len(ids)]
            position = len(conversation.tokens) - len(conversation.waiting) - 1
            conversation.features[position] = features[row].to(torch.bfloat16).clone()
            if conversation.waiting:
                continue  # the rest of a long opening comes in the next pass
            answering = conversation.answer_from >= 0
            token = int(greedy[row]) if answering else sampled[row]
            _advance(conversation, token, template, max_request, max_answer)
        going: list[Conversation] = []
        for conversation in live:
            if not conversation.done:
                going.append(conversation)
                continue
            yield _written(conversation)
            opener = openers(following)
            following += 1
            if opener is not None:  # the finished one's place goes to a new one, in the same row
                going.append(_start(following - 1, opener, template, tokenizer, model))
        live = going


def _step(
    model: nn.Module, view: View | None, parts: list[tuple[Conversation, list[int]]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of every conversation in one ragged pass as `view`: the logits [rows, V] and features [rows, hidden]
    of each one's last fed position. Openings' chunks go through the view too: its kernels cost less than the model's
    own weights for blocks of any length on CPUs without bf16 instructions (benchmarks/README.md), and the head then
    learns from the features of the view it drafts for."""
    segments = [Segment(conversation.cache, torch.tensor(ids), 1) for conversation, ids in parts]
    leg = _leg(model, view, parts[0][0].cache, max(len(ids) for _, ids in parts))
    with torch.inference_mode(), applied(model, view), head_inputs(model, leg.features) as seen:
        out = ragged_pass(model, segments, leg.stack, leg.attention_kernel)
    return torch.stack([rows[-1].float() for rows in out]), seen[-1]


def _leg(model: nn.Module, view: View | None, cache: DynamicCache, tokens: int) -> Leg:
    """The route's leg for one conversation's part of a step (passes/route.py), as a batcher's segment of `CHUNK`
    tokens at most: every conversation's cache is a session's, so one leg runs them all. Every position is the view's
    (no own weights: the head learns from the features of the view it drafts for), and the head's features are kept."""
    facts = gather(model, cache, view, chunk=CHUNK, own_weights=False, features=True)
    route = decide(tokens, 1, facts)
    if route.kind is not Kind.BATCHED:
        raise ViasdError(
            "training writes its conversations in viasd's ragged passes, which do not run this model here "
            f"(its passes would take the {route.kind.value} route: a GPU, or a family viasd's loop does not cover)"
        )
    return route.legs[0]


def _advance(conversation: Conversation, token: int, template: Template, max_request: int, max_answer: int) -> None:
    """Append the token the model chose; end the request or the answer where the turn ends or its length runs out."""
    if conversation.answer_from >= 0:  # answering
        conversation.tokens.append(token)
        if token in template.stops or len(conversation.tokens) - conversation.answer_from >= max_answer:
            conversation.done = True
        else:
            conversation.waiting.append(token)
        return
    ends = token in template.stops  # the template's end-of-turn follows (its own tokens, not the one drawn)
    finished = ends or len(conversation.tokens) + 1 - len(template.before) >= max_request
    new = ([] if ends else [token]) + (template.after if finished else [])
    conversation.tokens += new
    conversation.waiting += new
    if finished:
        conversation.answer_from = len(conversation.tokens)


def _written(conversation: Conversation) -> Written:
    positions = sorted(conversation.features)
    return Written(
        conversation.index,
        conversation.tokens,
        conversation.answer_from,
        positions,
        torch.stack([conversation.features[p] for p in positions]),
    )
