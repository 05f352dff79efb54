"""`viasd serve` end to end: a real server process, a real model (SmolLM2-135M), the official OpenAI client.

One server is started for the module (methods plain, lookup and self, fp32 so that greedy outputs of the
exact methods agree token for token, small limits so that refusals are cheap to provoke) and the CLI is
run once next to it for reference outputs. A second, short-lived server checks graceful shutdown.
Generations are kept to a few tokens: the whole file runs in about a minute on two cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

MODEL = "smollm2-135m"
KEY = "test-key-123"
CHAT_PROMPT = "What is 2+2?"
TEXT_PROMPT = "The capital of France is"
MAX_TOKENS = 8
MAX_QUEUE = 2
MAX_ACTIVE = 2  # generations at once, their passes merged
MAX_BODY = 4096
MAX_PROMPT_TOKENS = 64
MAX_TOKENS_LIMIT = 512  # large, so that a dropped stream is surely cancelled mid-generation
START_TIMEOUT = 240.0

real = pytest.mark.real  # a real model (fetched into the cache on first use, about 100 MB)
VIASD = (sys.executable, "-m", "viasd")


# --------------------------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def _env() -> dict[str, str]:
    # one intra-op thread: on a small shared CPU, OpenMP threads that spin against other processes cost more
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def launch_server(log_dir: Path, name: str, *args: str) -> Server:
    port = free_port()
    log = log_dir / f"{name}.log"
    command = [*VIASD, "serve", "--target", MODEL, "--dtype", "fp32", "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen([*command, *args], stdout=out, stderr=subprocess.STDOUT, env=_env())
    return Server(process, f"http://127.0.0.1:{port}", log)


@contextlib.contextmanager
def healthy_server(log_dir: Path, name: str, *args: str) -> Iterator[Server]:
    """A server started as `launch_server` starts it, once healthy; stopped after, its log free of tracebacks."""
    server = launch_server(log_dir, name, *args)
    try:
        wait_healthy(server)
        yield server
        assert "Traceback" not in server.log.read_text(errors="replace"), server.log_tail()
    finally:
        stop_server(server)


@contextlib.contextmanager
def real_server(log_dir: Path, *args: str) -> Iterator[Server]:
    """`viasd serve` on the default real pair with `args`, once healthy (loading it may take minutes the first time);
    stopped after, its log free of tracebacks."""
    port = free_port()
    log = log_dir / "server.log"
    with log.open("wb") as out:
        command = [*VIASD, "serve", "--port", str(port), "--no-access-log", *args]
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=_env())
    server = Server(process, f"http://127.0.0.1:{port}", log)
    try:
        wait_healthy(server, timeout=600)
        yield server
        assert "Traceback" not in log.read_text(errors="replace"), server.log_tail()
    finally:
        stop_server(server)


def wait_healthy(server: Server, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"the server exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    stop_server(server)
    pytest.fail(f"the server did not become healthy in {timeout:.0f}s:\n{server.log_tail()}")


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=10)


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_error(response: httpx.Response, status: int, *words: str) -> dict[str, Any]:
    """The response is an OpenAI-shaped error with this status whose message mentions every word."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert {"message", "type", "code"} <= error.keys()
    for word in words:
        assert word in error["message"], error["message"]
    return error


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if labels else "") + r" (\S+)$"
    for line in text.splitlines():
        match = re.match(pattern, line)
        if match:
            return float(match.group(1))
    return 0.0


