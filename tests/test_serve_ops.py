"""The operators' endpoints of `viasd serve` (/tokenize, /detokenize, /version) and the vLLM-named metrics (latency
histograms, speculation counters), against a real server process on a tiny random model with a chat tokenizer.

The histograms are checked against what the requests themselves saw: each request's own wall-clock time as the
client measured it bounds its end-to-end latency from above, and the generation time its answer reports
(`usage.speculative.total_seconds`) bounds it from below; the speculation counters must equal the sums of the
answers' `usage.speculative`.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

import viasd
from test_serve import Server, assert_error, healthy_server, sse_payloads, tiny_model_dir

VOCAB = 320  # tiny_model_dir's vocabulary
CONTEXT = 1 << 20  # tiny_model_dir's max_position_embeddings
MODEL_ID = "tiny-ops"
HISTOGRAMS = (
    "viasd:request_queue_time_seconds",
    "viasd:time_to_first_token_seconds",
    "viasd:request_time_per_output_token_seconds",
    "viasd:e2e_request_latency_seconds",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("serve-ops")
    model = tiny_model_dir(directory / "model")
    with healthy_server(
        directory, "ops", "--target", str(model), "--device", "cpu", "--methods", "lookup,plain",
        "--served-model-name", MODEL_ID, "--max-active", "2", "--max-tokens-limit", "16", "--no-access-log",
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def post(server: Server, path: str, body: Any) -> httpx.Response:
    if isinstance(body, str):
        return httpx.post(f"{server.url}{path}", content=body, timeout=30)
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a Prometheus text exposition: (name, labels) -> value."""
    found: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        match = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if match and not line.startswith("#"):
            labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2) or ""))
            found[(match.group(1), labels)] = float(match.group(3))
    return found


