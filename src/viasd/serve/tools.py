"""Tools in chat completions, as OpenAI's API and vLLM's server take them: the shapes of `tools` and of the tool calls
in a conversation's history (request side), what a request asks of the model (`ToolUse`), and the calls parsed out of
its output in OpenAI's answer shapes (response side).

`tool_choice` "auto" (the default with tools) lets the model call any offered function or none; "none" offers them to
the template as vLLM does by default, and answers the output as content. "required" and a named function force a
call by constrained decoding (`forced_call_schema`: the output is a call object of one of them, as vLLM forces
them); `strict` function schemas under "auto" would need a grammar that also allows free text, and are refused.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from viasd.serve.errors import APIError
from viasd.toolcalls.formats import ParsedOutput, ToolCall, ToolCallFormat

FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names
# Under "auto" a strict schema needs a grammar that allows free text or a strict call: not built.
STRICT = "is not supported (tool_choice required or a named function does make the arguments follow the schema)"
# The deepest nesting of a history call's arguments: the request body's own JSON is held to about 200 levels, and the
# chat template, rendering them back as JSON, runs out of Python's stack a few hundred levels down.
MAX_ARGUMENT_DEPTH = 128


def json_depth(value: object) -> int:
    """How deeply a parsed JSON value nests (a scalar: 0, `[]` or `{}`: 1), counted without recursion."""
    deepest, pending = 0, [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth + 1)
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


class FunctionSpec(BaseModel):
    """A function offered to the model: its name, what it does, and its parameters as a JSON schema object."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(json_schema_extra={"pattern": FUNCTION_NAME}, description="letters, digits, _ and -, at most 64")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="a JSON schema of type object")
    strict: bool | None = Field(default=None, json_schema_extra={"enum": [False, None]})

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.fullmatch(FUNCTION_NAME, value):
            raise ValueError(f"must be 1 to 64 letters, digits, _ or -, got {json.dumps(value)}")
        return value

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError(f'must be a JSON schema of type "object", got type {json.dumps(value.get("type"))}')
        return value

    @field_validator("strict")
    @classmethod
    def _not_strict(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError(f"strict: true {STRICT}")
        return value


class ToolSpec(BaseModel):
    """One entry of `tools`: only functions."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionSpec


class CalledFunction(BaseModel):
    """A function an assistant message of the history called; `arguments` is a JSON object's text, as OpenAI sends."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(min_length=1)
    arguments: str = Field(
        json_schema_extra={"contentMediaType": "application/json", "contentSchema": {"type": "object"}},
        description="a JSON object's text",
    )

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):  # RecursionError: nested too deep for Python
            raise ValueError("must be the text of a JSON object (it is not JSON, or is nested too deep)") from None
        if not isinstance(parsed, dict):
            raise ValueError("must be the text of a JSON object")
        if json_depth(parsed) > MAX_ARGUMENT_DEPTH:
            raise ValueError(f"nests deeper than {MAX_ARGUMENT_DEPTH} levels")
        return value


class MessageToolCall(BaseModel):
    """A tool call in an assistant message of the history."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        """The call as Hugging Face chat templates read it: arguments as an object, not a JSON text."""
        arguments = json.loads(self.function.arguments)
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


def checked_tool_choice(value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """`tool_choice`'s shape: none, auto, required, a named function ({"type": "function", "function": {"name": ...}})
    or left out."""
    if value in (None, "none", "auto", "required"):
        return value
    if isinstance(value, dict):
        function = value.get("function")
        named = isinstance(function, dict) and isinstance(function.get("name"), str) and set(function) == {"name"}
        if value.get("type") == "function" and set(value) == {"type", "function"} and named:
            return value
        raise ValueError(
            f'a named function is {{"type": "function", "function": {{"name": ...}}}}, got {json.dumps(value)}'
        )
    raise ValueError(f"must be none, auto, required or a named function, got {json.dumps(value)}")


def forced_call_schema(
    tools: Sequence[ToolSpec] | None, tool_choice: str | dict[str, Any] | None
) -> dict[str, Any] | None:
    """The JSON schema the output must follow where `tool_choice` forces a call, else None: a call object
    {"name": ..., "arguments": {...}} of one offered function ("required") or of the named one, its arguments under
    that function's parameters schema. The parsers take such an output as the call (toolcalls/formats.py)."""
    if tool_choice != "required" and not isinstance(tool_choice, dict):
        return None
    if not tools:
        raise APIError(400, "tool_choice forces a call but no tools are offered", param="tool_choice")
    chosen = list(tools)
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        chosen = [tool for tool in tools if tool.function.name == name]
        if not chosen:
            raise APIError(
                400, f"tool_choice names {json.dumps(name)}, which is not among the tools", param="tool_choice"
            )
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                "arguments": tool.function.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for tool in chosen
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def duplicate_name(tools: Sequence[ToolSpec]) -> str | None:
    """The first function name offered twice, if any."""
    seen: set[str] = set()
    for tool in tools:
        if tool.function.name in seen:
            return tool.function.name
        seen.add(tool.function.name)
    return None