def sse_payloads(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


# -------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Server logs; pytest keeps them after the run (under its basetemp) for a look when a test fails."""
    return tmp_path_factory.mktemp("serve-logs")


@pytest.fixture(scope="module")
def started(log_dir: Path) -> Iterator[tuple[Server, subprocess.Popen[bytes]]]:
    """The module's server and, loading alongside it, the CLI run that gives the reference output."""
    server = launch_server(
        log_dir,
        "server",
        "--methods",
        "plain,lookup,self",
        "--api-key",
        KEY,
        "--max-queue",
        str(MAX_QUEUE),
        "--max-active",
        str(MAX_ACTIVE),
        "--max-body-bytes",
        str(MAX_BODY),
        "--max-prompt-tokens",
        str(MAX_PROMPT_TOKENS),
        "--max-tokens-limit",
        str(MAX_TOKENS_LIMIT),
        "--default-max-tokens",
        str(MAX_TOKENS),
        "--no-access-log",
    )
    cli = subprocess.Popen(
        [
            *VIASD,
            "generate",
            "--target",
            MODEL,
            "--method",
            "plain",
            "--dtype",
            "fp32",
            "--json",
            "-n",
            str(MAX_TOKENS),
            CHAT_PROMPT,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
    )
    try:
        yield server, cli
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        stop_server(server)


@pytest.fixture(scope="module")
def server(started: tuple[Server, subprocess.Popen[bytes]]) -> Server:
    wait_healthy(started[0])
    return started[0]


@pytest.fixture(scope="module")
def reference(started: tuple[Server, subprocess.Popen[bytes]]) -> dict[str, Any]:
    """`viasd generate --method plain --json` for the chat prompt: the output the server must match."""
    out, err = started[1].communicate(timeout=START_TIMEOUT)
    assert started[1].returncode == 0, err.decode(errors="replace")[-3000:]
    return json.loads(out)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def chat(client: openai.OpenAI, max_tokens: int = MAX_TOKENS, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": CHAT_PROMPT}],
        max_tokens=max_tokens,
        temperature=0,
        **kwargs,
    )


# ----------------------------------------------------------------------------------------------- tests


@real
def test_health_and_models(server: Server, client: openai.OpenAI) -> None:
    health = httpx.get(f"{server.url}/health", timeout=10).json()  # open without a key, for probes
    assert health["status"] == "ok" and health["methods"] == ["plain", "lookup", "self"]
    assert health["queue"]["capacity"] == MAX_QUEUE + MAX_ACTIVE
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


@real
def test_chat_greedy_equals_the_cli(client: openai.OpenAI, reference: dict[str, Any]) -> None:
    response = chat(client)
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == reference["text"]
    assert choice.finish_reason == ("length" if reference["finish_reason"] == "length" else "stop")
    usage = response.usage.model_dump()
    assert usage["prompt_tokens"] == reference["stats"]["prompt_tokens"]
    assert usage["completion_tokens"] == len(reference["tokens"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    spec = usage["speculative"]
    assert spec["method"] == "plain" and spec["new_tokens"] == len(reference["tokens"])
    assert spec["target_calls"] >= 1 and "rejection_rate" in spec and "tiers" in spec


@real
def test_chat_streaming_with_lookup_equals_the_cli(client: openai.OpenAI, reference: dict[str, Any]) -> None:
    stream = chat(client, stream=True, stream_options={"include_usage": True}, extra_body={"method": "lookup"})
    pieces: list[str] = []
    finish: list[str] = []
    usage: dict[str, Any] = {}
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    assert "".join(pieces) == reference["text"]  # lookup is exact: greedy output equals plain decoding
    assert len(finish) == 1
    assert usage["completion_tokens"] == len(reference["tokens"])
    assert usage["speculative"]["method"] == "lookup"


@real
def test_self_speculative_method_is_exact(client: openai.OpenAI, reference: dict[str, Any]) -> None:
    response = chat(client, max_tokens=4, extra_body={"method": "self"})
    assert reference["text"].startswith(response.choices[0].message.content)
    spec = response.usage.model_dump()["speculative"]
    assert spec["method"] == "self" and spec["new_tokens"] == 4 and spec["drafted"] > 0


@real
def test_completions_streaming_and_not_agree(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=4, temperature=0)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 4
    text = full.choices[0].text
    assert text.strip()
    streamed = client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=4, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    # a prompt may also be given as token ids
    by_ids = client.completions.create(model=MODEL, prompt=[504, 2988, 288], max_tokens=1, temperature=0)
    assert by_ids.usage.prompt_tokens == 3 and by_ids.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[10**9], max_tokens=1)


@real
def test_raw_sse_format(server: Server) -> None:
    body = {"prompt": TEXT_PROMPT, "max_tokens": 2, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=auth(), json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = list(sse_payloads(response.iter_lines()))
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@real
def test_wrong_or_missing_api_key_is_refused(server: Server) -> None:
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-the-key", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert_error(httpx.get(f"{server.url}/v1/models", timeout=10), 401, "API key")
    response = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers=auth("nope"), timeout=10)
    assert_error(response, 401)  # the key is checked before the body is read
    assert_error(httpx.get(f"{server.url}/metrics", headers=auth("nope"), timeout=10), 401)


@real
def test_malformed_and_invalid_requests_are_400(server: Server, client: openai.OpenAI) -> None:
    url = f"{server.url}/v1/chat/completions"
    error = assert_error(httpx.post(url, content=b'{"messages": [', headers=auth(), timeout=10), 400, "not valid JSON")
    assert error["type"] == "invalid_request_error"
    assert_error(httpx.post(url, content=b"", headers=auth(), timeout=10), 400, "empty")
    assert_error(httpx.post(url, json={"model": MODEL}, headers=auth(), timeout=10), 400, "messages")
    messages = [{"role": "user", "content": "hi"}]
    for extra, words in (
        ({"temperature": 7}, ("temperature",)),
        ({"n": 2}, ("n=1",)),
        ({"messages": [{"role": "wizard", "content": "x"}]}, ("role",)),
        ({"messages": [{"role": "tool", "content": "x"}]}, ("tool_call_id",)),
        ({"messages": [{"role": "user", "content": "   "}]}, ("empty",)),
    ):
        response = httpx.post(url, json={"messages": messages, **extra}, headers=auth(), timeout=10)
        assert_error(response, 400, *words)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=1)
    assert_error(httpx.get(f"{server.url}/v1/nothing", headers=auth(), timeout=10), 404, "no such endpoint")


@real
def test_unknown_or_unloaded_method_is_400(client: openai.OpenAI) -> None:
    for method in ("sd", "bogus"):
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, max_tokens=1, extra_body={"method": method})
        assert "not loaded" in caught.value.message and "plain, lookup, self" in caught.value.message


@real
def test_limits_body_prompt_and_max_tokens(server: Server, client: openai.OpenAI) -> None:
    url = f"{server.url}/v1/chat/completions"
    big = {"messages": [{"role": "user", "content": "x" * (2 * MAX_BODY)}]}
    assert_error(httpx.post(url, json=big, headers=auth(), timeout=10), 413, str(MAX_BODY))

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(2 * MAX_BODY // 512):
            yield b"y" * 512
        yield b'"}]}'

    assert_error(httpx.post(url, content=chunked(), headers=auth(), timeout=10), 413, "--max-body-bytes")

    long_prompt = " ".join(["word"] * (2 * MAX_PROMPT_TOKENS))  # fits the body limit, not the token limit
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_prompt}], max_tokens=1)
    assert f"at most {MAX_PROMPT_TOKENS}" in caught.value.message and "prompt" in caught.value.message

    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, max_tokens=MAX_TOKENS_LIMIT + 1)
    assert f"at most {MAX_TOKENS_LIMIT}" in caught.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=MAX_TOKENS_LIMIT + 1
        )


