"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Every parameter of OpenAI's API is declared with OpenAI's type, checked strictly as OpenAI checks it (`true` is
not 1, `"8"` is not 8, `8.0` is not an integer), and is either honoured or refused with a message that names it
(n > 1, logprobs, functions, audio, predicted outputs...): a silently ignored parameter would give the client wrong
output. So are the extensions of vLLM's OpenAI server that clients send (min_p, repetition_penalty, min_tokens,
stop_token_ids, guided decoding, beam search...; `_VLLM_REFUSED` lists those refused). A field neither API defines
is refused too, as OpenAI refuses it (vLLM ignores it): a misspelt parameter would otherwise be dropped unseen.
viasd's own extensions: `method`, and `usage.speculative` in responses.

`logprobs` has OpenAI's type on each endpoint, checked strictly so that the validation and the published schema
accept the same values: a boolean in chat completions (`0` is refused, as OpenAI refuses it; `top_logprobs` 0..20
needs it true), an integer 0..5 in the legacy text completions (`false` is refused). The numbers are the target's
(decode/logprobs.py), shaped as OpenAI's by serve/logprobs.py.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from viasd.prompting import RESERVED_TEMPLATE_KEYS, ChatTemplate
from viasd.serve.response_format import FORMAT_TYPES, format_check
from viasd.serve.tools import MessageToolCall, ToolCallOut, ToolSpec, checked_tool_choice, distinct_tools
from viasd.verify.sampling import SEED_MAX, SEED_MIN

MAX_STOP_STRINGS = 16
_TOKEN_ID = re.compile(r"[0-9]+")  # a logit_bias key: a token id written as a decimal string
# Published in the schema for fields that are accepted only at their neutral value; the validators below
# enforce them with messages that say why.
_ONLY_FALSE: dict[str, Any] = {"enum": [False, None], "description": "not supported: false or leave it out"}
_LEAVE_OUT: dict[str, Any] = {"enum": [None], "description": "not supported: leave it out"}
_NO_TOOL: dict[str, Any] = {"enum": ["none", "auto", None], "description": "none, auto or leave it out"}
_NAMED_FUNCTION = {
    "type": "object",
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
            "additionalProperties": False,
        },
    },
    "required": ["type", "function"],
    "additionalProperties": False,
}
_TOOL_CHOICE: dict[str, Any] = {"anyOf": [{"enum": ["none", "auto", "required", None]}, _NAMED_FUNCTION]}
_EMPTY: dict[str, Any] = {"maxItems": 0, "maxProperties": 0}
_TEXT = {"type": "string", "pattern": r"\S"}  # not empty or blank: an empty prompt is refused
_PROMPT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        _TEXT,
        {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
    ]
}


def _shown(value: Any) -> str:
    """A request value as the client wrote it in JSON, cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


MAX_TOP_LOGPROBS = 20  # chat completions' top_logprobs, as OpenAI's
MAX_COMPLETION_LOGPROBS = 5  # text completions' logprobs, as OpenAI's (vLLM allows up to its --max-logprobs, 20)


def _boolean_logprobs(value: Any) -> Any:
    """Chat completions' `logprobs`, a boolean as in OpenAI's API."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(
            f"must be a boolean in chat completions (true or false, as in OpenAI's API), got {_shown(value)}"
        )
    return value


def _integer_logprobs(value: Any) -> Any:
    """Text completions' `logprobs`, an integer in [0, 5] as in OpenAI's API: how many alternatives each token lists.
    A JSON number with no fraction (0.0) is an integer, as the published schema (JSON Schema) counts it."""
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if value is not None and (isinstance(value, bool) or not integral):
        raise ValueError(f"must be an integer in text completions (as in OpenAI's API), got {_shown(value)}")
    return None if value is None else int(value)


