"""`viasd chat`: a conversation whose KV entries are kept between turns, so that a turn reads only its new message.

Each turn encodes the whole conversation with the model's chat template, as a chat client would send it, and the
decoder's sessions start from copies of what the previous turn left in them (passes/prefix_cache.py: `copy_session`,
`resume_session`), cut at the longest prefix they share with the new prompt: the target then reads the template's
tokens that close the last answer, the new message and the tokens that open the next answer (and the previous
answer's last token, when that answer ran out of tokens: a decoder never reads its last token).

A turn answers as a fresh chat with the same history would. Kept entries were written by other passes than a fresh
read of the same tokens (the previous answer's decoding steps, the prompt's passes of another length), so they are
the same bits only where a pass's rows do not depend on how many rows it has: viasd's fused low-bit layers, which
the default target runs as its GGUF file stores it (`bit_exact_reuse`). There the conversation's new tokens are read
in passes of at most PACK_UP_TO tokens, the fused layers' own, so every position holds what it holds however the
turns cut the conversation (a long prompt's one pass, torch's attention, would round otherwise): a resumed turn's
entries, and so its text, are those of a fresh chat over the same history, bit for bit. Elsewhere (a dense bf16
copy, torch's products, a method without viasd's sessions) one line says so and each turn reads the whole
conversation again, as a fresh generation.

The conversation changes only when a turn ends: a turn stopped on the way (Ctrl-C, any exception) leaves the
history and the kept entries as they were (its partial answer is not kept), and the next turn starts from them.
When the conversation no longer fits the model's context with room for a whole answer, the oldest turns are
dropped (the system prompt stays), and one line says so; a message that does not fit even alone is refused in one
line and the conversation goes on.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from viasd.decode.base import Decoder, GenerationConfig, GenerationResult
from viasd.errors import ViasdError
from viasd.passes.prefix_cache import (
    SessionCopy,
    copy_session,
    exact_reuse,
    read_prompt,
    resumable_cut,
    resume_session,
)
from viasd.passes.session import KVSession
from viasd.prompting import Message

Encode = Callable[[Sequence[Message]], list[int]]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _distinct(sessions: Sequence[KVSession]) -> tuple[KVSession, ...]:
    return tuple({id(session): session for session in sessions}.values())


def bit_exact_reuse(decoder: Decoder) -> str | None:
    """None where kept KV entries are the bits a fresh read writes (passes/prefix_cache.py, `exact_reuse`); else why
    not, in words."""
    return exact_reuse(decoder.sessions(), f"method {decoder.method!r}")


@dataclass
class Turn:
    """One answered message: the result, the conversation's prompt this turn and how many of its tokens the target
    read (the rest came from the previous turns' kept entries), and how many old turns were dropped to fit."""

    result: GenerationResult
    prompt_tokens: int
    read: int
    dropped: int = 0

    @property
    def text(self) -> str:
        return self.result.text

    def summary(self) -> str:
        s = self.result.stats
        return (
            f"read {self.read} of {self.prompt_tokens} prompt tokens, {s.new_tokens} tokens in {s.total_seconds:.2f}s "
            f"({s.tokens_per_second:.2f} tok/s), finish: {s.finish_reason}"
        )


class Conversation:
    """A system prompt, the turns so far (user message, answer) and the KV entries the last turn left.

    `reuse`: keep KV entries between turns; None: where they are bit-exact (`bit_exact_reuse`), saying once where
    not. `context`: the tokens a prompt and its answer may take (None: the decoder's model's). `notice` takes the
    one-line messages (dropped turns, no reuse)."""

    def __init__(
        self,
        decoder: Decoder,
        encode: Encode,
        config: GenerationConfig | None = None,
        system: str | None = None,
        history: Sequence[tuple[str, str]] = (),
        reuse: bool | None = None,
        context: int | None = None,
        notice: Callable[[str], None] = _stderr,
    ) -> None:
        self.decoder = decoder
        self.encode = encode
        self.config = config or GenerationConfig()
        self.system = system
        self.turns: list[tuple[str, str]] = list(history)
        self.context = context if context is not None else decoder.context_limit
        self.notice = notice
        if reuse is None:
            why = bit_exact_reuse(decoder)
            reuse = why is None
            if why is not None:
                notice(f"chat: {why}: each turn reads the whole conversation again")
        self.reuse = reuse
        self._kept: tuple[SessionCopy | None, ...] | None = None

    def messages(self, user: str | None = None) -> list[Message]:
        """The conversation as chat messages (with `user` as a last message)."""
        out: list[Message] = [{"role": "system", "content": self.system}] if self.system else []
        for asked, answered in self.turns:
            out += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
        if user is not None:
            out.append({"role": "user", "content": user})
        return out

    def reset(self) -> None:
        """Forget the turns (the system prompt stays) and the kept entries."""
        self.turns = []
        self._kept = None

    def _fits(self, prompt: list[int]) -> bool:
        return self.context is None or len(prompt) + self.config.max_new_tokens <= self.context

    def say(self, text: str, on_text: Callable[[str], None] | None = None) -> Turn | None:
        """Answer `text` (None for an empty message: nothing is generated); the history and the kept entries change
        only when the answer is whole."""
        if not text.strip():
            return None
        turns = self.turns
        dropped = 0
        prompt = self.encode(self.messages(text))
        while not self._fits(prompt) and dropped < len(turns):
            dropped += 1
            self.turns = turns[dropped:]
            try:
                prompt = self.encode(self.messages(text))
            finally:
                self.turns = turns
        if not self._fits(prompt):
            raise ViasdError(
                f"the message makes a prompt of {len(prompt)} tokens (system prompt and template included): with "
                f"room for {self.config.max_new_tokens} new tokens it exceeds the model's context of {self.context} "
                "tokens; not sent"
            )
        if dropped:
            self.notice(
                f"chat: the conversation outgrew the model's context of {self.context} tokens (with room for "
                f"{self.config.max_new_tokens} new ones): dropped the oldest {dropped} of {len(turns)} turns"
            )
        kept, start = self._kept, [0]

        def resume(sessions: Sequence[KVSession], ids: Sequence[int]) -> None:
            start[0] = self._resume(_distinct(sessions), ids, kept)

        result = self.decoder.generate(prompt, self.config, on_text=on_text, resume=resume if self.reuse else None)
        copies = tuple(copy_session(session) for session in _distinct(self.decoder.sessions())) if self.reuse else ()
        # The turn is whole: only now do the history and the kept entries change, together.
        self.turns = [*turns[dropped:], (text, result.text)]
        self._kept = copies if copies and copies[0] is not None else None
        return Turn(result, len(prompt), len(prompt) - start[0], dropped)

    def _resume(
        self, sessions: tuple[KVSession, ...], prompt: Sequence[int], kept: tuple[SessionCopy | None, ...] | None
    ) -> int:
        """Start the decoder's sessions (just reset) from the kept entries, then read the target's part of the
        prompt up to its last REREAD tokens (which the decoder reads, for its logits) in passes of at most
        PACK_UP_TO tokens; returns how many prompt tokens the target started with."""
        if kept is not None and len(kept) == len(sessions):
            for session, copy in zip(sessions, kept, strict=True):
                if copy is None or copy.model is not session.model or copy.view != session.base_view:
                    continue
                cut = resumable_cut(copy, prompt)
                if cut:
                    resume_session(session, copy, cut)
        return read_prompt(sessions[0], prompt)