def wait_idle(server: Server, timeout: float = 60.0) -> str:
    """Poll /metrics until nothing runs or waits; returns the metrics text."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{server.url}/metrics", headers=auth(), timeout=10).text
        if metric(text, "viasd_requests_running") == 0 and metric(text, "viasd_queue_depth") == 0:
            return text
        assert time.monotonic() < deadline, f"the server is still busy:\n{text}"
        time.sleep(0.2)


@real
def test_client_dropping_mid_stream_frees_the_model(
    server: Server, client: openai.OpenAI, reference: dict[str, Any]
) -> None:
    before = wait_idle(server)
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": MAX_TOKENS_LIMIT,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=auth(), json=body, timeout=60) as response:
        assert response.status_code == 200
        for payload in sse_payloads(response.iter_lines()):
            if json.loads(payload)["choices"][0]["delta"].get("content"):
                break  # got real text: now hang up mid-generation
    after = wait_idle(server, timeout=60)
    cancelled = metric(after, "viasd_generations_cancelled_total", method="plain")
    assert cancelled == metric(before, "viasd_generations_cancelled_total", method="plain") + 1
    generated = metric(after, "viasd_generated_tokens_total", method="plain")
    assert generated == metric(before, "viasd_generated_tokens_total", method="plain")  # it never finished
    # the same for a client that gives up waiting for a non-streamed answer
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", headers=auth(), json={**body, "stream": False}, timeout=1.0)
    final = wait_idle(server, timeout=60)
    assert metric(final, "viasd_generations_cancelled_total", method="plain") == cancelled + 1
    assert metric(final, "viasd_generated_tokens_total", method="plain") == generated
    # and the model serves the next request, correctly
    response = chat(client, max_tokens=3)
    assert reference["text"].startswith(response.choices[0].message.content)


@real
def test_bounded_burst_is_answered_or_refused(server: Server, reference: dict[str, Any]) -> None:
    wait_idle(server)
    expected = httpx.post(
        f"{server.url}/v1/completions",
        headers=auth(),
        json={"prompt": TEXT_PROMPT, "max_tokens": 2, "temperature": 0},
        timeout=120,
    ).json()["choices"][0]["text"]
    outcomes: list[tuple[int, str]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def worker(index: int) -> None:
        with httpx.Client(timeout=httpx.Timeout(120.0, connect=10.0)) as http:
            barrier.wait(timeout=30)  # all threads fire at once
            for attempt in range(4):
                body = {"prompt": TEXT_PROMPT, "max_tokens": 2, "temperature": 0, "stream": (index + attempt) % 2 == 1}
                response = http.post(f"{server.url}/v1/completions", headers=auth(), json=body)
                if response.status_code == 200 and body["stream"]:
                    payloads = list(sse_payloads(response.text.splitlines()))
                    assert payloads[-1] == "[DONE]"
                    text = "".join(c["choices"][0]["text"] for c in map(json.loads, payloads[:-1]) if c["choices"])
                elif response.status_code == 200:
                    text = response.json()["choices"][0]["text"]
                else:
                    text = response.json()["error"]["code"]
                with lock:
                    outcomes.append((response.status_code, text))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a request hung"
    assert len(outcomes) == 32
    answered = [text for status, text in outcomes if status == 200]
    refused = [text for status, text in outcomes if status == 503]
    assert len(answered) + len(refused) == 32, outcomes
    assert answered and all(text == expected for text in answered)
    assert refused and set(refused) == {"queue_full"}
    text = wait_idle(server)
    assert metric(text, "viasd_http_requests_total", path="/v1/completions", status="503") == len(refused)
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health["queue"]["waiting"] == 0 and health["queue"]["running"] == 0
    response = httpx.post(
        f"{server.url}/v1/completions",
        headers=auth(),
        json={"prompt": TEXT_PROMPT, "max_tokens": 2, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected


@real
def test_metrics_report_requests_tokens_and_speculation(server: Server, client: openai.OpenAI) -> None:
    chat(client, max_tokens=4, extra_body={"method": "lookup"})
    response = httpx.get(f"{server.url}/metrics", headers=auth(), timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    text = response.text
    for family in (
        "viasd_http_requests_total",
        "viasd_generated_tokens_total",
        "viasd_tokens_per_second",
        "viasd_target_calls_per_token",
        "viasd_rejection_rate",
        "viasd_tier_fraction",
        "viasd_queue_depth",
    ):
        assert f"# TYPE {family} " in text
    assert metric(text, "viasd_http_requests_total", path="/v1/chat/completions", status="200") >= 3
    assert metric(text, "viasd_http_requests_total", path="/v1/chat/completions", status="400") >= 1
    assert metric(text, "viasd_http_requests_total", path="/v1/chat/completions", status="413") >= 2
    assert metric(text, "viasd_http_requests_total", path="/v1/models", status="401") >= 1
    assert metric(text, "viasd_generated_tokens_total", method="lookup") >= 4
    assert metric(text, "viasd_tokens_per_second", method="plain") > 0
    assert 1.0 <= metric(text, "viasd_target_calls_per_token", method="plain") <= 1.5
    assert 0.0 <= metric(text, "viasd_rejection_rate", method="lookup") <= 1.0
    assert metric(text, "viasd_draft_tokens_total", method="self") > 0
    assert metric(text, "viasd_queue_capacity") == MAX_QUEUE + MAX_ACTIVE


@real
def test_sigterm_drains_the_in_flight_stream_then_exits(log_dir: Path) -> None:
    server = launch_server(log_dir, "drain", "--methods", "plain", "--shutdown-timeout", "60", "--no-access-log")
    try:
        wait_healthy(server)
        body = {
            "prompt": TEXT_PROMPT,
            "max_tokens": 48,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
            lines = sse_payloads(response.iter_lines())
            next(lines)
            server.process.send_signal(signal.SIGTERM)  # mid-stream
            time.sleep(0.5)
            with pytest.raises(httpx.TransportError):  # no new connections while it drains
                httpx.get(f"{server.url}/health", timeout=5)
            rest = list(lines)
        assert rest[-1] == "[DONE]"
        chunks = [json.loads(p) for p in rest[:-1]]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 48  # the in-flight request was served in full
        server.process.wait(timeout=60)
        assert "Shutting down" in server.log_tail()
    finally:
        stop_server(server)


PAIR_PROMPTS = [
    "Translate to German: The cat sleeps on the warm windowsill.",
    "Write a Python function that returns the largest of three numbers.",
    "Summarize in one sentence: the meeting moved to Friday because the room was booked.",
    "What is the boiling point of water at sea level, in Celsius?",
    "List three primary colors.",
    "Explain recursion to a child in two sentences.",
    "def fibonacci(n):",
    "Name a prime number between 10 and 20 and say why it is prime.",
]


@real
def test_the_real_pair_served_to_eight_at_once_answers_each_as_alone(log_dir: Path) -> None:
    """The default pair in the 4-bit fast mode (row-independent kernels), plain and speculative requests mixed,
    streamed and not, eight at once through the official client: every text is the one it gets alone."""
    methods = ["plain:quant=gguf", "sd:quant=gguf:drafter=hybrid:drafter_quant=int4a8"]
    server = launch_server(
        log_dir, "pair", "--target", "qwen2.5-coder-1.5b", "--dtype", "auto", "--methods", ",".join(methods),
        "--max-active", "8", "--no-access-log",
    )  # fmt: skip
    try:
        wait_healthy(server)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300)

        def ask(index: int) -> str:
            request = {
                "model": "qwen2.5-coder-1.5b",
                "messages": [{"role": "user", "content": PAIR_PROMPTS[index]}],
                "max_tokens": 24,
                "temperature": 0,
                "extra_body": {"method": methods[index % 2]},
            }
            if index % 3 == 0:
                chunks = client.chat.completions.create(**request, stream=True)
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return client.chat.completions.create(**request).choices[0].message.content or ""

        alone = [ask(i) for i in range(8)]
        together: list[str | None] = [None] * 8
        start = threading.Barrier(8)

        def run(index: int) -> None:
            start.wait(timeout=60)
            together[index] = ask(index)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert together == alone and all(alone)
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert sum(metric(text, "viasd_generations_total", method=m) for m in methods) == 16  # none lost
    finally:
        stop_server(server)


# ------------------------------------------------------------------------- fast tests, no real model


@pytest.fixture
def tiny_app() -> Iterator[TestClient]:
    """The app in process over a tiny random model (no chat template: prompts are plain text)."""
    from tiny import tiny_model, tiny_tokenizer
    from viasd.engine import Engine, EngineSpec
    from viasd.models.loading import LoadedModel
    from viasd.serve.app import create_app
    from viasd.serve.settings import ServeSettings

    loaded = LoadedModel(model=tiny_model(), tokenizer=tiny_tokenizer(64), name="tiny", path="tiny")
    engine = Engine(EngineSpec(target="tiny", device="cpu"), target=loaded)
    settings = ServeSettings(model_id="tiny", methods=("lookup", "plain"), max_tokens_limit=16, default_max_tokens=4)
    with TestClient(create_app(engine, settings)) as test_client:
        yield test_client


def tiny_model_dir(directory: Path) -> Path:
    """A tiny random model with a chat tokenizer saved where `viasd serve --target` loads it; its context is long
    (RoPE has no table to outgrow), so that a generation can outlast a drain."""
    import torch

    from tiny import tiny_chat_tokenizer, tiny_model

    tiny_model(vocab_size=320, dtype=torch.float32).save_pretrained(directory)
    tiny_chat_tokenizer(320).save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1 << 20}))
    return directory


def test_requests_still_running_when_the_drain_ends_are_told_so(tmp_path: Path) -> None:
    """SIGTERM while a stream and a plain request run longer than --shutdown-timeout: at its end the stream gets an
    error event and [DONE] (not a cut connection) and the plain request a 503, and the log says so in one line."""
    model = tiny_model_dir(tmp_path / "model")
    server = launch_server(
        tmp_path, "drain-ends", "--target", str(model), "--device", "cpu", "--methods", "plain",
        "--max-tokens-limit", "1000000", "--shutdown-timeout", "1.5", "--no-access-log",
    )  # fmt: skip
    body = {"prompt": "hello", "max_tokens": 1000000, "temperature": 0, "ignore_eos": True}
    answers: list[httpx.Response] = []
    try:
        wait_healthy(server)
        plain = threading.Thread(
            target=lambda: answers.append(httpx.post(f"{server.url}/v1/completions", json=body, timeout=60))
        )
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as got:
            lines = sse_payloads(got.iter_lines())
            plain.start()
            next(lines), next(lines)
            time.sleep(0.5)  # the plain request is running too
            server.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            rest = list(lines)  # a cut connection raises here
            ended = time.monotonic() - signalled
        plain.join(timeout=30)
        assert rest[-1] == "[DONE]", rest[-3:]
        error = json.loads(rest[-2])["error"]
        assert error["code"] == "shutting_down" and "--shutdown-timeout" in error["message"], error
        assert all("choices" in json.loads(p) for p in rest[:-2])  # text until then, no finish reason
        assert 1.5 <= ended < 15, ended  # the drain lasted --shutdown-timeout
        assert_error(answers[0], 503, "--shutdown-timeout")
        assert answers[0].json()["error"]["code"] == "shutting_down"
        assert server.process.wait(timeout=30) is not None
        log = server.log.read_text(errors="replace")
        assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
        assert len([line for line in log.splitlines() if "--shutdown-timeout" in line]) == 1, log[-3000:]
    finally:
        stop_server(server)


def test_in_process_app_serves_streams_and_counts(tiny_app: TestClient) -> None:
    body = {"prompt": "t3 t4 t5 t3 t4", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    plain = tiny_app.post("/v1/completions", json={**body, "method": "plain"}).json()
    lookup = tiny_app.post("/v1/completions", json=body).json()  # the default method: the first loaded
    assert lookup["usage"]["speculative"]["method"] == "lookup"
    assert lookup["choices"][0]["text"] == plain["choices"][0]["text"]  # exact method, greedy
    assert plain["usage"]["completion_tokens"] == 6 and plain["choices"][0]["finish_reason"] == "length"
    with tiny_app.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        payloads = list(sse_payloads(response.iter_lines()))
    assert payloads[-1] == "[DONE]"
    text = "".join(c["choices"][0]["text"] for c in map(json.loads, payloads[:-1]))
    assert text == plain["choices"][0]["text"]
    chat = tiny_app.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "t7 t8"}]}).json()
    assert chat["usage"]["completion_tokens"] <= 4  # --default-max-tokens
    assert_error(tiny_app.post("/v1/completions", json={**body, "max_tokens": 17}), 400, "at most 16")
    text = tiny_app.get("/metrics").text
    assert metric(text, "viasd_generations_total", method="lookup") == 3
    assert metric(text, "viasd_http_requests_total", path="/v1/completions", status="400") == 1
    assert metric(text, "viasd_target_calls_per_token", method="plain") == 1.0


def test_numeric_edge_values_are_served_or_refused_never_500(tiny_app: TestClient) -> None:
    """Underflowing temperatures and top_p sample the argmax; out-of-range seeds and NaN/Infinity get a 400
    that names the field and its range."""
    body = {"prompt": "t3 t4 t5 t3 t4", "max_tokens": 5, "ignore_eos": True}
    greedy = tiny_app.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
    for extra in (
        {"temperature": 1e-300},
        {"temperature": 1e-40, "top_p": 0.3, "top_k": 2},
        {"temperature": 0.5, "top_p": 1e-300},
        {"temperature": 1e-300, "seed": -(2**63)},
        {"temperature": 1e-300, "seed": 2**64 - 1},
    ):
        response = tiny_app.post("/v1/completions", json={**body, **extra})
        assert response.status_code == 200, (extra, response.text)
        assert response.json()["choices"][0]["text"] == greedy, extra
    for seed in (2**64, -(2**63) - 1, 10**30):
        assert_error(tiny_app.post("/v1/completions", json={**body, "seed": seed}), 400, "seed must be an integer in")
    for raw, words in (
        ('{"prompt": "t3", "temperature": NaN}', ("temperature must be a finite number in [0, 2]", "NaN")),
        ('{"prompt": "t3", "temperature": Infinity}', ("temperature must be a finite number in [0, 2]", "Infinity")),
        ('{"prompt": "t3", "top_p": -Infinity}', ("top_p must be a finite number in (0, 1]", "-Infinity")),
        ('{"prompt": "t3", "temperature": 2.5}', ("temperature must be a finite number in [0, 2], got 2.5",)),
        ('{"messages": [{"role": "user", "content": "t3"}], "top_p": NaN}', ("top_p", "NaN")),
    ):
        path = "/v1/chat/completions" if "messages" in raw else "/v1/completions"
        error = assert_error(tiny_app.post(path, content=raw), 400, *words)
        assert error["param"] == words[0].split()[0]
    text = tiny_app.get("/metrics").text
    assert metric(text, "viasd_http_requests_total", path="/v1/completions", status="500") == 0


CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t3 t4"}], "max_tokens": 2})
TEXT = ("/v1/completions", {"prompt": "t3 t4", "max_tokens": 2})
OPENED = (CHAT[0], {**CHAT[1], "add_generation_prompt": True})


@pytest.mark.parametrize(
    ("request_", "field", "value", "words"),
    [
        (TEXT, "max_tokens", True, "max_tokens must be an integer, got true"),
        (TEXT, "max_tokens", "8", 'max_tokens must be an integer, got "8"'),
        (TEXT, "max_tokens", 8.5, "max_tokens must be an integer, got 8.5"),
        (CHAT, "max_completion_tokens", "8", "max_completion_tokens must be an integer"),
        (TEXT, "n", True, "n must be an integer"),
        (TEXT, "seed", "7", "seed must be an integer"),
        (TEXT, "top_k", False, "top_k must be an integer"),
        (CHAT, "temperature", "0", 'temperature must be a number, got "0"'),
        (TEXT, "top_p", True, "top_p must be a number"),
        (TEXT, "stream", "true", 'stream must be a boolean (true or false), got "true"'),
        (TEXT, "ignore_eos", 1, "ignore_eos must be a boolean"),
        (TEXT, "stream_options", {"include_usage": "yes"}, "stream_options.include_usage must be a boolean"),
        (TEXT, "model", 7, "model must be a string, got 7"),
        (TEXT, "prompt", [True], "prompt"),
        (CHAT, "messages", [{"role": "user", "content": 5}], "messages.0.content"),
        (CHAT, "top_logprobs", 21, "top_logprobs must be an integer in [0, 20], got 21"),
        (CHAT, "top_logprobs", 0, "top_logprobs: needs logprobs"),
        (CHAT, "tool_choice", "required", "tool_choice forces a call but no tools are offered"),
        (CHAT, "tool_choice", {"type": "function", "function": {"name": "f"}}, "no tools are offered"),
        (CHAT, "tool_choice", {"type": "function", "function": "f"}, "a named function is"),
        (CHAT, "tools", [{"type": "function", "function": {"name": "f"}}], "chat template offers no tools"),
        (CHAT, "tools", [{"type": "function", "function": {"name": "f g"}}], "must be 1 to 64 letters"),
        (CHAT, "function_call", {"name": "f"}, "functions are not supported"),
        (CHAT, "audio", {"voice": "alloy", "format": "wav"}, "audio output is not supported"),
        (CHAT, "modalities", ["text", "audio"], "only text output is supported"),
        (CHAT, "prediction", {"type": "content", "content": "t3"}, "predicted outputs are not supported"),
        (CHAT, "reasoning_effort", "low", "this model does not reason"),
        (CHAT, "verbosity", "low", "verbosity is not supported"),
        (CHAT, "web_search_options", {}, "web search is not supported"),
        (CHAT, "store", True, "completions are not stored"),
        (CHAT, "service_tier", "priority", "service tiers are not offered"),
        (TEXT, "frequency_penalty", 3, "frequency_penalty must be a finite number in [-2, 2], got 3"),
        (CHAT, "presence_penalty", -2.5, "presence_penalty must be a finite number in [-2, 2]"),
        (TEXT, "repetition_penalty", 0, "repetition_penalty must be a finite number > 0"),
        (TEXT, "min_p", 1.5, "min_p must be a finite number in [0, 1]"),
        (TEXT, "min_tokens", -1, "min_tokens must be an integer >= 0"),
        (TEXT, "min_tokens", 3, "min_tokens (3) exceeds max_tokens (2)"),
        (TEXT, "logit_bias", {"t3": 1}, "keys must be token ids"),
        (TEXT, "logit_bias", {"3": 101}, "values must be numbers in [-100, 100]"),
        (CHAT, "logit_bias", {"64": 1}, "token id 64 is outside the vocabulary (0..63)"),
        (TEXT, "stop_token_ids", [64], "token id 64 is outside the vocabulary"),
        (TEXT, "stop_token_ids", [-1], "token ids must be >= 0"),
        (CHAT, "guided_json", {"type": "object"}, "structured output cannot read this tokenizer"),  # word-level
        (TEXT, "structured_outputs", {"regex": "t[0-9]"}, "only 'json' (a JSON schema) is supported"),
        (TEXT, "guided_regex", "t[0-9]", "guided decoding is not supported"),
        (CHAT, "guided_choice", ["t3", "t4"], "guided decoding is not supported"),
        (CHAT, "guided_grammar", "root ::= x", "guided decoding is not supported"),
        (CHAT, "guided_decoding_backend", "xgrammar", "guided decoding is not supported"),
        (TEXT, "prompt_logprobs", 1, "prompt_logprobs is not supported (echo with logprobs scores the prompt)"),
        (CHAT, "best_of", 2, "only best_of=1"),
        (TEXT, "use_beam_search", True, "beam search is not supported"),
        (CHAT, "length_penalty", 0.8, "needs beam search"),
        (CHAT, "response_format", {"type": "json_object"}, "structured output cannot read this tokenizer"),
        (TEXT, "response_format", {"type": "json_schema"}, "needs a json_schema object"),
        (CHAT, "response_format", {"type": "yaml"}, "type must be one of 'text', 'json_object', 'json_schema'"),
        (CHAT, "spaces_between_special_tokens", False, "only true is supported"),
        (TEXT, "truncate_prompt_tokens", 0, "truncate_prompt_tokens must be an integer >= 1"),
        (CHAT, "chat_template", "{{ messages }}", "the model's is used"),
        (CHAT, "chat_template_kwargs", {"tokenize": True}, "'tokenize' is not a template variable"),
        (CHAT, "documents", [{"text": "x"}], "documents are not supported"),
        (CHAT, "echo", True, "echo is not supported"),
        (CHAT, "add_generation_prompt", "yes", "add_generation_prompt must be a boolean"),
        (OPENED, "continue_final_message", True, "cannot be true with add_generation_prompt true"),
        (TEXT, "include_stop_str_in_output", 1, "include_stop_str_in_output must be a boolean"),
        (TEXT, "frobnicate", 1, "frobnicate: unknown parameter"),
        (CHAT, "temprature", 0.5, "temprature: unknown parameter"),
    ],
)
def test_a_field_of_another_type_or_a_parameter_not_honoured_is_refused_naming_it(
    tiny_app: TestClient, request_: tuple[str, dict[str, Any]], field: str, value: Any, words: str
) -> None:
    """OpenAI's types, strictly (no true as 1, no "8" as 8), and no OpenAI parameter is ignored: each is honoured or
    refused with a 400 whose `param` names it."""
    path, body = request_
    error = assert_error(tiny_app.post(path, json={**body, field: value}), 400, words)
    assert error["param"] is not None and error["param"].split(".")[0] == field, error


@pytest.mark.parametrize(
    ("request_", "extra"),
    [
        (CHAT, {"temperature": 1, "top_p": 1, "top_logprobs": None, "logprobs": False, "n": 1}),
        (CHAT, {"tool_choice": "none", "parallel_tool_calls": False, "function_call": "auto", "modalities": ["text"]}),
        (CHAT, {"store": False, "metadata": {"k": "v"}, "service_tier": "auto", "reasoning_effort": None}),
        (CHAT, {"user": "u", "prompt_cache_key": "c", "safety_identifier": "s", "stream_options": None}),
        (TEXT, {"temperature": 0, "seed": -1, "stream": False, "ignore_eos": True, "logprobs": 0}),
        (TEXT, {"presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "min_p": 0.1}),
        (TEXT, {"min_tokens": 1, "logit_bias": {"3": -100, "4": 2.5}, "stop_token_ids": [5], "best_of": 1}),
        (TEXT, {"include_stop_str_in_output": True, "skip_special_tokens": False, "truncate_prompt_tokens": 1}),
        (CHAT, {"spaces_between_special_tokens": True, "use_beam_search": False, "length_penalty": 1.0, "echo": False}),
        (
            CHAT,
            {"add_generation_prompt": True, "chat_template_kwargs": {"enable_thinking": False}, "guided_json": None},
        ),
        (CHAT, {"add_generation_prompt": False, "continue_final_message": True, "response_format": {"type": "text"}}),
    ],
)
def test_parameters_at_their_openai_types_and_honoured_values_are_served(
    tiny_app: TestClient, request_: tuple[str, dict[str, Any]], extra: dict[str, Any]
) -> None:
    path, body = request_
    response = tiny_app.post(path, json={**body, **extra})
    assert response.status_code == 200, response.text


def test_metrics_render_tiers_and_escape_labels() -> None:
    from viasd.decode.stats import GenerationStats, TierStats
    from viasd.serve.metrics import Metrics

    metrics = Metrics(["via"])
    stats = GenerationStats(method="via", prompt_tokens=5, new_tokens=10, target_calls=4, total_seconds=2.0)
    stats.evaluated, stats.accepted = 8, 6
    stats.tiers = {"accept": TierStats(decided=3, accepted=3), "slim": TierStats(decided=1), "full": TierStats(4, 3, 1)}
    metrics.record("via", stats)
    metrics.count_request('/odd"path', 200)
    text = metrics.render(waiting=2, running=1, capacity=5)
    assert metric(text, "viasd_tier_fraction", method="via", tier="accept") == 0.375
    assert metric(text, "viasd_tier_fraction", method="via", tier="full") == 0.5
    assert metric(text, "viasd_rejection_rate", method="via") == 0.25
    assert metric(text, "viasd_target_calls_per_token", method="via") == 0.4
    assert metric(text, "viasd_tokens_per_second", method="via") == 5.0
    assert metric(text, "viasd_queue_depth") == 2 and metric(text, "viasd_requests_running") == 1
    assert 'path="/odd\\"path"' in text
    for line in text.splitlines():  # every sample line is `name{labels} number`
        assert line.startswith("# ") or re.match(r"^[a-z_:][a-z0-9_:]*(\{[^}]*\})? -?[0-9.e+-]+$", line), line


def test_settings_and_requests_are_validated() -> None:
    from pydantic import ValidationError

    from viasd.errors import ViasdError
    from viasd.serve.schemas import ChatCompletionRequest, CompletionRequest
    from viasd.serve.settings import ServeSettings, parse_methods

    assert parse_methods(" sd, plain ,") == ("sd", "plain")
    variant = "via:gamma=4:pregate=0.5"
    assert ServeSettings(model_id="m", methods=("sd", variant)).methods[1] == variant
    for bad in (
        {"methods": ()},
        {"methods": ("nope",)},
        {"methods": ("sd:cap=3",)},
        {"methods": ("sd", "sd")},
        {"methods": ("sd",), "default_max_tokens": 10, "max_tokens_limit": 5},
        {"methods": ("sd",), "api_key": " "},
        {"methods": ("sd",), "max_queue": -1},
        {"methods": ("sd",), "prefix_cache_mb": -1},
        {"methods": ("sd",), "shutdown_timeout": -1},
        {"methods": ("sd",), "shutdown_timeout": float("nan")},
    ):
        with pytest.raises(ViasdError):
            ServeSettings(model_id="m", **bad)
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    request = ChatCompletionRequest.model_validate({"messages": messages, "stop": "x", "max_completion_tokens": 3})
    assert request.messages[0].as_prompt_message() == {"role": "user", "content": "ab"}
    assert request.stop_strings() == ("x",) and request.requested_max_tokens() == 3
    developer = ChatCompletionRequest.model_validate({"messages": [{"role": "developer", "content": "be brief"}]})
    assert developer.messages[0].as_prompt_message()["role"] == "system"
    for bad_body in (
        {"messages": []},
        {"messages": messages, "n": 3},
        {"messages": messages, "presence_penalty": 2.5},
        {"messages": messages, "tools": [{"type": "function"}]},
        {"messages": messages, "stop": [""]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    ):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate(bad_body)
    for bad_body in ({"prompt": ["a", "b"]}, {"prompt": []}, {"prompt": "a", "logprobs": 6}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(bad_body)


def test_concurrent_requests_are_batched_and_each_gets_what_it_gets_alone(tmp_path, monkeypatch) -> None:
    """Eight requests at once (greedy, plain decoding and prompt lookup, streamed and not) on an app that runs four
    generations together: every answer is the text the same request gets alone, and passes were merged."""
    from tiny import tiny_model, tiny_tokenizer
    from viasd.engine import Engine, EngineSpec
    from viasd.models.loading import LoadedModel
    from viasd.passes.batching import batcher_of
    from viasd.serve.app import create_app
    from viasd.serve.settings import ServeSettings
    from viasd.views.recipe import QuantRecipe

    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path))
    loaded = LoadedModel(model=tiny_model(), tokenizer=tiny_tokenizer(64), name="tiny", path="tiny")
    # The 4-bit view: viasd's kernels give a row the same bits whatever else is in its pass.
    engine = Engine(EngineSpec(target="tiny", device="cpu", quant=QuantRecipe.parse("int4a8")), target=loaded)
    settings = ServeSettings(
        model_id="tiny", methods=("plain", "lookup"), max_tokens_limit=16, default_max_tokens=4, max_active=4
    )
    prompts = ["t3 t4 t5 t6 t3 t4", "t9 t8 t7", "t20 t21 t22 t20 t21", "t5 t5 t6 t7 t8 t9 t10"]

    def body(index: int) -> dict[str, Any]:
        return {"prompt": prompts[index % 4], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "method": ("plain", "lookup")[index % 2]}  # fmt: skip

    with TestClient(create_app(engine, settings)) as app:
        alone = [app.post("/v1/completions", json=body(i)).json()["choices"][0]["text"] for i in range(8)]
        together: list[str | None] = [None] * 8
        barrier = threading.Barrier(8)

        def request(index: int) -> None:
            barrier.wait(timeout=30)
            together[index] = app.post("/v1/completions", json=body(index)).json()["choices"][0]["text"]

        threads = [threading.Thread(target=request, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        batcher = batcher_of(loaded.model)
        assert batcher is not None and batcher.merged_rows > 0
    assert together == alone and all(alone)


GREEDY_TEXT = {"prompt": "t3 t4 t5 t3 t4", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def completion_text(tiny_app: TestClient, **extra: Any) -> tuple[str, str]:
    response = tiny_app.post("/v1/completions", json={**GREEDY_TEXT, **extra})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"], choice["finish_reason"]


def test_penalties_and_bias_change_the_output_alike_in_every_method(tiny_app: TestClient) -> None:
    """logit_bias by token id, presence/frequency/repetition penalties and min_p are applied (the output changes as
    they say) and prompt lookup gives plain decoding's text under them, token for token."""
    plain, _ = completion_text(tiny_app, method="plain")
    first = plain.split()[0]
    banned, _ = completion_text(tiny_app, method="plain", logit_bias={first[1:]: -100})
    assert first not in banned.split()
    assert completion_text(tiny_app, logit_bias={"7": 100})[0] == " ".join(["t7"] * 6)
    # A bias of 3 on t7 against a frequency penalty of 2 per use: t7 comes at most twice.
    assert completion_text(tiny_app, logit_bias={"7": 3}, frequency_penalty=2)[0].split().count("t7") <= 2
    for extra in (
        {"presence_penalty": 1.5, "frequency_penalty": 0.5},
        {"repetition_penalty": 1.8, "logit_bias": {"9": 4}},
        {"presence_penalty": -1, "min_p": 0.3},
    ):
        texts = {method: completion_text(tiny_app, method=method, **extra)[0] for method in ("plain", "lookup")}
        assert texts["plain"] == texts["lookup"], extra
        assert texts["plain"] != plain or "min_p" in extra, extra  # greedy: min_p keeps the top token


