"""Turning user text or chat messages into prompt token ids."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from viasd.errors import ViasdError

Message = dict[str, str]


def encode_messages(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], chat: bool = True) -> list[int]:
    """Token ids of a conversation, with the model's chat template and a generation prompt.

    Without a chat template (or with chat=False) the message contents are joined as plain text.
    """
    if not messages or not any(m.get("content", "").strip() for m in messages):
        raise ViasdError("the prompt is empty")
    for m in messages:
        if m.get("role") not in {"system", "user", "assistant"}:
            raise ViasdError(f"unknown message role {m.get('role')!r} (use system, user or assistant)")
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    text = "\n\n".join(m["content"] for m in messages)
    return [int(t) for t in tokenizer(text, add_special_tokens=True)["input_ids"]]


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str, chat: bool = True, system: str | None = None
) -> list[int]:
    """Token ids for a single user prompt (optionally with a system message)."""
    if not prompt.strip():
        raise ViasdError("the prompt is empty")
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return encode_messages(tokenizer, messages, chat=chat)
