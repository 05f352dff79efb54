"""Parsing tool calls out of a model's output (Hermes style, as Qwen2.5 writes them), whole and as it streams, and
choosing the format from the chat template."""

from __future__ import annotations

import json
import random

import pytest

from tiny import CHATML_TEMPLATE, TOOLS_CHATML_TEMPLATE
from viasd.toolcalls.formats import HermesFormat, ParsedOutput, ToolCall, template_format
from viasd.toolcalls.streaming import ToolCallStream

HERMES = HermesFormat()
NAMES = frozenset({"get_weather", "get_time"})


def call(name: str, arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_a_well_formed_call_is_parsed_with_its_arguments_as_json_text() -> None:
    parsed = HERMES.parse(call("get_weather", {"city": "Paris", "days": 2}), NAMES)
    assert parsed.content is None
    assert parsed.calls == (ToolCall("get_weather", '{"city": "Paris", "days": 2}'),)
    assert json.loads(parsed.calls[0].arguments) == {"city": "Paris", "days": 2}


def test_several_calls_keep_their_order_and_the_text_around_them() -> None:
    text = "Let me check.\n" + call("get_weather", {"city": "Oslo"}) + "\n" + call("get_time", {}) + "\nDone."
    parsed = HERMES.parse(text, NAMES)
    assert [c.name for c in parsed.calls] == ["get_weather", "get_time"]
    assert [json.loads(c.arguments) for c in parsed.calls] == [{"city": "Oslo"}, {}]
    assert parsed.content == "Let me check.\n\nDone."  # the newline between the calls is not content


def test_non_ascii_arguments_and_a_call_left_unclosed_at_the_end() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
    parsed = HERMES.parse(text, NAMES)
    assert parsed == ParsedOutput(None, (ToolCall("get_weather", '{"city": "Zürich"}'),))
    assert HERMES.parse('<tool_call>{"name": "get_time"}</tool_call>', NAMES).calls == (ToolCall("get_time", "{}"),)


@pytest.mark.parametrize(
    "bad",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # a brace short
        "<tool_call>\nget_weather(city='Paris')\n</tool_call>",  # not JSON
        call("get_wether", {"city": "Paris"}),  # a function not offered
        call("get_weather", '{"city": "Paris"}'),  # arguments as a string
        '<tool_call>\n["get_weather", {"city": "Paris"}]\n</tool_call>',  # not an object
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut short by max_tokens
    ],
)
def test_a_badly_written_call_turns_the_whole_output_into_content(bad: str) -> None:
    text = "Checking. " + call("get_time", {}) + bad
    assert HERMES.parse(text, NAMES) == ParsedOutput(text, ())


def test_text_without_calls_is_content_as_it_is() -> None:
    for text in ("", "  \n", "The weather is fine.", "a <tool_cal> look-alike", '{"answer": 42}', "[1, 2]"):
        assert HERMES.parse(text, NAMES) == ParsedOutput(text, ())


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',  # Qwen2.5-Coder
        '\n```\n[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time"}]\n```\n',
    ],
)
def test_an_output_that_is_only_a_call_object_bare_or_fenced_is_the_call(text: str) -> None:
    parsed = HERMES.parse(text, NAMES)
    assert parsed.content is None and parsed.calls[0] == ToolCall("get_weather", '{"city": "Paris"}')


@pytest.mark.parametrize(
    "text",
    [
        '```json\n{"name": "get_wether", "arguments": {"city": "Paris"}}\n```',  # not offered
        'Here: ```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',  # text around it
        '```python\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',  # another language
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "rm"}]',  # one call not offered
        "[]",
    ],
)
def test_other_json_answers_stay_content(text: str) -> None:
    assert HERMES.parse(text, NAMES) == ParsedOutput(text, ())


OUTPUTS = [
    "The weather is fine, no call needed.",
    "Sure.\n" + call("get_weather", {"city": "Paris"}) + "\n" + call("get_time", {"zone": "CET"}),
    call("get_weather", {"city": "Zürich"}) + "\nThat is all.",
    "Checking <tool_ca and more text <tool_call> not json </tool_call> tail",
    "ends on a marker's start <tool_c",
    '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
    '  {"name": "get_time", "arguments": {}}',
    '```json\n{"answer": 42}\n```',
    "```python\nprint(1)\n```",
    "``not a fence",
]


@pytest.mark.parametrize("text", OUTPUTS)
def test_a_stream_sends_the_content_a_whole_parse_gives_and_no_call_text(text: str) -> None:
    """Cut into random pieces: the content sent as it comes plus the rest at the end is the content of the whole
    parse (or the whole text, when no call parses), nothing of a call's text is sent before the end, and the calls
    are the whole parse's."""
    whole = HERMES.parse(text, NAMES)
    rng = random.Random(7)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream = ToolCallStream(HERMES, NAMES)
        sent = "".join(stream.feed(piece) for piece in pieces)
        tail, parsed = stream.finish()
        assert parsed == whole
        assert sent + tail == (whole.content or "")
        if whole.calls and HERMES.start in text:
            assert sent == text[: text.index(HERMES.start)]  # content until the first call, none of its text
        elif whole.calls or HERMES.opens_bare_call(text):
            assert sent == ""  # a bare call, or what opens as one, is held whole


def test_only_what_opens_as_a_bare_call_is_held() -> None:
    assert [HERMES.opens_bare_call(t) for t in ("", " ", "`", "``", "```", "```js", "```json", "```json\n ")] == [
        None
    ] * 8
    assert [HERMES.opens_bare_call(t) for t in ("{", ' \n{"', "[", "```json\n{", "```\n  [", "```json \n{")] == [
        True
    ] * 6
    assert [HERMES.opens_bare_call(t) for t in ("S", "```p", "```python\n{", "`x", "```jsonx", "```\nx")] == [False] * 6


def test_the_format_is_chosen_by_the_chat_template() -> None:
    assert template_format(TOOLS_CHATML_TEMPLATE) == HERMES
    assert template_format({"default": CHATML_TEMPLATE, "tool_use": TOOLS_CHATML_TEMPLATE}) == HERMES
    assert template_format(CHATML_TEMPLATE) is None  # offers no tools
    assert template_format(None) is None  # no template at all
