"""Tools in `viasd serve`'s chat completions, against a real server process on a tiny random model whose chat
template offers tools (Hermes style, as Qwen2.5's does), with the official OpenAI client: tools reach the prompt,
a tool-call history is rendered as the template expects it, and bad tools or tool messages get one 400 naming the
field. A random model writes no tool calls: parsing them is tested in test_tool_calls.py, and end to end on the real
pair in test_real_tools.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessage

from test_serve import Server, assert_error, healthy_server, sse_payloads, tiny_model_dir
from tiny import TOOLS_CHATML_TEMPLATE, tiny_chat_tokenizer

MODEL_ID = "tiny-tools"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear", "celsius": 21}'}]  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("serve-tools")
    model = tiny_model_dir(directory / "model")
    tiny_chat_tokenizer(320, TOOLS_CHATML_TEMPLATE).save_pretrained(model)  # the same vocabulary, a tools template
    with healthy_server(
        directory, "tools", "--target", str(model), "--device", "cpu", "--methods", "plain,lookup",
        "--max-tokens-limit", "16", "--served-model-name", MODEL_ID, "--no-access-log",
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def rendered(server: Server, body: dict[str, Any]) -> tuple[int, str]:
    """The prompt /tokenize makes of chat messages (and tools): its token count and its text."""
    tokens = post(server, "/tokenize", body).json()["tokens"]
    return len(tokens), post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]


def test_tools_are_offered_to_the_chat_template(server: Server, client: openai.OpenAI) -> None:
    without = client.chat.completions.create(model=MODEL_ID, messages=[USER], max_tokens=4, temperature=0)
    answer = client.chat.completions.create(
        model=MODEL_ID, messages=[USER], tools=[WEATHER], max_tokens=4, temperature=0
    )
    count, prompt = rendered(server, {"messages": [USER], "tools": [WEATHER]})
    assert answer.usage is not None and without.usage is not None
    assert answer.usage.prompt_tokens == count > without.usage.prompt_tokens
    assert json.dumps(WEATHER) in prompt  # the whole definition, as the template writes it
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)  # random text: no call
    assert choice.finish_reason in ("stop", "length")


def test_a_tool_call_history_reaches_the_template_with_its_arguments_as_an_object(
    server: Server, client: openai.OpenAI
) -> None:
    _, prompt = rendered(server, {"messages": HISTORY, "tools": [WEATHER]})
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"sky": "clear", "celsius": 21}\n</tool_response>' in prompt
    # The client's own answer object sent back as the history's assistant message, as OpenAI's examples do.
    said = ChatCompletionMessage.model_validate(HISTORY[1])
    answer = client.chat.completions.create(
        model=MODEL_ID, messages=[USER, said, HISTORY[2]], tools=[WEATHER], max_tokens=3, temperature=0
    )
    assert answer.usage is not None and answer.usage.prompt_tokens == len(
        post(server, "/tokenize", {"messages": HISTORY, "tools": [WEATHER]}).json()["tokens"]
    )


def test_with_tools_a_stream_gives_the_content_a_whole_answer_gives(server: Server) -> None:
    body = {"messages": HISTORY, "tools": [WEATHER], "max_tokens": 8, "temperature": 0, "method": "lookup"}
    whole = post(server, "/v1/chat/completions", body).json()["choices"][0]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=30) as got:
        payloads = list(sse_payloads(got.iter_lines()))
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p)["choices"][0] for p in payloads[:-1]]
    assert "".join(c["delta"].get("content", "") for c in chunks) == whole["message"]["content"]
    assert chunks[-1]["finish_reason"] == whole["finish_reason"] and not any("tool_calls" in c["delta"] for c in chunks)


@pytest.mark.parametrize(
    "extra",
    [{"tool_choice": "none"}, {"tool_choice": "auto", "parallel_tool_calls": False}, {"parallel_tool_calls": True}],
)
def test_the_tool_choices_served_now_are_accepted(server: Server, extra: dict[str, Any]) -> None:
    body = {"messages": [USER], "tools": [WEATHER], "max_tokens": 2, **extra}
    assert post(server, "/v1/chat/completions", body).status_code == 200


def tool(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", **function}}


def history_call(**function: Any) -> dict[str, Any]:
    """A request body whose history has an assistant message calling `function` (name f unless given)."""
    said = {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", **function}}]}
    return {"messages": [USER, said]}


ARGUMENTS = "messages.1.tool_calls.0.function.arguments"


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "not among the tools"),
        ({"tool_choice": "sometimes"}, "tool_choice", "must be none, auto, required or a named function"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "Input should be 'function'"),
        ({"tools": [{"type": "function"}]}, "tools.0.function", "Field required"),
        ({"tools": [tool(name="get weather")]}, "tools.0.function.name", "1 to 64 letters"),
        ({"tools": [tool(name="x" * 65)]}, "tools.0.function.name", "1 to 64 letters"),
        ({"tools": [tool(parameters={"type": "array"})]}, "tools.0.function.parameters", 'type "object"'),
        ({"tools": [tool(parameters="{}")]}, "tools.0.function.parameters", "must be a JSON object"),
        ({"tools": [tool(strict=True)]}, "tools.0.function.strict", "strict: true is not supported"),
        ({"tools": [tool(descripton="typo")]}, "tools.0.function.descripton", "unknown parameter"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "'get_weather' is offered twice"),
        ({"tools": []}, "tools", "at least 1 item"),
        ({"tools": [tool(description="see <|im_start|>system")]}, "tools", "special or added tokens"),
        ({"messages": [USER, {"role": "tool", "content": "21C"}]}, "messages.1", "tool_call_id"),
        ({"messages": [{**USER, "tool_calls": [CALL]}]}, "messages.0", "only assistant messages carry tool calls"),
        (history_call(), ARGUMENTS, "Field required"),
        (history_call(arguments="{'city': 'Paris'}"), ARGUMENTS, "the text of a JSON object (it is not JSON"),
        (history_call(arguments={"city": "Paris"}), ARGUMENTS, "must be a string"),
        (history_call(arguments='{"a": ' * 129 + "1" + "}" * 129), ARGUMENTS, "nests deeper than 128 levels"),
        (history_call(arguments="[" * 5000 + "]" * 5000), ARGUMENTS, "or is nested too deep"),
        ({"functions": [{"name": "f"}]}, "body", "functions are not supported: send tools"),
    ],
)
def test_bad_tools_and_tool_messages_get_one_400_naming_the_field(
    server: Server, extra: dict[str, Any], param: str, words: str
) -> None:
    body = {"messages": [USER], "tools": [WEATHER], "max_tokens": 2, **extra}
    error = assert_error(post(server, "/v1/chat/completions", body), 400, words)
    assert (error["param"] or "body") == param, error
    assert "\n" not in error["message"]


def published_tools(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The non-null branches of `tools` in a server's published chat request schema."""
    schema = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]["tools"]
    return [branch for branch in schema["anyOf"] if branch.get("type") != "null"]


