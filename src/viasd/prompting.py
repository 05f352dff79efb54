"""Turning user text or chat messages into prompt token ids.

User text is data, never markup: a message that contains the text of a special token (`<|im_start|>`,
`<|endoftext|>`...) is encoded as those characters, so it cannot forge a turn of the chat template or end
the prompt early. Only the template itself produces special tokens. Prompts without such text are encoded
exactly as the tokenizer's own chat template call encodes them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from viasd.errors import ViasdError

Message = dict[str, str]


def special_token_texts(tokenizer: PreTrainedTokenizerBase) -> frozenset[str]:
    """The texts the tokenizer turns into special tokens (those `split_special_tokens` keeps as plain text)."""
    texts = {token.content for token in getattr(tokenizer, "added_tokens_decoder", {}).values() if token.special}
    texts.update(tokenizer.all_special_tokens)
    return frozenset(text for text in texts if text)


def contains_special_text(tokenizer: PreTrainedTokenizerBase, text: str) -> bool:
    """Whether `text` holds the text of any special token of `tokenizer`."""
    return any(special in text for special in special_token_texts(tokenizer))


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of user text, with any special-token text in it encoded as plain characters.

    `add_special_tokens` adds what the tokenizer itself puts around a text (e.g. BOS), never from the text.
    """
    ids = tokenizer(text, add_special_tokens=add_special_tokens, split_special_tokens=True)["input_ids"]
    return [int(t) for t in ids]


def _ids(encoded: object) -> list[int]:
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]  # type: ignore[index]
    return [int(t) for t in encoded]  # type: ignore[attr-defined]


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> str:
    return str(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False))


def _encode_template_safely(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> list[int]:
    """The chat template's token ids with every message content encoded as plain text.

    The template is rendered once with a unique marker in place of each content, which shows where the
    contents go; the text between them is the template's own and keeps its special tokens. Rendering
    with the real contents must give the same text (a template that rewrites contents is refused).
    """
    tag = uuid.uuid4().hex
    markers = [f"VIASDCONTENT{tag}N{i}X" for i in range(len(messages))]
    skeleton = _render(tokenizer, [{**m, "content": marker} for m, marker in zip(messages, markers, strict=True)])
    pieces: list[str] = []
    rest = skeleton
    for marker in markers:
        before, found, rest = rest.partition(marker)
        if not found or marker in rest:
            raise ViasdError("this model's chat template cannot keep special-token text in a message as plain text")
        pieces.append(before)
    rendered = _render(tokenizer, messages)
    contents = [m["content"] for m in messages]
    if "".join(p + c for p, c in zip(pieces, contents, strict=True)) + rest != rendered:
        contents = [c.strip() for c in contents]  # templates that trim the contents
        if "".join(p + c for p, c in zip(pieces, contents, strict=True)) + rest != rendered:
            raise ViasdError("this model's chat template rewrites message text, so special-token text in it is refused")
    ids: list[int] = []
    for piece, content in zip(pieces, contents, strict=True):
        ids += _ids(tokenizer(piece, add_special_tokens=False))
        ids += encode_text(tokenizer, content)
    return ids + _ids(tokenizer(rest, add_special_tokens=False))


def encode_messages(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], chat: bool = True) -> list[int]:
    """Token ids of a conversation, with the model's chat template and a generation prompt.

    Without a chat template (or with chat=False) the message contents are joined as plain text. Special
    tokens come only from the template (and the tokenizer's BOS), never from the messages' text.
    """
    if not messages or not any(m.get("content", "").strip() for m in messages):
        raise ViasdError("the prompt is empty")
    for m in messages:
        if m.get("role") not in {"system", "user", "assistant"}:
            raise ViasdError(f"unknown message role {m.get('role')!r} (use system, user or assistant)")
    if chat and getattr(tokenizer, "chat_template", None):
        if any(contains_special_text(tokenizer, m.get("content", "")) for m in messages):
            return _encode_template_safely(tokenizer, messages)
        return _ids(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True))
    text = "\n\n".join(m["content"] for m in messages)
    return encode_text(tokenizer, text, add_special_tokens=True)


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str, chat: bool = True, system: str | None = None
) -> list[int]:
    """Token ids for a single user prompt (optionally with a system message)."""
    if not prompt.strip():
        raise ViasdError("the prompt is empty")
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return encode_messages(tokenizer, messages, chat=chat)
