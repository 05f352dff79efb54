r"""The formats models write tool calls in, chosen by the chat template, and parsing a whole output into content and
calls.

Hermes style (Qwen2.5, Hermes and others) writes each call as
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`; a template that tells the model to write `<tool_call>`
is taken to use it. A call the model writes badly (not JSON, not an object with a string name and object arguments)
turns the whole output back into plain content, as vLLM's `hermes` parser does: the client sees what the model wrote,
never an error. So does a call of a function that was not offered (vLLM's parser passes it on as a call; a client
could only fail on it).

Beyond vLLM's parser: an output that is nothing but such a call object (or a list of them), bare or in a Markdown code
fence, is taken as the call(s). The default model, Qwen2.5-Coder, answers a tool request that way instead of with
`<tool_call>` tags; only functions offered by the request count, so other JSON answers stay content."""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: a function name and its arguments as a JSON object text (as OpenAI sends them)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """An output split into what the user reads (None when there is nothing but calls) and the calls it makes."""

    content: str | None
    calls: tuple[ToolCall, ...]


# An output in a code fence (```json or ```): its body.
_FENCED = re.compile(r"\s*```(?:json)?[ \t]*\n(.*)```\s*", re.DOTALL)


@dataclass(frozen=True)
class HermesFormat:
    """Calls as JSON objects between `<tool_call>` and `</tool_call>`; the last may be left unclosed."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"

    def opens_bare_call(self, text: str) -> bool | None:
        """Whether an output that begins with `text` is taken whole before it is parsed, as it may be a bare call
        (True), is not (False), or cannot tell yet (None)."""
        head = text.lstrip()
        if re.match(r"(?:```(?:json)?[ \t]*\n\s*)?[\[{]", head):
            return True
        if re.fullmatch(r"(?:`{0,3}|```j|```js|```jso|```json)|```(?:json)?[ \t]*(?:\n\s*)?", head):
            return None
        return False

    def parse(self, text: str, names: Collection[str]) -> ParsedOutput:
        """`text` split into content and calls of the functions in `names`; the whole text as content when it holds
        no call, or any call is badly written."""
        if self.start not in text:
            return ParsedOutput(None, bare) if (bare := _bare_calls(text, names)) else ParsedOutput(text, ())
        pattern = re.compile(re.escape(self.start) + "(.*?)(?:" + re.escape(self.end) + r"|\Z)", re.DOTALL)
        calls: list[ToolCall] = []
        outside: list[str] = []
        position = 0
        for match in pattern.finditer(text):
            call = _call(match.group(1), names)
            if call is None:
                return ParsedOutput(text, ())
            calls.append(call)
            outside.append(text[position : match.start()])
            position = match.end()
        outside.append(text[position:])
        # The text before the first call as written; later text only where it is more than the space between calls.
        content = outside[0] + "".join(piece for piece in outside[1:] if piece.strip())
        return ParsedOutput(content if content.strip() else None, tuple(calls))


ToolCallFormat = HermesFormat  # the one format so far; a new one adds `parse` and its markers


def _call(body: str, names: Collection[str]) -> ToolCall | None:
    """The call written in `body` (a JSON object with a string name and an object of arguments, none for a function
    without parameters), or None."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _bare_calls(text: str, names: Collection[str]) -> tuple[ToolCall, ...]:
    """The calls of an output that is nothing but one call object or a list of them (fenced or not), else none."""
    fenced = _FENCED.fullmatch(text)
    body = fenced.group(1) if fenced else text
    if not body.strip().startswith(("{", "[")):
        return ()
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return ()
    objects = value if isinstance(value, list) else [value]
    calls = [_call(json.dumps(item), names) for item in objects]
    if not objects or any(call is None for call in calls):
        return ()
    return tuple(call for call in calls if call is not None)


def template_format(chat_template: object) -> ToolCallFormat | None:
    """The tool-call format a chat template asks for, or None when it offers the model no tools (or asks for a format
    not parsed here). A tokenizer with several named templates counts if any of them asks."""
    texts = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    for text in texts:
        if isinstance(text, str) and HermesFormat.start in text and "tools" in text:
            return HermesFormat()
    return None
