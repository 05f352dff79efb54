"""The server's OpenAPI document, and a schemathesis run against a real `viasd serve` process that must find
nothing: no 5xx, no undocumented status, no response that breaks its schema (streamed events included).

The server runs a tiny random model saved to disk with a byte-level chat tokenizer (so every generated
string is a valid prompt), under an API key and small limits so that every refusal is cheap to provoke.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from tiny import tiny_chat_tokenizer, tiny_model

KEY = "fuzz-key"
VOCAB = 320
MAX_TOKENS_LIMIT = 8
CHECKS = "not_a_server_error,status_code_conformance,response_schema_conformance"
MAX_EXAMPLES = 50


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random model and a chat tokenizer, saved as a Hugging Face directory `viasd serve` can load."""
    directory = tmp_path_factory.mktemp("tiny-chat-model")
    tiny_model(vocab_size=VOCAB, dtype=torch.float32).save_pretrained(directory)
    tiny_chat_tokenizer(VOCAB).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`viasd serve` on the tiny model, on a free port; yields its base URL."""
    port = _free_port()
    log = tmp_path_factory.mktemp("openapi-server") / "server.log"
    command = [
        *(sys.executable, "-m", "viasd", "serve", "--target", str(model_dir), "--dtype", "fp32", "--device", "cpu"),
        *("--port", str(port), "--methods", "plain,lookup", "--api-key", KEY),
        *("--max-tokens-limit", str(MAX_TOKENS_LIMIT), "--default-max-tokens", "4", "--max-queue", "2"),
        *("--max-body-bytes", "4096", "--max-prompt-tokens", "64", "--no-access-log"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert process.poll() is None, f"the server exited:\n{log.read_text(errors='replace')[-3000:]}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        else:
            pytest.fail(f"the server did not start:\n{log.read_text(errors='replace')[-3000:]}")
        yield url
        assert "Traceback" not in log.read_text(errors="replace"), log.read_text(errors="replace")[-5000:]
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_the_document_publishes_bodies_answers_and_limits() -> None:
    """Request bodies come from the pydantic models, every status a route answers with is documented."""
    from viasd.engine import Engine, EngineSpec
    from viasd.models.loading import LoadedModel
    from viasd.serve.app import create_app
    from viasd.serve.settings import ServeSettings

    loaded = LoadedModel(model=tiny_model(vocab_size=VOCAB), tokenizer=tiny_chat_tokenizer(VOCAB), name="t", path="t")
    engine = Engine(EngineSpec(target="t", device="cpu"), target=loaded)
    settings = ServeSettings(
        model_id="t", methods=("plain", "lookup"), api_key=KEY, max_tokens_limit=MAX_TOKENS_LIMIT, default_max_tokens=4
    )
    with TestClient(create_app(engine, settings)) as client:
        doc = client.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    schemas = doc["components"]["schemas"]
    paths = doc["paths"]

    def responses(path: str, method: str) -> dict[str, Any]:
        return paths[path][method]["responses"]

    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest")):
        body = paths[path]["post"]["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"
        }
        answers = responses(path, "post")
        assert {"200", "400", "401", "404", "413", "503"} <= answers.keys()
        for status in ("400", "401", "404", "413", "503"):
            assert answers[status]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"
            }
        assert "text/event-stream" in answers["200"]["content"] and "Retry-After" in answers["503"]["headers"]
        assert paths[path]["post"]["security"] == [{"apiKey": []}]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"maximum": 2.0, "minimum": 0.0, "type": "number"} in chat["temperature"]["anyOf"]
    assert {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS_LIMIT} in chat["max_tokens"]["anyOf"]
    assert {"type": "string", "enum": ["plain", "lookup"]} in chat["method"]["anyOf"]
    assert chat["messages"]["items"] == {"$ref": "#/components/schemas/ChatMessage"}
    prompt_ids = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"][2]["items"]
    assert prompt_ids == {"type": "integer", "minimum": 0, "maximum": VOCAB - 1}
    for path, model in (("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        assert paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"
        }
        assert {"200", "400", "401", "404", "413"} == responses(path, "post").keys()
    assert [branch["required"] for branch in schemas["TokenizeRequest"]["oneOf"]] == [["prompt"], ["messages"]]
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] == {
        "type": "integer",
        "minimum": 0,
        "maximum": VOCAB - 1,
    }
    assert "token_strs" not in schemas["TokenizeResponse"].get("required", [])
    assert {"200", "401"} == responses("/version", "get").keys()
    assert "404" in responses("/v1/models/{model_id}", "get") and "401" in responses("/metrics", "get")
    assert "security" not in paths["/health"]["get"]
    assert not [(p, m) for p, item in paths.items() for m, op in item.items() if "422" in op["responses"]]
    assert "HTTPValidationError" not in schemas and doc["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"


def test_schemathesis_finds_nothing_on_a_running_server(server: str, tmp_path: Path) -> None:
    """Positive and negative cases, boundary values, fuzzing and stateful sequences on every operation."""
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "run", f"{server}/openapi.json"),
        *("--header", f"Authorization: Bearer {KEY}", "--checks", CHECKS, "--max-examples", str(MAX_EXAMPLES)),
        # A fixed seed keeps the run repeatable; the health check is about the generator's own filtering.
        *("--seed", "1", "--workers", "1", "--suppress-health-check", "filter_too_much"),
        *("--report", "junit", "--report-dir", str(tmp_path)),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-8000:]
    assert "No issues found" in output and "9 selected / 9 total" in output, output[-3000:]


@pytest.mark.parametrize(
    ("path", "base", "accepted"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t3 t4"}]}, [False, True, None]),
        ("/v1/completions", {"prompt": "t3 t4"}, [0, 0.0, 1, 5, None]),
    ],
    ids=["chat: a boolean", "completions: an integer"],
)
def test_the_schema_and_the_validation_agree_on_logprobs(path: str, base: dict[str, Any], accepted: list[Any]) -> None:
    """OpenAI's types: `logprobs` is a boolean in chat completions and an integer in legacy completions. Each value is
    accepted by both the published schema and the server, or refused by both (400, one line naming logprobs)."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    from viasd.engine import Engine, EngineSpec
    from viasd.models.loading import LoadedModel
    from viasd.serve.app import create_app
    from viasd.serve.settings import ServeSettings

    loaded = LoadedModel(model=tiny_model(vocab_size=VOCAB), tokenizer=tiny_chat_tokenizer(VOCAB), name="t", path="t")
    engine = Engine(EngineSpec(target="t", device="cpu"), target=loaded)
    settings = ServeSettings(model_id="t", methods=("plain",), max_tokens_limit=MAX_TOKENS_LIMIT, default_max_tokens=1)
    with TestClient(create_app(engine, settings)) as client:
        doc = client.get("/openapi.json").json()
        request = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        schema = jsonschema_rs.validator_for({**request, "components": doc["components"]})
        for value in (0, False, True, 1, 5, 6, -1, "0", "false", None, 0.0, 0.5, [], {}):
            body = {**base, "logprobs": value, "max_tokens": 1}
            answer = client.post(path, json=body)
            published = schema.is_valid(body)
            assert published == (answer.status_code == 200), (value, published, answer.status_code, answer.text)
            assert published == (value in accepted and type(value) in {type(a) for a in accepted}), value
            if not published:
                message = answer.json()["error"]["message"]
                assert answer.status_code == 400 and "logprobs" in message and "\n" not in message, message