def method_samples(server: Server, method: str) -> dict[tuple[str, str], float]:
    """The samples of one method's vLLM-named families: (name, le or '') -> value."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    picked: dict[tuple[str, str], float] = {}
    for (name, labels), value in samples(text).items():
        tags = dict(labels)
        if name.startswith("viasd:") and tags.get("method") == method:
            assert tags.get("model_name") == MODEL_ID, (name, tags)
            picked[(name, tags.get("le", ""))] = value
    return picked


# ---------------------------------------------------------------------------------------------- /tokenize


def test_tokenize_counts_what_the_completion_endpoints_report(server: Server, client: openai.OpenAI) -> None:
    """A prompt tokenizes to the `usage.prompt_tokens` of /v1/completions, messages to that of
    /v1/chat/completions (special-token text in a message included), and /detokenize gives the prompt back."""
    prompt = "The quick brown fox jumps over the lazy dog."
    answer = post(server, "/tokenize", {"model": MODEL_ID, "prompt": prompt}).json()
    assert answer.keys() == {"count", "max_model_len", "tokens"}  # token_strs only when asked
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == CONTEXT
    completion = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=1)
    assert completion.usage is not None and answer["count"] == completion.usage.prompt_tokens
    assert post(server, "/detokenize", {"model": MODEL_ID, "tokens": answer["tokens"]}).json() == {"prompt": prompt}

    with_strs = post(server, "/tokenize", {"prompt": prompt, "return_token_strs": True}).json()
    assert with_strs["tokens"] == answer["tokens"] and len(with_strs["token_strs"]) == answer["count"]
    assert all(isinstance(piece, str) and piece for piece in with_strs["token_strs"])

    for content in ("What is 2+2?", "Say <|im_end|> then <|im_start|>system"):
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
        chat = post(server, "/tokenize", {"messages": messages}).json()
        reply = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=1)  # type: ignore[arg-type]
        assert reply.usage is not None and chat["count"] == reply.usage.prompt_tokens, content
        bare = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
        text = post(server, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
        assert text.endswith("<|im_start|>assistant\n") and content in text  # the content stays text
        assert chat["tokens"][: bare["count"]] == bare["tokens"] and bare["count"] < chat["count"]
        assert chat["tokens"].count(2) == 2  # <|im_end|> (id 2) only from the template: one per message


BAD_REQUESTS = [
    ("/tokenize", {}, "prompt", "nothing to tokenize"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages", "not both"),
    ("/tokenize", {"prompt": ""}, "prompt", "the prompt is empty"),
    ("/tokenize", {"prompt": "  \n"}, "prompt", "the prompt is empty"),
    ("/tokenize", {"prompt": 5}, "prompt", "prompt must be a string, got 5"),
    ("/tokenize", {"prompt": ["a"]}, "prompt", "prompt must be a string"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", "must be a boolean"),
    ("/tokenize", {"prompt": "a", "return_token_strs": 1}, "return_token_strs", "must be a boolean"),
    ("/tokenize", {"messages": "hi"}, "messages", "must be a list"),
    ("/tokenize", {"messages": []}, "messages", "no messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": " "}]}, "messages", "the prompt is empty"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "a"}]}, "messages", "messages.0.role"),
    ("/tokenize", {"prompt": "a", "chat_template": "{{ x }}"}, "chat_template", "chat template"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": False}, "add_generation_prompt", "messages only"),
    ("/tokenize", {"prompt": "a", "chat_template_kwargs": {}}, "chat_template_kwargs", "messages only"),
    (
        "/tokenize",
        {"prompt": "a", "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tools",
        "messages only",
    ),
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tools",
        "chat template offers no tools",  # this one's does not
    ),
    ("/tokenize", {"prompt": "a", "temperature": 0}, "temperature", "temperature"),  # an unknown field
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": "a"}], "add_generation_prompt": True, "continue_final_message": True},
        "continue_final_message",
        "cannot be true with add_generation_prompt true",
    ),
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"tokenize": True}},
        "chat_template_kwargs",
        "'tokenize' is not a template variable here",
    ),
    ("/detokenize", {"tokens": [3], "skip_special_tokens": True}, "skip_special_tokens", "skip_special_tokens"),
    ("/tokenize", {"prompt": "a", "model": 7}, "model", "model must be a string"),
    ("/tokenize", "{not json", None, "not valid JSON"),
    ("/detokenize", {"tokens": [-1]}, "tokens", "token id -1 is outside the vocabulary (0..319)"),
    ("/detokenize", {"tokens": [5, VOCAB]}, "tokens", f"token id {VOCAB} is outside the vocabulary"),
    ("/detokenize", {"tokens": [True]}, "tokens", "must be an integer, got true"),
    ("/detokenize", {"tokens": [1.5]}, "tokens", "must be an integer"),
    ("/detokenize", {"tokens": "abc"}, "tokens", "tokens must be a list"),
    ("/detokenize", {}, "tokens", "Field required"),
]


@pytest.mark.parametrize(("path", "body", "param", "words"), BAD_REQUESTS)
def test_bad_input_gets_one_400_naming_the_parameter(
    server: Server, path: str, body: Any, param: str | None, words: str
) -> None:
    error = assert_error(post(server, path, body), 400, words)
    assert "\n" not in error["message"], error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].split(".")[0] == param, error


def test_tokenize_renders_the_template_as_the_chat_endpoint_does(server: Server) -> None:
    """vLLM's template options: continuing the last (assistant) message ends the ids at its text, with no new
    turn; variables the template does not use change nothing."""
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is"}]
    continued = post(server, "/tokenize", {"messages": messages, "continue_final_message": True}).json()
    text = post(server, "/detokenize", {"tokens": continued["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nIt is"), text
    opened = post(server, "/tokenize", {"messages": messages}).json()
    assert post(server, "/detokenize", {"tokens": opened["tokens"]}).json()["prompt"].endswith("assistant\n")
    same = post(server, "/tokenize", {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}})
    assert same.json() == opened


def test_an_unknown_model_is_404_as_on_the_openai_routes(server: Server) -> None:
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [3]})):
        error = assert_error(post(server, path, {**body, "model": "other"}), 404, "'other' is not served here")
        assert error["param"] == "model" and error["code"] == "model_not_found"


def test_version_is_the_package_version(server: Server) -> None:
    response = httpx.get(f"{server.url}/version", timeout=10)
    assert response.status_code == 200 and response.json() == {"version": viasd.__version__}


# ---------------------------------------------------------------------------------------------- /metrics


def _timed(results: list[dict[str, Any]], call: Any) -> None:
    start = time.perf_counter()
    usage = call()
    results.append({"wall": time.perf_counter() - start, **usage})


def test_latency_histograms_and_speculation_counters_count_what_the_requests_saw(
    server: Server, client: openai.OpenAI
) -> None:
    """Five `lookup` requests (chat and text, streamed and not, two at once): every histogram counts five more,
    the sums and buckets fit each request's own timings, and the draft counters are the answers' own sums."""
    before = method_samples(server, "lookup")
    plain_before = method_samples(server, "plain")
    extra = {"ignore_eos": True, "method": "lookup"}
    prompts = ("the quick brown fox the quick brown fox", "abc abc abc abc", "You are a helpful assistant.")

    def chat(content: str) -> dict[str, Any]:
        reply = client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0,
            extra_body=extra,
        )  # fmt: skip
        assert reply.usage is not None
        return reply.usage.model_dump()

    def text(prompt: str) -> dict[str, Any]:
        reply = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra)
        assert reply.usage is not None
        return reply.usage.model_dump()

    def streamed(prompt: str) -> dict[str, Any]:
        body = {"prompt": prompt, "max_tokens": 10, "stream": True, "stream_options": {"include_usage": True}, **extra}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            events = [json.loads(p) for p in sse_payloads(response.iter_lines()) if p != "[DONE]"]
        return dict(events[-1]["usage"])

    results: list[dict[str, Any]] = []
    together = [
        threading.Thread(target=_timed, args=(results, lambda p=p: text(p))) for p in prompts[:2]
    ]  # two at once: --max-active 2 batches them
    for thread in together:
        thread.start()
    for thread in together:
        thread.join(timeout=120)
    _timed(results, lambda: chat(prompts[2]))
    _timed(results, lambda: chat(prompts[0]))
    _timed(results, lambda: streamed(prompts[1]))
    assert len(results) == 5
    after = method_samples(server, "lookup")

    def delta(name: str, le: str = "") -> float:
        return after.get((name, le), 0.0) - before.get((name, le), 0.0)

    def bounds(name: str) -> list[str]:
        return sorted({le for (n, le) in after if n == f"{name}_bucket"} - {"+Inf"}, key=float)

    for name in HISTOGRAMS:
        assert delta(f"{name}_count") == 5, name
        counts = [delta(f"{name}_bucket", le) for le in [*bounds(name), "+Inf"]]
        assert counts == sorted(counts) and counts[-1] == 5, (name, counts)  # cumulative, all in +Inf
    speculative = [r["speculative"] for r in results]
    walls = [r["wall"] for r in results]
    generating = [s["total_seconds"] for s in speculative]
    e2e, first = delta("viasd:e2e_request_latency_seconds_sum"), delta("viasd:time_to_first_token_seconds_sum")
    assert 0 < first <= e2e and delta("viasd:request_queue_time_seconds_sum") <= first
    assert sum(generating) <= e2e <= sum(walls)
    per_token = delta("viasd:request_time_per_output_token_seconds_sum")
    assert 0 < per_token <= sum(w / (r["completion_tokens"] - 1) for w, r in zip(walls, results, strict=True))
    for le in bounds("viasd:e2e_request_latency_seconds"):
        # A request the client saw end within le ended within le on the server; one that generated longer did not.
        within = delta("viasd:e2e_request_latency_seconds_bucket", le)
        assert sum(w <= float(le) for w in walls) <= within <= sum(g <= float(le) for g in generating), le
    for le in bounds("viasd:time_to_first_token_seconds"):  # the first token comes before the end
        assert delta("viasd:time_to_first_token_seconds_bucket", le) >= sum(w <= float(le) for w in walls), le

    drafted, accepted = sum(s["drafted"] for s in speculative), sum(s["accepted"] for s in speculative)
    assert drafted > 0 and delta("viasd:spec_decode_num_draft_tokens_total") == drafted
    assert delta("viasd:spec_decode_num_accepted_tokens_total") == accepted <= drafted
    rounds = sum(source["rounds"] for s in speculative for source in s["sources"].values())
    assert 0 < delta("viasd:spec_decode_num_drafts_total") == rounds
    assert method_samples(server, "plain") == plain_before  # nothing counted for another method


def test_request_times_and_histograms_follow_vllm() -> None:
    """Times from clock readings: TTFT includes the queue, time per output token leaves the first token out (0 with
    one token), a request without tokens has its TTFT at its end; buckets hold values up to and including their
    bound, exposed cumulatively."""
    from viasd.decode.stats import GenerationStats
    from viasd.serve.latency import Histogram, request_times
    from viasd.serve.metrics import Metrics

    times = request_times(arrived=10.0, started=10.5, ended=14.0, first_token=1.0, generating=3.25, tokens=10)
    assert (times.queue, times.first_token, times.end_to_end) == (0.5, 1.5, 4.0)
    assert times.per_output_token == pytest.approx(2.25 / 9)
    assert request_times(0.0, 0.0, 2.0, 1.0, 2.0, tokens=1).per_output_token == 0.0
    assert request_times(0.0, 1.0, 2.0, None, 1.0, tokens=0).first_token == 2.0

    histogram = Histogram((0.5, 1.0))
    for value in (0.5, 0.75, 1.0, 3.0):
        histogram.observe(value)
    assert list(histogram.cumulative()) == [("0.5", 1), ("1.0", 3), ("+Inf", 4)]
    assert (histogram.count, histogram.total) == (4, 5.25)

    metrics = Metrics(["sd"], model_name='m"1')
    metrics.record("sd", GenerationStats(method="sd", drafted=4, accepted=3, rounds=2), times)
    found = samples(metrics.render(waiting=0, running=0, capacity=1))
    labels = frozenset({("model_name", 'm\\"1'), ("method", "sd")})
    assert found[("viasd:time_to_first_token_seconds_bucket", labels | {("le", "1.0")})] == 0
    assert found[("viasd:time_to_first_token_seconds_bucket", labels | {("le", "2.5")})] == 1
    assert found[("viasd:e2e_request_latency_seconds_sum", labels)] == 4.0
    assert found[("viasd:spec_decode_num_drafts_total", labels)] == 2  # no source named: its rounds drafted
    assert found[("viasd:spec_decode_num_accepted_tokens_total", labels)] == 3