def test_the_published_schema_takes_tools_here(server: Server) -> None:
    (tools,) = published_tools(httpx.get(f"{server.url}/openapi.json", timeout=30).json())
    assert tools["minItems"] == 1 and "maxItems" not in tools


def test_tokenize_takes_tools_with_messages_only(server: Server) -> None:
    error = assert_error(post(server, "/tokenize", {"prompt": "hi", "tools": [WEATHER]}), 400, "messages only")
    assert error["param"] == "tools"
    error = assert_error(post(server, "/tokenize", {"messages": [USER], "tools": [WEATHER, WEATHER]}), 400, "twice")
    assert error["param"] == "tools"


def test_a_template_without_tools_refuses_them_naming_tools(tmp_path: Path) -> None:
    """SmolLM2-like ChatML without tools: the template would drop them silently, so they are refused."""
    from fastapi.testclient import TestClient

    from tiny import tiny_model
    from viasd.engine import Engine, EngineSpec
    from viasd.models.loading import LoadedModel
    from viasd.serve.app import create_app
    from viasd.serve.settings import ServeSettings

    loaded = LoadedModel(model=tiny_model(vocab_size=320), tokenizer=tiny_chat_tokenizer(320), name="t", path="t")
    engine = Engine(EngineSpec(target="t", device="cpu"), target=loaded)
    with TestClient(create_app(engine, ServeSettings(model_id="t", methods=("plain",)))) as app:
        for path in ("/v1/chat/completions", "/tokenize"):
            error = assert_error(app.post(path, json={"messages": [USER], "tools": [WEATHER]}), 400, "offers no tools")
            assert error["param"] == "tools"
        assert app.post("/v1/chat/completions", json={"messages": HISTORY, "max_tokens": 1}).status_code == 200
        (tools,) = published_tools(app.get("/openapi.json").json())
        assert tools["maxItems"] == 0  # published as refused: only null or left out
