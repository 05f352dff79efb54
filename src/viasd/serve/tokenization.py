"""The operators' endpoints /tokenize, /detokenize and /version, in the shapes vLLM's OpenAI server gives them.

/tokenize encodes a prompt as /v1/completions does, or chat messages as /v1/chat/completions does (the text of a
special token in them stays text; vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs
render the template, and `tools` are offered to it), so that its count is the `usage.prompt_tokens` a request would
report. Fields that would change the tokens without being honoured (another chat template) and fields neither vLLM
nor OpenAI defines are refused, never ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.json_schema import SkipJsonSchema
from transformers import PreTrainedTokenizerBase

from viasd.prompting import RESERVED_TEMPLATE_KEYS, ChatTemplate, encode_messages, encode_text, tokens_around
from viasd.serve.schemas import _SOME_TEXT, ChatMessage, continued_turn, template_variables
from viasd.serve.tools import ToolSpec, distinct_tools

# Fields that shape the chat template: with a prompt they are refused (they would change nothing).
MESSAGES_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")
# Exactly one of prompt (without the template's fields) and messages (not both opening a turn and continuing the
# last): published so that schema-driven clients send what the handler takes.
_ONE_OF = {
    "oneOf": [
        {"required": ["prompt"], "not": {"anyOf": [{"required": [name]} for name in MESSAGES_ONLY]}},
        {
            "required": ["messages"],
            "not": {
                "required": ["add_generation_prompt", "continue_final_message"],
                "properties": {"add_generation_prompt": {"const": True}, "continue_final_message": {"const": True}},
            },
        },
    ]
}
_NOT_HONOURED = {
    "chat_template": "only the model's own chat template is used (leave chat_template out)",
    "mm_processor_kwargs": "this server takes text only (leave mm_processor_kwargs out)",
}


class TokenizeRequest(BaseModel):
    """A prompt (as /v1/completions takes it) or chat messages (as /v1/chat/completions does), not both."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_ONE_OF)

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
    add_generation_prompt: bool | None = Field(
        default=None, description="messages: end with the assistant's turn opening (default true)"
    )
    continue_final_message: bool | None = Field(
        default=None, description="messages: continue the last (assistant) message instead of a new turn"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra={"propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_KEYS)}}},
        description="messages: more variables for the chat template (e.g. enable_thinking)",
    )
    add_special_tokens: bool | None = Field(
        default=None,
        description="add the tokenizer's own special tokens (e.g. BOS); default true for a prompt, false for messages",
    )
    return_token_strs: bool = Field(default=False, description="also answer each token's string")
    chat_template: str | None = Field(default=None, json_schema_extra={"enum": [None]})
    tools: list[ToolSpec] | None = Field(
        default=None, min_length=1, description="messages: functions offered to the chat template, as chat completions"
    )
    mm_processor_kwargs: dict[str, Any] | None = Field(default=None, json_schema_extra={"maxProperties": 0})

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

    @field_validator("continue_final_message")
    @classmethod
    def _continue(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        return continued_turn(value, info.data.get("add_generation_prompt"))

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return template_variables(value)

    @field_validator("tools")
    @classmethod
    def _distinct_tools(cls, value: list[ToolSpec] | None) -> list[ToolSpec] | None:
        return distinct_tools(value)

    @field_validator("chat_template", "mm_processor_kwargs")
    @classmethod
    def _not_honoured(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(_NOT_HONOURED[info.field_name or ""])
        return value

    def template(self, tools: tuple[dict[str, Any], ...] = ()) -> ChatTemplate:
        """How the chat template renders the messages offering `tools`, as /v1/chat/completions renders them."""
        continued = bool(self.continue_final_message)
        opening = not continued if self.add_generation_prompt is None else self.add_generation_prompt
        variables = tuple(sorted((self.chat_template_kwargs or {}).items()))
        return ChatTemplate(
            add_generation_prompt=opening, continue_final_message=continued, variables=variables, tools=tools
        )


class TokenizeResponse(BaseModel):
    count: int = Field(description="how many tokens")
    max_model_len: int = Field(description="the most tokens a sequence may hold: the model's context")
    tokens: list[int]
    token_strs: list[str] | None = Field(
        default=None, exclude_if=lambda value: value is None, description="only with return_token_strs"
    )


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int] = Field(json_schema_extra={"items": {"type": "integer", "minimum": 0}})


class DetokenizeResponse(BaseModel):
    prompt: str = Field(description="the text of the tokens, special tokens included")


class VersionInfo(BaseModel):
    version: str = Field(description="viasd's package version")


def tokenize(
    tokenizer: PreTrainedTokenizerBase, request: TokenizeRequest, tools: tuple[dict[str, Any], ...] = ()
) -> list[int]:
    """The token ids of a request that has a prompt or messages (the caller checked that it has one), offering `tools`
    to the chat template."""
    if request.prompt is not None:
        special = True if request.add_special_tokens is None else request.add_special_tokens
        return encode_text(tokenizer, request.prompt, add_special_tokens=special)
    messages = [m.as_prompt_message() for m in request.messages or []]
    ids = encode_messages(tokenizer, messages, template=request.template(tools))
    if not request.add_special_tokens or not getattr(tokenizer, "chat_template", None):
        return ids  # text joined without a template already has the tokenizer's own, as the chat endpoint sends it
    before, after = tokens_around(tokenizer)  # vLLM's option: the tokenizer's own around the template's
    return before + ids + after


def token_strings(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    """Each token as the tokenizer spells it (byte-level pieces as they are, e.g. 'Ġthe')."""
    return [str(piece) for piece in tokenizer.convert_ids_to_tokens(ids)]


def detokenize(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """The text of token ids, special tokens included (as vLLM's /detokenize gives it)."""
    return str(tokenizer.decode(ids, skip_special_tokens=False))