def distinct_tools(tools: list[ToolSpec] | None) -> list[ToolSpec] | None:
    """`tools` as a request gives them, refused (ValueError) where a function is offered twice."""
    twice = duplicate_name(tools or [])
    if twice is not None:
        raise ValueError(f"function {twice!r} is offered twice")
    return tools


# ------------------------------------------------------------------------------------------ what a request asks


@dataclass(frozen=True)
class ToolUse:
    """What a chat request does with tools: those offered to the template, the format its output is parsed in (None:
    not parsed), the functions that may be called, and whether only the first call is answered."""

    offered: tuple[dict[str, Any], ...] = ()
    format: ToolCallFormat | None = None
    names: frozenset[str] = frozenset()
    first_only: bool = False


NO_TOOLS = ToolUse()


def tool_use(
    tools: Sequence[ToolSpec] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    template_format: ToolCallFormat | None,
) -> ToolUse:
    """The request's tool use, given the format the model's chat template asks for (None: it offers no tools)."""
    if not tools:
        return NO_TOOLS
    if template_format is None:
        raise APIError(
            400,
            "this model's chat template offers no tools (or writes tool calls in a format not parsed here); "
            "leave tools out",
            code="invalid_request",
            param="tools",
        )
    offered = tuple(tool.model_dump(exclude_none=True) for tool in tools)
    return ToolUse(
        offered=offered,
        format=None if tool_choice == "none" else template_format,
        names=frozenset(tool.function.name for tool in tools),
        first_only=parallel_tool_calls is False,
    )


# ------------------------------------------------------------------------------------------------- answers


class FunctionOut(BaseModel):
    name: str
    arguments: str = Field(description="a JSON object's text")


class ToolCallOut(BaseModel):
    """A call the model made, in OpenAI's shape; in a streamed delta it carries its `index` and is sent whole."""

    index: int | None = Field(default=None, exclude_if=lambda value: value is None)
    id: str
    type: Literal["function"] = "function"
    function: FunctionOut


@dataclass(frozen=True)
class ToolAnswer:
    """An output as the answer gives it: content (None when only calls), the calls, and the finish reason."""

    content: str | None
    calls: list[ToolCallOut]
    finish_reason: str


def tool_answer(parsed: ParsedOutput, use: ToolUse, finish_reason: str, indexed: bool = False) -> ToolAnswer:
    """The answer to give for a parsed output: with calls, finish reason "tool_calls" (only the first call when
    parallel calls are off); `indexed` numbers the calls, as streamed deltas carry them."""
    calls: Sequence[ToolCall] = parsed.calls[:1] if use.first_only else parsed.calls
    if not calls:
        return ToolAnswer(parsed.content, [], finish_reason)
    out = [
        ToolCallOut(
            index=i if indexed else None,
            id=f"call_{uuid.uuid4().hex[:24]}",
            function=FunctionOut(name=call.name, arguments=call.arguments),
        )
        for i, call in enumerate(calls)
    ]
    return ToolAnswer(parsed.content, out, "tool_calls")


def text_answer(text: str, use: ToolUse, finish_reason: str) -> ToolAnswer:
    """A whole output's answer: parsed for calls when the request offered tools to call, as it is otherwise."""
    if use.format is None:
        return ToolAnswer(text, [], finish_reason)
    return tool_answer(use.format.parse(text, use.names), use, finish_reason)
