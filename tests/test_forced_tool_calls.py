"""tool_choice "required" and a named function: the call is forced by constrained decoding (the output is a call object
of an offered function, its arguments under that function's schema) and answered as `tool_calls`, alike by every
exact method; a choice that cannot be forced is one 400 naming tool_choice. In process, on a tiny random model
whose chat template offers tools; the real pair's tool calls are tested in test_real_tools.py."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema_rs
import pytest
from fastapi.testclient import TestClient

from tiny import TOOLS_CHATML_TEMPLATE, tiny_chat_tokenizer, tiny_model

VOCAB = 320
UNIT = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}},
    "required": ["unit"],
    "additionalProperties": False,
}
DAYS = {
    "type": "object",
    "properties": {"days": {"enum": [1, 2, 3]}},
    "required": ["days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "Weather now.", "parameters": UNIT}},
    {"type": "function", "function": {"name": "forecast", "description": "Weather ahead.", "parameters": DAYS}},
]
SCHEMAS = {"weather": UNIT, "forecast": DAYS}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def app() -> Iterator[TestClient]:
    from viasd.engine import Engine, EngineSpec
    from viasd.models.loading import LoadedModel
    from viasd.serve.app import create_app
    from viasd.serve.settings import ServeSettings

    tok = tiny_chat_tokenizer(VOCAB, TOOLS_CHATML_TEMPLATE)
    model = tiny_model(vocab_size=VOCAB)
    model.config.max_position_embeddings = 4096  # the tools' definitions take some 400 byte-level tokens
    loaded = LoadedModel(model, tok, name="tiny", path="tiny")
    engine = Engine(EngineSpec(target="tiny", device="cpu"), target=loaded)
    settings = ServeSettings(model_id="tiny", methods=("lookup", "plain"), max_tokens_limit=80, default_max_tokens=60)
    with TestClient(create_app(engine, settings)) as client:
        yield client


def ask(app: TestClient, **body):
    return app.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "temperature": 0, **body})


def calls(response) -> tuple[list[tuple[str, dict]], str]:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    found = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]
    return found, choice["finish_reason"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "forecast"}}])
def test_a_forced_call_is_a_valid_call_alike_for_every_method(app, choice):
    found, finish = calls(ask(app, tool_choice=choice))
    assert finish == "tool_calls" and len(found) == 1
    name, arguments = found[0]
    jsonschema_rs.validate(SCHEMAS[name], arguments)  # the arguments follow the chosen function's schema
    if isinstance(choice, dict):
        assert name == "forecast"
    assert calls(ask(app, tool_choice=choice, method="plain")) == (found, finish)  # lookup is exact under it too


def test_a_streamed_forced_call_is_the_whole_answers_call(app):
    choice = {"type": "function", "function": {"name": "weather"}}
    whole, _ = calls(ask(app, tool_choice=choice))
    body = {"messages": MESSAGES, "tools": TOOLS, "temperature": 0, "tool_choice": choice, "stream": True}
    with app.stream("POST", "/v1/chat/completions", json=body) as got:
        chunks = [json.loads(line[6:]) for line in got.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    streamed = [
        (call["function"]["name"], json.loads(call["function"]["arguments"]))
        for delta in deltas
        for call in delta.get("tool_calls") or []
    ]
    assert streamed == whole
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nowhere"}}}, "tool_choice", "not among the tools"),
        ({"tool_choice": "required", "tools": None}, "tool_choice", "no tools are offered"),
        ({"tool_choice": {"type": "function", "name": "weather"}}, None, "a named function is"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "give one"),
    ],
    ids=["unknown-name", "no-tools", "bad-shape", "two-constraints"],
)
def test_a_choice_that_cannot_be_forced_is_a_400_naming_it(app, body, param, words):
    response = ask(app, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and "\n" not in error["message"], error
    if param is not None:
        assert error["param"] == param
