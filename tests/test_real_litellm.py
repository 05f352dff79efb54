"""litellm against `viasd serve` on the real default pair, called as its users call an OpenAI-compatible server
(model "openai/<served name>", api_base the server's /v1, any key): greedy chat identical to the official openai
client's with the same usage, streaming, a forced tool call, a pydantic response_format, and bad parameters as
litellm's BadRequestError (the server's 400 naming the parameter). The first run fetches the models (about 1.6 GB).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import httpx
import jsonschema_rs
import openai
import pytest
from pydantic import BaseModel, Field

from test_serve import Server, real_server

pytestmark = [
    pytest.mark.real,
    # litellm's own response types, as pydantic builds them: nothing viasd sends or a user can act on
    pytest.mark.filterwarnings("ignore:Items? .* (is|are) using the `ReadOnly` qualifier:UserWarning"),
]

MODEL_ID = "qwen-litellm"
# Long enough an answer that 16 tokens cut it: finish_reason "length", so completion_tokens must be exactly 16.
MAX_TOKENS = 16
GREEDY: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Count from 1 to 50, separated by commas."}],
    "max_tokens": MAX_TOKENS,
    "temperature": 0,
    "seed": 7,
    "logprobs": True,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "the city's name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


class Colour(BaseModel):
    name: str = Field(max_length=20)
    hex_code: str = Field(pattern=r"^#[0-9A-Fa-f]{6}$")
    is_primary: bool


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with real_server(tmp_path_factory.mktemp("real-litellm"), "--served-model-name", MODEL_ID) as started:
        yield started


@pytest.fixture(scope="module")
def litellm() -> ModuleType:
    """litellm, imported with its bundled model cost map: by default the import fetches one over the network."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        return pytest.importorskip("litellm")


def complete(litellm: ModuleType, server: Server, **request: Any) -> Any:
    """`litellm.completion` as its users point it at an OpenAI-compatible server."""
    return litellm.completion(
        model=f"openai/{MODEL_ID}", api_base=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300, **request
    )


@pytest.fixture(scope="module")
def greedy(litellm: ModuleType, server: Server) -> Any:
    return complete(litellm, server, **GREEDY)


def test_greedy_chat_is_the_openai_clients_answer_with_the_same_usage(greedy: Any, server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    reference = client.chat.completions.create(model=MODEL_ID, **GREEDY)
    choice, expected = greedy.choices[0], reference.choices[0]
    assert choice.message.content and choice.message.content == expected.message.content
    assert choice.finish_reason == expected.finish_reason == "length"

    usage = greedy.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        reference.usage.prompt_tokens,
        reference.usage.completion_tokens,
        reference.usage.total_tokens,
    )
    # Cut at max_tokens: exactly that many tokens, each with its logprob entry.
    assert usage.completion_tokens == MAX_TOKENS == len(choice.logprobs.content)
    assert "".join(entry.token for entry in choice.logprobs.content) == choice.message.content
    # The prompt's count is the chat template's tokens as /tokenize renders the same messages.
    tokenized = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_ID, "messages": GREEDY["messages"]})
    assert usage.prompt_tokens == tokenized.json()["count"]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streamed_deltas_join_into_the_answer(litellm: ModuleType, server: Server, greedy: Any) -> None:
    chunks = list(complete(litellm, server, **GREEDY, stream=True))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert text == greedy.choices[0].message.content
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices[0].finish_reason] == ["length"]


def test_a_named_tool_choice_gives_a_call_under_the_functions_schema(litellm: ModuleType, server: Server) -> None:
    response = complete(
        litellm,
        server,
        messages=[{"role": "user", "content": "What is the weather like in Paris right now?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=48,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema_rs.validate(WEATHER["function"]["parameters"], arguments)
    assert "paris" in arguments["city"].lower()


def test_a_pydantic_response_format_parses_into_the_model(litellm: ModuleType, server: Server) -> None:
    response = complete(
        litellm,
        server,
        messages=[{"role": "user", "content": "Describe the colour red as JSON."}],
        response_format=Colour,
        max_tokens=48,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice
    colour = Colour.model_validate_json(choice.message.content)
    assert colour.name.strip()


@pytest.mark.parametrize(
    ("bad", "param"),
    [
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"response_format": {"type": "frobnicate"}}, "response_format"),
    ],
)
def test_a_bad_parameter_is_litellms_bad_request_naming_it(
    litellm: ModuleType, server: Server, bad: dict[str, Any], param: str
) -> None:
    with pytest.raises(litellm.BadRequestError) as raised:
        complete(litellm, server, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, **bad)
    # The server's 400, passed on: not litellm's own check of its parameters (a subclass of BadRequestError).
    assert not isinstance(raised.value, litellm.UnsupportedParamsError)
    assert raised.value.status_code == 400
    assert param in str(raised.value), raised.value
