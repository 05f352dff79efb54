"""The operators' endpoints /tokenize, /detokenize and /version, in the shapes vLLM's OpenAI server gives them.

/tokenize encodes a prompt as /v1/completions does, or chat messages as /v1/chat/completions does (the text of a
special token in them stays text), so that its count is the `usage.prompt_tokens` a request would report. Fields
vLLM accepts that would change the tokens here without being honoured (another chat template, tools, continuing
the last message) are refused, never ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.json_schema import SkipJsonSchema
from transformers import PreTrainedTokenizerBase

from viasd.prompting import encode_messages, encode_text
from viasd.serve.schemas import _SOME_TEXT, ChatMessage

# Exactly one of prompt and messages: published so that schema-driven clients send one (the handler says which).
_ONE_OF = {"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}
_NOT_HONOURED = {
    "continue_final_message": "continuing the last message is not supported (false or leave it out)",
    "chat_template": "only the model's own chat template is used (leave chat_template out)",
    "chat_template_kwargs": "chat template arguments are not supported (leave chat_template_kwargs out)",
    "tools": "tools are not supported (leave tools out)",
}


class TokenizeRequest(BaseModel):
    """A prompt (as /v1/completions takes it) or chat messages (as /v1/chat/completions does), not both."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=_ONE_OF)

    model: str | None = None
    # null is taken as left out, and published as not allowed: a client sends one of the two
    prompt: str | SkipJsonSchema[None] = Field(
        default=None, json_schema_extra={"pattern": r"\S"}, description="text to tokenize"
    )
    messages: list[ChatMessage] | SkipJsonSchema[None] = Field(
        default=None,
        json_schema_extra={**_SOME_TEXT, "minItems": 1},
        description="chat messages, with the chat template",
    )
    add_generation_prompt: bool = Field(default=True, description="messages: end with the assistant's turn opening")
    add_special_tokens: bool | None = Field(
        default=None,
        description="add the tokenizer's own special tokens (e.g. BOS); default true for a prompt, false for messages",
    )
    return_token_strs: bool = Field(default=False, description="also answer each token's string")
    continue_final_message: bool | None = Field(default=None, json_schema_extra={"enum": [False, None]})
    chat_template: str | None = Field(default=None, json_schema_extra={"enum": [None]})
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, json_schema_extra={"maxProperties": 0})
    tools: list[Any] | None = Field(default=None, json_schema_extra={"maxItems": 0})

    @field_validator("prompt")
    @classmethod
    def _some_text(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("the prompt is empty (or only whitespace): nothing to tokenize")
        return value

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, value: list[ChatMessage] | None) -> list[ChatMessage] | None:
        if value is not None and not value:
            raise ValueError("no messages: send at least one")
        return value

    @field_validator("continue_final_message", "chat_template", "chat_template_kwargs", "tools")
    @classmethod
    def _not_honoured(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(_NOT_HONOURED[info.field_name or ""])
        return value


class TokenizeResponse(BaseModel):
    count: int = Field(description="how many tokens")
    max_model_len: int = Field(description="the most tokens a sequence may hold: the model's context")
    tokens: list[int]
    token_strs: list[str] | None = Field(
        default=None, exclude_if=lambda value: value is None, description="only with return_token_strs"
    )


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int] = Field(json_schema_extra={"items": {"type": "integer", "minimum": 0}})


class DetokenizeResponse(BaseModel):
    prompt: str = Field(description="the text of the tokens, special tokens included")


class VersionInfo(BaseModel):
    version: str = Field(description="viasd's package version")


def tokenize(tokenizer: PreTrainedTokenizerBase, request: TokenizeRequest) -> list[int]:
    """The token ids of a request that has a prompt or messages (the caller checked that it has one)."""
    if request.prompt is not None:
        special = True if request.add_special_tokens is None else request.add_special_tokens
        return encode_text(tokenizer, request.prompt, add_special_tokens=special)
    messages = [m.as_prompt_message() for m in request.messages or []]
    return encode_messages(
        tokenizer,
        messages,
        generation_prompt=request.add_generation_prompt,
        add_special_tokens=bool(request.add_special_tokens),
    )


def token_strings(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    """Each token as the tokenizer spells it (byte-level pieces as they are, e.g. 'Ġthe')."""
    return [str(piece) for piece in tokenizer.convert_ids_to_tokens(ids)]


def detokenize(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """The text of token ids, special tokens included (as vLLM's /detokenize gives it)."""
    return str(tokenizer.decode(ids, skip_special_tokens=False))
