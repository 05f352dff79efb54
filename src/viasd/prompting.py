"""Turning user text or chat messages into prompt token ids.

User text is data, never markup: a message that contains the text of a special token (`<|im_start|>`,
`<|endoftext|>`...) or of any other token the tokenizer adds by its text (Qwen2.5's `<tool_call>` and
`</tool_call>`, which are not marked special but are what the model reads as a tool call) is encoded as those
characters, so it cannot forge a turn of the chat template, a tool call, or end the prompt early. Only the template
itself produces such tokens. Prompts without such text are encoded exactly as the tokenizer's own chat template call
encodes them. Added tokens of whitespace only (some tokenizers add runs of spaces or newlines) are text, not markup,
and keep their tokens.

transformers' `split_special_tokens=True` is not enough for this: a fast tokenizer still matches the added tokens not
marked special, and the flag is a setting of the shared Rust tokenizer that each call changes (a race between
threads). So user text goes through the tokenizer's normalizer, pre-tokenizer and model directly, which match no
added token at all and change nothing shared.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from viasd.errors import UnsupportedParameter, ViasdError

# A chat message as the chat templates take it: role and content (text), and for tool use an assistant's
# `tool_calls` (arguments as objects, as Hugging Face templates expect them) or a tool result's `tool_call_id`.
Message = dict[str, Any]
ROLES = ("system", "user", "assistant", "tool")
# Arguments of transformers' apply_chat_template that a request's template variables must not set.
RESERVED_TEMPLATE_KEYS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


@dataclass(frozen=True)
class ChatTemplate:
    """How a conversation is rendered: open the assistant's turn (the default), or continue the last message, and
    extra variables for the template (e.g. enable_thinking)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: tuple[tuple[str, Any], ...] = ()
    tools: tuple[dict[str, Any], ...] = ()  # the functions offered to the model, as OpenAI's `tools` entries

    def arguments(self) -> dict[str, Any]:
        """apply_chat_template's keyword arguments for it."""
        return {
            **dict(self.variables),
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            **({"tools": list(self.tools)} if self.tools else {}),
        }


PLAIN_TEMPLATE = ChatTemplate()  # a new assistant turn, no extra variables


def special_token_texts(tokenizer: PreTrainedTokenizerBase) -> frozenset[str]:
    """The texts the tokenizer turns into tokens of their own instead of encoding them: its special tokens and its
    other added tokens, less those of whitespace only."""
    added = getattr(tokenizer, "added_tokens_decoder", {}).values()
    texts = {token.content for token in added if token.special or not token.content.isspace()}
    texts.update(tokenizer.all_special_tokens)
    return frozenset(text for text in texts if text)


def contains_special_text(tokenizer: PreTrainedTokenizerBase, text: str) -> bool:
    """Whether `text` holds the text of any special or other added token of `tokenizer` (`special_token_texts`)."""
    return any(special in text for special in special_token_texts(tokenizer))


def _plain_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of `text` as plain text: no added token, special or not, is matched in it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a Python tokenizer: there, split_special_tokens skips every added token, per call
        return _ids(tokenizer(text, add_special_tokens=False, split_special_tokens=True))
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    pieces = [text] if backend.pre_tokenizer is None else [p for p, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
    return [int(token.id) for piece in pieces for token in backend.model.tokenize(piece)]


def tokens_around(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text when asked to add its special tokens (e.g. BOS)."""
    plain = _ids(tokenizer("a", add_special_tokens=False))
    wrapped = _ids(tokenizer("a", add_special_tokens=True))
    for start in range(len(wrapped) - len(plain) + 1):
        if wrapped[start : start + len(plain)] == plain:
            return wrapped[:start], wrapped[start + len(plain) :]
    raise ViasdError("cannot tell where this tokenizer puts its special tokens around a text")


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of user text, with any special or added token's text in it encoded as plain characters.

    `add_special_tokens` adds what the tokenizer itself puts around a text (e.g. BOS), never from the text.
    """
    ids = _plain_ids(tokenizer, text)
    if not add_special_tokens:
        return ids
    before, after = tokens_around(tokenizer)
    return before + ids + after


def _ids(encoded: object) -> list[int]:
    if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]  # type: ignore[index]
    return [int(t) for t in encoded]  # type: ignore[attr-defined]


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], template: ChatTemplate) -> str:
    return str(_apply(tokenizer, messages, template, tokenize=False))


