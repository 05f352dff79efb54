"""Log-probabilities in OpenAI's response shapes: chat completions' `logprobs.content` entries and text completions'
parallel lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), from decode/logprobs.py's entries.

A token the full target never checked (via's relaxed tiers) has a null logprob and no alternatives, and is named
in the extension field `unchecked`: no number is made up for it. The first prompt token of an echo has none either
(nothing comes before it), as in OpenAI's and vLLM's answers.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from viasd.decode.logprobs import TokenLogprob
from viasd.serve.schemas import ChatLogprobs, CompletionLogprobs, TokenLogprobOut, TopLogprob


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte in a byte-level BPE vocabulary
    (printable Latin-1 bytes stand for themselves, the others are shifted past 255 in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


class TokenText:
    """Each token's text and UTF-8 bytes as OpenAI reports them, memoised for one response. A byte-level token that
    holds part of a character has its true bytes (its text shows the replacement character), so that clients can
    join the bytes of consecutive tokens back into the text."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._seen: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        if token not in self._seen:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            self._seen[token] = (text, list(self._raw_bytes(token, text) or text.encode("utf-8")))
        return self._seen[token]

    def _raw_bytes(self, token: int, text: str) -> bytes | None:
        """The token's bytes when the vocabulary is byte-level and its piece spells them (checked against the text
        the tokenizer decodes, so that other vocabularies fall back to the text's UTF-8)."""
        piece = self.tokenizer.convert_ids_to_tokens(token)
        table = _byte_level_table()
        if not isinstance(piece, str) or not piece or any(c not in table for c in piece):
            return None
        raw = bytes(table[c] for c in piece)
        return raw if raw.decode("utf-8", errors="replace") == text else None


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenText) -> ChatLogprobs:
    """Chat completions' `logprobs` object for these tokens."""
    return ChatLogprobs(content=[_chat_entry(entry, text) for entry in entries])


def _chat_entry(entry: TokenLogprob, text: TokenText) -> TokenLogprobOut:
    token, raw = text(entry.token)
    top = [TopLogprob(token=text(t)[0], logprob=logprob, bytes=text(t)[1]) for t, logprob in entry.top]
    return TokenLogprobOut(
        token=token,
        logprob=entry.logprob,
        bytes=raw,
        top_logprobs=top,
        unchecked=True if entry.logprob is None else None,
    )


def completion_logprobs(
    entries: Sequence[TokenLogprob], text: TokenText, offsets: Sequence[int], first_unscored: int = 0
) -> CompletionLogprobs:
    """Text completions' `logprobs` object for these tokens, `offsets` their starts in the choice's text. Each
    `top_logprobs` maps the top tokens' texts and the token's own (as vLLM does) to their log-probabilities.
    first_unscored: how many leading entries have no number because nothing came before them (an echoed prompt's
    first token), which `unchecked` does not name."""
    tokens: list[str] = []
    numbers: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    unchecked: list[int] = []
    for i, entry in enumerate(entries):
        token = text(entry.token)[0]
        tokens.append(token)
        numbers.append(entry.logprob)
        if entry.logprob is None:
            tops.append(None)
            if i >= first_unscored:
                unchecked.append(i)
            continue
        top = {text(alternative)[0]: logprob for alternative, logprob in entry.top}
        top.setdefault(token, entry.logprob)
        tops.append(top)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=numbers,
        top_logprobs=tops,
        text_offset=list(offsets),
        unchecked=unchecked or None,
    )


def text_offsets(
    tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], skip_special_tokens: bool, start: int = 0
) -> list[int]:
    """Where each token of ids[start:] has its own text in the text of all of them: where the text grown by that token
    ends, less the token's text (a space the decoder puts between words is not the token's), never before the text so
    far. `start` lets a stream ask for its new tokens only."""
    offsets = []
    before = len(tokenizer.decode(list(ids[:start]), skip_special_tokens=skip_special_tokens)) if start else 0
    for i in range(start, len(ids)):
        end = len(tokenizer.decode(list(ids[: i + 1]), skip_special_tokens=skip_special_tokens))
        own = len(tokenizer.decode([ids[i]], skip_special_tokens=skip_special_tokens))
        offsets.append(max(before, end - own))
        before = end
    return offsets