def template_variables(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """`chat_template_kwargs`, refused where it would set what the request itself sets."""
    reserved = sorted(RESERVED_TEMPLATE_KEYS & set(value or {}))
    if reserved:
        raise ValueError(f"{reserved[0]!r} is not a template variable here (it is set by the request itself)")
    return value


def continued_turn(value: bool | None, add_generation_prompt: bool | None) -> bool | None:
    """`continue_final_message`, which a new assistant turn (`add_generation_prompt`) contradicts."""
    if value and add_generation_prompt:
        raise ValueError("cannot be true with add_generation_prompt true (a new turn, or the last one continued)")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


# vLLM's extensions that viasd does not honour, and why; each is refused whenever it is given (not null).
_VLLM_REFUSED = {
    "guided_regex": "guided decoding is not supported",
    "guided_choice": "guided decoding is not supported",
    "guided_grammar": "guided decoding is not supported",
    "guided_decoding_backend": "guided decoding is not supported",
    "guided_whitespace_pattern": "guided decoding is not supported",
    "prompt_logprobs": "prompt_logprobs is not supported (echo with logprobs scores the prompt)",
    "allowed_token_ids": "allowed_token_ids is not supported (logit_bias of -100 bans a token)",
    "bad_words": "bad_words is not supported",
    "logits_processors": "custom logits processors are not supported",
}
# Published for them: leave it out (or null).
_REFUSED_SCHEMA: dict[str, Any] = {"enum": [None], "description": "vLLM extension, not supported: leave it out"}


class _Request(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0, description="extension (vLLM): 0 disables top-k")
    min_p: float | None = Field(
        default=None, ge=0.0, le=1.0, allow_inf_nan=False, description="extension (vLLM): 0 disables min-p"
    )
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX, description="any 64-bit integer")
    stop: str | list[str] | None = Field(
        default=None, json_schema_extra={"minLength": 1, "maxItems": MAX_STOP_STRINGS, "items": {"minLength": 1}}
    )
    n: int | None = Field(default=None, json_schema_extra={"enum": [1, None]}, description="only 1 is supported")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(
        default=None, gt=0.0, allow_inf_nan=False, description="extension (vLLM): 1 disables it"
    )
    logit_bias: dict[str, float] | None = Field(
        default=None,
        json_schema_extra={
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {"minimum": -100, "maximum": 100},
        },
        description="token id (a decimal string) -> a bias in [-100, 100] added to its logit",
    )
    min_tokens: int | None = Field(
        default=None, ge=0, description="extension (vLLM): no end token or stop string before this many tokens"
    )
    stop_token_ids: list[int] | None = Field(
        default=None,
        json_schema_extra={"items": {"minimum": 0}},
        description="extension (vLLM): more tokens that end the output",
    )
    include_stop_str_in_output: bool | None = Field(
        default=None, description="extension (vLLM): keep the stop string or token that ended the output"
    )
    skip_special_tokens: bool | None = Field(
        default=None, description="extension (vLLM): leave special tokens out of the text (default true)"
    )
    spaces_between_special_tokens: bool | None = Field(
        default=None, json_schema_extra={"enum": [True, None]}, description="extension (vLLM): only true"
    )
    truncate_prompt_tokens: int | None = Field(
        default=None, ge=1, description="extension (vLLM): keep only the prompt's last this many tokens"
    )
    best_of: int | None = Field(default=None, json_schema_extra={"enum": [1, None]}, description="only 1")
    use_beam_search: bool | None = Field(default=None, json_schema_extra=_ONLY_FALSE)
    length_penalty: float | None = Field(
        default=None, allow_inf_nan=False, json_schema_extra={"enum": [1, None]}, description="only 1 (no beams)"
    )
    response_format: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra={"properties": {"type": {"enum": list(FORMAT_TYPES)}}},
        description="text, json_object or json_schema (structured output: the text follows the schema)",
    )
    guided_json: dict[str, Any] | None = Field(
        default=None, description="extension (vLLM): a JSON schema the output follows, as response_format json_schema"
    )
    guided_regex: Any = Field(default=None, json_schema_extra=_REFUSED_SCHEMA)
    guided_choice: Any = Field(default=None, json_schema_extra=_REFUSED_SCHEMA)
    guided_grammar: Any = Field(default=None, json_schema_extra=_REFUSED_SCHEMA)
    guided_decoding_backend: Any = Field(default=None, json_schema_extra=_REFUSED_SCHEMA)
    guided_whitespace_pattern: Any = Field(default=None, json_schema_extra=_REFUSED_SCHEMA)
    structured_outputs: dict[str, Any] | None = Field(
        default=None, description="extension (vLLM): only its 'json' entry (a JSON schema) is supported"
    )
    prompt_logprobs: Any = Field(default=None, json_schema_extra=_REFUSED_SCHEMA)
    allowed_token_ids: Any = Field(default=None, json_schema_extra=_REFUSED_SCHEMA)
    bad_words: Any = Field(default=None, json_schema_extra=_REFUSED_SCHEMA)
    logits_processors: Any = Field(default=None, json_schema_extra=_REFUSED_SCHEMA)
    user: str | None = None
    method: str | None = Field(default=None, description="extension: decoding method, one of the loaded ones")
    ignore_eos: bool = Field(default=False, description="extension (vLLM): keep generating past end-of-sequence")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not _TOKEN_ID.fullmatch(key):
                raise ValueError(f"keys must be token ids written as decimal strings, got {_shown(key)}")
            if not -100.0 <= bias <= 100.0:  # NaN fails too
                raise ValueError(f"values must be numbers in [-100, 100], got {_shown(bias)} for token {key}")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(token < 0 for token in value):
            raise ValueError("token ids must be >= 0")
        return value

    @field_validator(*_VLLM_REFUSED)
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(f"{_VLLM_REFUSED[info.field_name or '']} (leave {info.field_name} out)")
        return value

    @field_validator("spaces_between_special_tokens")
    @classmethod
    def _spaces(cls, value: bool | None) -> bool | None:
        if value is False:
            raise ValueError("only true is supported (the tokenizer decides the spacing)")
        return value

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return value

    @field_validator("use_beam_search")
    @classmethod
    def _no_beams(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("beam search is not supported (false or leave it out)")
        return value

    @field_validator("length_penalty")
    @classmethod
    def _no_length_penalty(cls, value: float | None) -> float | None:
        if value is not None and value != 1.0:
            raise ValueError("needs beam search, which is not supported (1 or leave it out)")
        return value

    @field_validator("response_format")
    @classmethod
    def _known_format(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return format_check(value)

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs."""
        return tuple((int(key), float(bias)) for key, bias in (self.logit_bias or {}).items())

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"required": ["type", "text"]})

    type: str = Field(json_schema_extra={"enum": ["text"]}, description="only text parts are supported")
    text: str | None = Field(default=None, json_schema_extra={"type": "string"})


# What the validator below checks, published: a tool message names its call, only an assistant's carries calls.
_TOOL_FIELDS = {
    "allOf": [
        {"if": {"properties": {"role": {"const": "tool"}}}, "then": {"required": ["tool_call_id"]}},
        {
            "if": {"properties": {"role": {"not": {"const": "assistant"}}}},
            "then": {"properties": {"tool_calls": {"type": "null"}}},
        },
    ]
}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=_TOOL_FIELDS)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = Field(default=None, description="assistant messages: the calls made")
    tool_call_id: str | None = Field(default=None, description="tool messages: the call this is the result of")

    @field_validator("content")
    @classmethod
    def _text_only(cls, value: str | list[ContentPart] | None) -> str | list[ContentPart] | None:
        if isinstance(value, list):
            for part in value:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"only text content parts are supported, got type {part.type!r}")
        return value

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages carry tool calls, not {self.role} ones")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message needs the id of the call it answers")
        return self

    def as_prompt_message(self) -> dict[str, Any]:
        """The message as `encode_messages` takes it ('developer' is OpenAI's newer name for 'system'), tool calls
        and results in the shape Hugging Face chat templates read."""
        if isinstance(self.content, list):
            text = "".join(part.text or "" for part in self.content)
        else:
            text = self.content or ""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


# At least one message must have some text: an empty prompt is refused.
_SOME_TEXT = {
    "contains": {
        "type": "object",
        "required": ["content"],
        "properties": {
            "content": {
                "anyOf": [_TEXT, {"type": "array", "contains": {"type": "object", "properties": {"text": _TEXT}}}]
            }
        },
    }
}


# Why each chat parameter that has no neutral value is refused whenever it is given.
_NOT_HONOURED = {
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this model does not reason",
    "verbosity": "verbosity is not supported",
    "web_search_options": "web search is not supported",
    "chat_template": "a chat template of the request's own is not supported (the model's is used)",
    "documents": "documents are not supported",
}
_CHAT_REFUSED = ("chat_template", "documents")


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, json_schema_extra=_SOME_TEXT)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = Field(default=None, description="the target's log-probability of each output token")
    tools: list[ToolSpec] | None = Field(
        default=None, min_length=1, description="functions the model may call (with a chat template that offers tools)"
    )
    functions: list[Any] | None = Field(default=None, json_schema_extra=_EMPTY, description="not supported")
    add_generation_prompt: bool | None = Field(
        default=None, description="extension (vLLM): end the prompt with the assistant's turn opening (default true)"
    )
    continue_final_message: bool | None = Field(
        default=None, description="extension (vLLM): continue the last (assistant) message instead of a new turn"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra={"propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_KEYS)}}},
        description="extension (vLLM): more variables for the chat template (e.g. enable_thinking)",
    )
    chat_template: Any = Field(default=None, json_schema_extra=_REFUSED_SCHEMA)
    documents: Any = Field(default=None, json_schema_extra=_REFUSED_SCHEMA)
    echo: bool | None = Field(default=None, json_schema_extra=_ONLY_FALSE)
    top_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="with logprobs true: the most likely tokens listed at each position",
    )
    tool_choice: str | dict[str, Any] | None = Field(
        default=None,
        json_schema_extra=_TOOL_CHOICE,
        description="none, auto (the default), required, or a named function (forced by constrained decoding)",
    )
    function_call: str | dict[str, Any] | None = Field(default=None, json_schema_extra=_NO_TOOL)
    parallel_tool_calls: bool | None = Field(
        default=None, description="false: only the first of the model's tool calls is answered"
    )
    audio: dict[str, Any] | None = Field(default=None, json_schema_extra=_LEAVE_OUT)
    modalities: list[str] | None = Field(default=None, json_schema_extra={"items": {"enum": ["text"]}})
    prediction: dict[str, Any] | None = Field(default=None, json_schema_extra=_LEAVE_OUT)
    reasoning_effort: str | None = Field(default=None, json_schema_extra=_LEAVE_OUT)
    verbosity: str | None = Field(default=None, json_schema_extra=_LEAVE_OUT)
    web_search_options: dict[str, Any] | None = Field(default=None, json_schema_extra=_LEAVE_OUT)
    store: bool | None = Field(default=None, json_schema_extra=_ONLY_FALSE)
    metadata: dict[str, str] | None = Field(default=None, description="accepted; nothing is stored")
    service_tier: str | None = Field(default=None, json_schema_extra={"enum": ["auto", "default", None]})
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs(cls, value: Any) -> Any:
        return _boolean_logprobs(value)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("logprobs") is not True:
            raise ValueError("needs logprobs: true")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        return checked_tool_choice(value)

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if value not in (None, "none", "auto"):
            raise ValueError("functions are not supported: send tools (none, auto or leave function_call out)")
        return value

    @field_validator("tools")
    @classmethod
    def _distinct_tools(cls, value: list[ToolSpec] | None) -> list[ToolSpec] | None:
        return distinct_tools(value)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return template_variables(value)

    @field_validator("continue_final_message")
    @classmethod
    def _continue(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        return continued_turn(value, info.data.get("add_generation_prompt"))

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("echo is not supported (false or leave it out)")
        return value

    @field_validator("audio", "prediction", "reasoning_effort", "verbosity", "web_search_options", *_CHAT_REFUSED)
    @classmethod
    def _left_out(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(f"{_NOT_HONOURED[info.field_name or '']} (leave {info.field_name} out)")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_out(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(m != "text" for m in value):
            raise ValueError('only text output is supported (["text"] or leave modalities out)')
        return value

    @field_validator("store")
    @classmethod
    def _not_stored(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("completions are not stored on this server (false or leave store out)")
        return value

    @field_validator("service_tier")
    @classmethod
    def _one_tier(cls, value: str | None) -> str | None:
        if value not in (None, "auto", "default"):
            raise ValueError(f"service tiers are not offered here (auto, default or leave it out), got {value!r}")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.functions:
            raise ValueError("functions are not supported: send tools")
        return self

    def template(self, tools: tuple[dict[str, Any], ...] = ()) -> ChatTemplate:
        """How the chat template renders this request's messages, offering `tools`."""
        return ChatTemplate(
            add_generation_prompt=not self.continue_final_message
            if self.add_generation_prompt is None
            else self.add_generation_prompt,
            continue_final_message=bool(self.continue_final_message),
            variables=tuple(sorted((self.chat_template_kwargs or {}).items())),
            tools=tools,
        )

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] = Field(
        json_schema_extra=_PROMPT_SCHEMA,
        description="a string, a one-element list of strings, or a non-empty list of token ids",
    )
    max_tokens: int | None = Field(
        default=None, ge=0, description="0 only with echo and logprobs: the prompt scored, nothing generated"
    )
    echo: bool | None = Field(default=None, description="the prompt before the completion (with logprobs: scored too)")
    suffix: str | None = Field(default=None, json_schema_extra={"maxLength": 0}, description="not supported")
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_COMPLETION_LOGPROBS,
        description="log-probabilities of the tokens and of this many most likely alternatives at each position",
    )

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs(cls, value: Any) -> Any:
        return _integer_logprobs(value)

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise ValueError("only one prompt per request is supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("the prompt is empty")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


def field_range(model: type[BaseModel], name: str) -> str | None:
    """How a numeric field of a request is bounded, in words: 'a finite number in [0, 2]', 'an integer >= 1'.

    Read from the field's own constraints, so that error messages and the published schema cannot differ.
    """
    field = model.model_fields.get(name)
    if field is None:
        return None
    low = high = ""
    for bound in field.metadata:
        if isinstance(bound, annotated_types.Ge):
            low = f"[{_number(bound.ge)}"
        elif isinstance(bound, annotated_types.Gt):
            low = f"({_number(bound.gt)}"
        elif isinstance(bound, annotated_types.Le):
            high = f"{_number(bound.le)}]"
        elif isinstance(bound, annotated_types.Lt):
            high = f"{_number(bound.lt)})"
    kind = "an integer" if _annotation_has(field.annotation, int) else "a finite number"
    if low and high:
        return f"{kind} in {low}, {high}"
    if low:
        return f"{kind} {'>=' if low[0] == '[' else '>'} {low[1:]}"
    if high:
        return f"{kind} {'<=' if high[-1] == ']' else '<'} {high[:-1]}"
    return kind


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _annotation_has(annotation: Any, kind: type) -> bool:
    args = getattr(annotation, "__args__", None)
    return annotation is kind or (args is not None and kind in args)


# ------------------------------------------------------------------------------------------ responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculative: dict[str, Any] | None = Field(default=None, description="extension: the generation's statistics")


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="null when the model only called tools")
    tool_calls: list[ToolCallOut] | None = Field(default=None, exclude_if=lambda value: value is None)


def _is_none(value: Any) -> bool:
    return value is None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(BaseModel):
    """One output token in chat completions' `logprobs.content`; logprob null (with `unchecked`) where the full
    target never checked the token (via's relaxed tiers)."""

    token: str
    logprob: float | None
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob]
    unchecked: bool | None = Field(
        default=None, exclude_if=_is_none, description="extension: true where the full target never checked the token"
    )


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None = None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """Text completions' log-probabilities: parallel lists over the tokens (an echoed prompt's first)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]
    unchecked: list[int] | None = Field(
        default=None, exclude_if=_is_none, description="extension: indices of tokens the full target never checked"
    )


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """What a chunk adds; unset fields are left out, as OpenAI does (the last delta is `{}`)."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)
    tool_calls: list[ToolCallOut] | None = Field(
        default=None, exclude_if=_is_none, description="each call whole, with its index, in one delta"
    )


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    """One streamed chat event; `usage` only in the last one, and only when asked for."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(default=None, exclude_if=_is_none)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """A text completion; streamed chunks have the same shape (with `usage` only in the last, if asked)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(default=None, exclude_if=_is_none)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "viasd"
    methods: list[str] = Field(description="extension: the decoding methods loaded; the first is the default")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class QueueState(BaseModel):
    waiting: int = Field(description="requests waiting for the model")
    running: int = Field(description="requests generating now (up to --max-active)")
    capacity: int = Field(description="the most requests that may be in at once (running + --max-queue)")


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str
    methods: list[str]
    queue: QueueState


class ErrorDetail(BaseModel):
    message: str = Field(description="what went wrong, for people")
    type: str = Field(description="OpenAI's error type, e.g. invalid_request_error")
    param: str | None = Field(default=None, description="the request field at fault, when there is one")
    code: str | None = Field(default=None, description="a stable machine-readable code, e.g. queue_full")


class ErrorResponse(BaseModel):
    """Every error answer, in OpenAI's shape."""

    error: ErrorDetail