def test_stop_token_ids_min_tokens_and_include_stop_str_in_output(tiny_app: TestClient) -> None:
    plain, _ = completion_text(tiny_app)
    words = plain.split()
    stop = int(words[2][1:])
    cut = words.index(f"t{stop}")
    text, reason = completion_text(tiny_app, stop_token_ids=[stop])
    assert (text.split(), reason) == (words[:cut], "stop")
    text, reason = completion_text(tiny_app, stop_token_ids=[stop], include_stop_str_in_output=True)
    assert (text.split(), reason) == (words[: cut + 1], "stop")
    text, _ = completion_text(tiny_app, stop_token_ids=[stop], min_tokens=cut + 2)
    assert len(text.split()) >= cut + 2 and f"t{stop}" not in text.split()[: cut + 2]
    text, reason = completion_text(tiny_app, stop=words[1], include_stop_str_in_output=True)
    assert text == plain[: plain.index(words[1]) + len(words[1])] and reason == "stop"
    usage = tiny_app.post("/v1/completions", json={**GREEDY_TEXT, "truncate_prompt_tokens": 2}).json()["usage"]
    assert usage["prompt_tokens"] == 2


def test_a_method_that_cannot_honour_a_penalty_is_refused_before_it_runs() -> None:
    from viasd.serve.errors import APIError
    from viasd.serve.request_config import generation_config
    from viasd.serve.schemas import CompletionRequest
    from viasd.serve.settings import ServeSettings

    settings = ServeSettings(model_id="m", methods=("hf-assisted",), max_tokens_limit=16, default_max_tokens=4)
    for field, value in (("min_p", 0.2), ("repetition_penalty", 1.1), ("logit_bias", {"3": 1}), ("min_tokens", 2)):
        request = CompletionRequest.model_validate({"prompt": "t3", field: value})
        with pytest.raises(APIError, match=f"cannot honour {field}") as caught:
            generation_config(request, settings, settings.parsed["hf-assisted"], 64)
        assert caught.value.param == field
    neutral = {"prompt": "t3", "min_p": 0, "repetition_penalty": 1, "logit_bias": {}, "presence_penalty": 0}
    method = settings.parsed["hf-assisted"]
    assert generation_config(CompletionRequest.model_validate(neutral), settings, method, 64).max_new_tokens == 4


def test_the_official_client_sends_penalties_and_vllm_extensions(tiny_app: TestClient) -> None:
    """The openai package's own arguments (presence_penalty, logit_bias...) and vLLM's in extra_body are honoured; a
    refused one raises BadRequestError naming it."""
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=tiny_app, max_retries=0)
    out = client.completions.create(
        model="tiny",
        prompt="t3 t4",
        max_tokens=4,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"7": 100},
        extra_body={"ignore_eos": True, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2},
    )
    assert out.choices[0].text == "t7 t7 t7 t7"
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "t3 t4"}],
        max_tokens=3,
        temperature=0,
        logit_bias={"9": 100},
        extra_body={"ignore_eos": True, "stop_token_ids": [9], "include_stop_str_in_output": True},
    )
    assert chat.choices[0].message.content == "t9" and chat.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "t3"}], extra_body={"guided_choice": ["t3"]}
        )
    assert caught.value.param == "guided_choice" and "guided decoding" in caught.value.message