def _apply(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], template: ChatTemplate, tokenize: bool
) -> Any:
    """The tokenizer's chat template over `messages`; a template that fails on the request's options is refused."""
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=tokenize, **template.arguments())
    except ValueError as error:  # e.g. continue_final_message with a template that cannot continue
        if template == PLAIN_TEMPLATE:
            raise
        raise ViasdError(f"the chat template cannot render these messages with these options: {error}") from error


def _encode_template_safely(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], template: ChatTemplate
) -> list[int]:
    """The chat template's token ids with every message content encoded as plain text.

    The template is rendered once with a unique marker in place of each content, which shows where the
    contents go; the text between them is the template's own and keeps its special tokens. Rendering
    with the real contents must give the same text (a template that rewrites contents is refused).
    """
    tag = uuid.uuid4().hex
    # Empty contents are left as they are: templates skip them (an assistant turn that only calls tools).
    marked = [i for i, m in enumerate(messages) if m["content"]]
    markers = [f"VIASDCONTENT{tag}N{i}X" for i in marked]
    skeleton_messages = list(messages)
    for i, marker in zip(marked, markers, strict=True):
        skeleton_messages[i] = {**messages[i], "content": marker}
    skeleton = _render(tokenizer, skeleton_messages, template)
    pieces: list[str] = []
    rest = skeleton
    for marker in markers:
        before, found, rest = rest.partition(marker)
        if not found or marker in rest:
            raise ViasdError("this model's chat template cannot keep special-token text in a message as plain text")
        pieces.append(before)
    rendered = _render(tokenizer, messages, template)
    contents = [messages[i]["content"] for i in marked]
    if "".join(p + c for p, c in zip(pieces, contents, strict=True)) + rest != rendered:
        contents = [c.strip() for c in contents]  # templates that trim the contents
        if "".join(p + c for p, c in zip(pieces, contents, strict=True)) + rest != rendered:
            raise ViasdError("this model's chat template rewrites message text, so special-token text in it is refused")
    ids: list[int] = []
    for piece, content in zip(pieces, contents, strict=True):
        ids += _ids(tokenizer(piece, add_special_tokens=False))
        ids += encode_text(tokenizer, content)
    return ids + _ids(tokenizer(rest, add_special_tokens=False))


def encode_messages(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    chat: bool = True,
    template: ChatTemplate = PLAIN_TEMPLATE,
) -> list[int]:
    """Token ids of a conversation, with the model's chat template rendered as `template` says (by default with a
    generation prompt).

    Without a chat template (or with chat=False) the message contents are joined as plain text. Special
    tokens come only from the template (and the tokenizer's BOS), never from the messages' text.
    """
    if not messages or not any(m.get("content", "").strip() for m in messages):
        raise ViasdError("the prompt is empty")
    for m in messages:
        if m.get("role") not in ROLES:
            raise ViasdError(f"unknown message role {m.get('role')!r} (use {', '.join(ROLES)})")
    if chat and getattr(tokenizer, "chat_template", None):
        _check_tool_text(tokenizer, messages, template)
        if any(contains_special_text(tokenizer, m.get("content", "")) for m in messages):
            return _encode_template_safely(tokenizer, messages, template)
        return _ids(_apply(tokenizer, messages, template, tokenize=True))
    text = "\n\n".join(m["content"] for m in messages)
    return encode_text(tokenizer, text, add_special_tokens=True)


def _check_tool_text(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], template: ChatTemplate) -> None:
    """Refuses special-token text in what the template writes as it is (tool definitions, history's tool calls):
    unlike message contents, it cannot be kept as plain text, and could forge a turn or a call."""
    calls = [m["tool_calls"] for m in messages if m.get("tool_calls")]
    for param, name, value in (("tools", "tools", list(template.tools)), ("messages", "tool_calls", calls)):
        if value and contains_special_text(tokenizer, json.dumps(value, ensure_ascii=False)):
            message = f"{name} must not hold the text of the tokenizer's special or added tokens"
            raise UnsupportedParameter(param, message)


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str, chat: bool = True, system: str | None = None
) -> list[int]:
    """Token ids for a single user prompt (optionally with a system message)."""
    if not prompt.strip():
        raise ViasdError("the prompt is empty")
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return encode_messages(tokenizer, messages, chat=chat)
