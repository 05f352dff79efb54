"""Tool calls end to end on the real default pair (Qwen2.5-Coder 1.5B target, 0.5B drafter, exact speculative
decoding), served by `viasd serve`: the official OpenAI client gets a weather tool called with valid JSON
arguments, whole and streamed, and langchain-openai's `bind_tools` completes a round trip (call, tool result,
answer). Qwen2.5-Coder writes its calls as a fenced JSON object rather than in `<tool_call>` tags: this is the path
it takes (toolcalls/formats.py). The first run fetches the models (about 1.6 GB).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from test_serve import Server, real_server

pytestmark = pytest.mark.real

MODEL_ID = "qwen-tools"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city's name, e.g. Paris"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ("--methods", "sd,plain", "--served-model-name", MODEL_ID, "--max-tokens-limit", "256")
    with real_server(tmp_path_factory.mktemp("real-tools"), *args) as started:
        yield started


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def ask(client: openai.OpenAI, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL_ID, messages=ASK, tools=[WEATHER], max_tokens=96, temperature=0, **extra
    )


def test_the_openai_client_gets_a_tool_call_with_valid_json_arguments(client: openai.OpenAI) -> None:
    choice = ask(client).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()
    assert not (choice.message.content or "").strip()  # nothing but the call

    # Streamed: the same call, whole in one delta, and the same finish reason.
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in ask(client, stream=True):
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or []:
            assert part.index not in calls  # each call comes whole
            calls[part.index] = {"id": part.id, "name": part.function.name, "arguments": part.function.arguments}
        reasons.append(chunk.choices[0].finish_reason)
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)
    assert reasons[-1] == "tool_calls"


def test_langchain_bind_tools_round_trip(server: Server, tmp_path: Path) -> None:
    """The model calls the tool, gets its result as a tool message, and answers from it (23 comes only from the
    tool)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return json.dumps({"city": city, "sky": "clear", "celsius": 23})

    model = langchain_openai.ChatOpenAI(
        model=MODEL_ID, base_url=f"{server.url}/v1", api_key="unused", temperature=0, max_tokens=96, max_retries=0
    ).bind_tools([get_weather])
    # Asked for a sentence at the end: the 1.5B model, asked only for the weather, calls the tool again and again.
    messages: list[Any] = [
        HumanMessage("Use the get_weather tool to look up the weather in Paris, then tell me in one sentence.")
    ]
    called = model.invoke(messages)
    assert [c["name"] for c in called.tool_calls] == ["get_weather"], called
    assert "paris" in called.tool_calls[0]["args"]["city"].lower()
    messages += [
        called,
        ToolMessage(get_weather.invoke(called.tool_calls[0]["args"]), tool_call_id=called.tool_calls[0]["id"]),
    ]
    answer = model.invoke(messages)
    assert not answer.tool_calls and "23" in answer.content, answer


def test_langchain_with_structured_output_by_function_calling_forces_the_call(server: Server) -> None:
    """with_structured_output(method="function_calling") names the function in tool_choice: the server forces the
    call by constrained decoding, and the answer parses into the pydantic model."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel

    class Capital(BaseModel):
        """A country's capital city."""

        country: str
        capital: str

    model = langchain_openai.ChatOpenAI(
        model=MODEL_ID, base_url=f"{server.url}/v1", api_key="unused", temperature=0, max_tokens=96, max_retries=0
    ).with_structured_output(Capital, method="function_calling")
    answer = model.invoke("What is the capital of France?")
    assert isinstance(answer, Capital) and answer.capital.lower() == "paris", answer