CHAT_BODY = {"messages": [{"role": "user", "content": "t3 t4"}]}


@pytest.mark.parametrize(
    ("path", "field", "values"),
    [
        ("/v1/completions", "presence_penalty", [0, 0.5, -2, 2, 2.5, -3, "1", True, None]),
        ("/v1/chat/completions", "repetition_penalty", [1, 0.5, 1.7, 0, -1, "1", None]),
        ("/v1/completions", "min_p", [0, 0.5, 1, 1.5, -0.1, None]),
        ("/v1/chat/completions", "logit_bias", [{}, {"3": 5}, {"3": -100}, {"3": 101}, {"x": 1}, {"3": "1"}, [], None]),
        ("/v1/completions", "stop_token_ids", [[], [3], [VOCAB - 1], [VOCAB], [-1], ["3"], [1.5], None]),
        ("/v1/completions", "guided_json", [None, "x", 0, []]),
        ("/v1/completions", "guided_regex", [None, "x", 0]),
        ("/v1/chat/completions", "spaces_between_special_tokens", [True, False, None, 1]),
        ("/v1/chat/completions", "length_penalty", [1, 1.0, 0.5, None]),
        ("/v1/completions", "use_beam_search", [False, True, None]),
        (
            "/v1/chat/completions",
            "chat_template_kwargs",
            [{}, {"enable_thinking": False}, {"tokenize": True}, [], None],
        ),
        ("/v1/chat/completions", "add_generation_prompt", [True, False, None, "yes"]),
        ("/v1/completions", "truncate_prompt_tokens", [1, 5, 0, -1, None]),
        ("/v1/completions", "frobnicate", [1, None, "x"]),
    ],
)
def test_the_schema_and_the_validation_agree_on_penalties_and_extensions(
    path: str, field: str, values: list[Any]
) -> None:
    """Each value of a penalty or a vLLM extension (and of a field no API defines) is accepted by both the published
    schema and the server, or refused by both."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    from viasd.engine import Engine, EngineSpec
    from viasd.models.loading import LoadedModel
    from viasd.serve.app import create_app
    from viasd.serve.settings import ServeSettings

    loaded = LoadedModel(model=tiny_model(vocab_size=VOCAB), tokenizer=tiny_chat_tokenizer(VOCAB), name="t", path="t")
    engine = Engine(EngineSpec(target="t", device="cpu"), target=loaded)
    settings = ServeSettings(model_id="t", methods=("plain",), max_tokens_limit=MAX_TOKENS_LIMIT, default_max_tokens=1)
    base = CHAT_BODY if "chat" in path else {"prompt": "t3 t4"}
    with TestClient(create_app(engine, settings)) as client:
        doc = client.get("/openapi.json").json()
        request = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        schema = jsonschema_rs.validator_for({**request, "components": doc["components"]})
        for value in values:
            body = {**base, field: value, "max_tokens": 1}
            answer = client.post(path, json=body)
            published = schema.is_valid(body)
            assert published == (answer.status_code == 200), (value, published, answer.status_code, answer.text)
            if answer.status_code == 400:
                assert answer.json()["error"]["param"].split(".")[0] == field, answer.text


def test_a_real_server_answers_logprobs_to_the_official_client(server: str, model_dir: Path) -> None:
    """`viasd serve` in its own process, the openai package as client: chat logprobs streamed and not agree (both
    methods), and an echoed prompt's scores are a fresh pass's log_softmax over it, the first token's null."""
    import openai
    from transformers import AutoModelForCausalLM

    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Write a Python function."}]
    common: dict[str, Any] = {"model": client.models.list().data[0].id, "max_tokens": MAX_TOKENS_LIMIT}
    answers = []
    for method in ("plain", "lookup"):
        body = {"method": method, "ignore_eos": True}
        whole = client.chat.completions.create(
            **common, messages=messages, temperature=0, logprobs=True, top_logprobs=3, extra_body=body
        ).choices[0]
        content = whole.logprobs.content
        assert len(content) == MAX_TOKENS_LIMIT and all(len(c.top_logprobs) == 3 for c in content)
        # the tokens' bytes make the text (a random model writes broken UTF-8 too: replaced alike)
        assert b"".join(bytes(c.bytes) for c in content).decode(errors="replace") == whole.message.content
        chunks = client.chat.completions.create(
            **common, messages=messages, temperature=0, logprobs=True, top_logprobs=3, stream=True, extra_body=body
        )
        streamed = [c for chunk in chunks for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content or []]
        assert [(c.token, c.top_logprobs[0].token) for c in streamed] == [
            (c.token, c.top_logprobs[0].token) for c in content
        ]
        assert all(abs(a.logprob - b.logprob) <= 1e-5 for a, b in zip(streamed, content, strict=True))
        answers.append(content)
    assert all(abs(a.logprob - b.logprob) <= 1e-5 for a, b in zip(*answers, strict=True))  # plain = lookup

    prompt = "def reverse(s):\n    return s[::-1]"
    scored = client.completions.create(**{**common, "max_tokens": 0}, prompt=prompt, echo=True, logprobs=2)
    logprobs = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and logprobs.token_logprobs[0] is None
    ids = tiny_chat_tokenizer(VOCAB)(prompt)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.inference_mode():
        rows = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
    assert len(logprobs.token_logprobs) == len(ids)
    for i in range(1, len(ids)):
        assert abs(logprobs.token_logprobs[i] - rows[i - 1, ids[i]].item()) <= 1e-4, i
