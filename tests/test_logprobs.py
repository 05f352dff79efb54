"""Log-probabilities: every exact method reports plain greedy decoding's numbers, which are log_softmax of a fresh
full forward pass of the target (raw logits, before penalties); echoed prompts are scored likewise; via's relaxed
tiers make up no number; the server answers them in OpenAI's shapes (the official client parses them, streamed or
not) and refuses what it cannot give by name."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from helpers import PROMPT
from test_head import random_head
from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig, GenerationResult
from viasd.decode.hf_assisted import HFAssistedDecoder
from viasd.decode.logprobs import TokenLogprob
from viasd.decode.plain import PlainDecoder
from viasd.decode.round import RoundPolicy
from viasd.decode.speculative import SpeculativeDecoder
from viasd.decode.tiered import TieredDecoder
from viasd.drafters.head import HeadDrafter
from viasd.drafters.model_drafter import ModelDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.errors import UnsupportedParameter
from viasd.verify.gates import Gate
from viasd.verify.penalties import Penalties
from viasd.verify.sampling import SamplingParams
from viasd.views.layer_skip import LayerMask

TOP = 4
# Methods agree to rounding (the same logits rows); the session's logits are float32 where the fresh float64 pass's
# are not, hence the looser tolerance against it.
BETWEEN_METHODS = 1e-9
AGAINST_FRESH = 1e-5
PENALISED = SamplingParams(penalties=Penalties(presence=0.5, frequency=0.5, repetition=1.3, bias=((8, 1.5),)))


def fresh_logprobs(target: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log_softmax of one fresh full forward pass over `ids`: row i is the distribution of token i + 1."""
    with torch.inference_mode():
        return torch.log_softmax(target(torch.tensor([ids])).logits[0].double(), dim=-1)


def assert_same_logprobs(got: list[TokenLogprob], want: list[TokenLogprob], tol: float, what: str) -> None:
    assert [e.token for e in got] == [e.token for e in want], what
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a.logprob is None) == (b.logprob is None), (what, i)
        if a.logprob is not None:
            assert abs(a.logprob - b.logprob) <= tol, (what, i, a.logprob, b.logprob)
        assert [t for t, _ in a.top] == [t for t, _ in b.top], (what, i)
        assert all(abs(x - y) <= tol for (_, x), (_, y) in zip(a.top, b.top, strict=True)), (what, i)


def assert_fresh(target: torch.nn.Module, prompt: list[int], out: GenerationResult, top: int) -> None:
    """Each output token's number and top list are those of a fresh pass over prompt + output."""
    rows = fresh_logprobs(target, prompt + out.tokens)
    assert out.logprobs is not None and len(out.logprobs) == len(out.tokens)
    for i, entry in enumerate(out.logprobs):
        row = rows[len(prompt) - 1 + i]
        assert entry.token == out.tokens[i]
        assert entry.logprob is not None and abs(entry.logprob - row[entry.token].item()) <= AGAINST_FRESH
        values, ids = torch.topk(row, top)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert all(abs(v - w) <= AGAINST_FRESH for (_, v), w in zip(entry.top, values.tolist(), strict=True))


@pytest.mark.parametrize("sampling", [SamplingParams(), PENALISED], ids=["greedy", "greedy-penalised"])
def test_every_exact_method_reports_plain_greedy_logprobs_of_the_raw_target(sampling: SamplingParams) -> None:
    """sd, lookup, head, self and via-exact: plain greedy's tokens and numbers; those are a fresh pass's raw
    log_softmax (under penalties too: the penalties choose the tokens, not the numbers)."""
    target, tok = tiny_model("llama"), tiny_tokenizer(64)
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True, sampling=sampling, logprobs=TOP)
    plain = PlainDecoder(target, tok).generate(PROMPT, config)
    assert_fresh(target, PROMPT, plain, TOP)
    small = tiny_model("llama", layers=2, seed=1)
    decoders = {
        "sd": SpeculativeDecoder(target, tok, ModelDrafter(small), gamma=4),
        "lookup": SpeculativeDecoder(target, tok, PromptLookupDrafter(), gamma=4),
        "self": SpeculativeDecoder(target, tok, ModelDrafter(target, LayerMask.skipping(4, [2]), name="self")),
        "head": SpeculativeDecoder(target, tok, HeadDrafter(random_head(64, 64), target), gamma=3),
        "target-itself": SpeculativeDecoder(target, tok, ModelDrafter(target), gamma=4),  # long accepted blocks
        "via-exact": TieredDecoder(
            target, tok, ModelDrafter(small), [LayerMask.skipping(4, [2])], RoundPolicy(Gate.exact())
        ),
        "via-exact-kept": TieredDecoder(  # the target drafting for itself: its drafts stand, whole blocks commit
            target, tok, ModelDrafter(target), [LayerMask.skipping(4, [2])], RoundPolicy(Gate.exact())
        ),
    }
    for name, decoder in decoders.items():
        out = decoder.generate(PROMPT, config)
        assert out.tokens == plain.tokens, name
        assert out.logprobs is not None
        assert_same_logprobs(out.logprobs, plain.logprobs or [], BETWEEN_METHODS, name)
    assert out.stats.accepted > len(plain.tokens) // 2  # numbers from several rows of each verification pass


def test_echoed_prompt_logprobs_equal_a_fresh_pass_and_the_first_token_has_none() -> None:
    """Scoring only (max_new_tokens 0) and scoring then generating give the same prompt numbers, in every method."""
    target, tok = tiny_model("qwen2"), tiny_tokenizer(64)
    rows = fresh_logprobs(target, PROMPT)
    small = tiny_model("qwen2", layers=2, seed=1)
    for decoder in (
        PlainDecoder(target, tok),
        SpeculativeDecoder(target, tok, ModelDrafter(small)),
        TieredDecoder(target, tok, ModelDrafter(small), [LayerMask.skipping(4, [2])], RoundPolicy(Gate.exact())),
    ):
        scored = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=0, logprobs=2, prompt_logprobs=True))
        assert scored.tokens == [] and scored.logprobs == [] and scored.finish_reason == "length"
        both = decoder.generate(
            PROMPT, GenerationConfig(max_new_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=True)
        )
        for result in (scored, both):
            entries = result.prompt_logprobs
            assert entries is not None and [e.token for e in entries] == PROMPT
            assert entries[0].logprob is None and entries[0].top == ()
            for i in range(1, len(PROMPT)):
                assert abs(entries[i].logprob - rows[i - 1, PROMPT[i]].item()) <= AGAINST_FRESH, (decoder.method, i)
                assert [t for t, _ in entries[i].top] == torch.topk(rows[i - 1], 2).indices.tolist()
        plain_out = PlainDecoder(target, tok).generate(PROMPT, GenerationConfig(max_new_tokens=6, ignore_eos=True))
        assert both.tokens == plain_out.tokens  # scoring first changes nothing in the output
        assert_fresh(target, PROMPT, both, 2)


def test_relaxed_via_tokens_get_no_made_up_number() -> None:
    """Tokens the slim tier committed have no number; those the full target verified have a fresh pass's."""
    target, tok = tiny_model("llama"), tiny_tokenizer(64)
    relaxed = TieredDecoder(  # every draft to the slim tier, the full target every 8 tokens (the cap)
        target, tok, ModelDrafter(tiny_model("llama", layers=2, seed=1)), [LayerMask.skipping(4, [2])],
        RoundPolicy(Gate("kl", (-1.0, math.inf)), cap=8),
    )  # fmt: skip
    out = relaxed.generate(PROMPT, GenerationConfig(max_new_tokens=24, ignore_eos=True, logprobs=2))
    assert out.logprobs is not None and len(out.logprobs) == len(out.tokens)
    missing = [i for i, e in enumerate(out.logprobs) if e.logprob is None]
    assert len(missing) == out.stats.unchecked_tokens > 0
    assert all(out.logprobs[i].top == () for i in missing)
    rows = fresh_logprobs(target, PROMPT + out.tokens)
    checked = [i for i, e in enumerate(out.logprobs) if e.logprob is not None]
    assert checked
    for i in checked:
        assert abs(out.logprobs[i].logprob - rows[len(PROMPT) - 1 + i, out.tokens[i]].item()) <= AGAINST_FRESH


def test_nothing_is_computed_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without logprobs no log_softmax runs and the result has none; with it, one entry per output token."""
    import viasd.decode.output as output

    calls = []
    real = output.token_logprobs
    monkeypatch.setattr(output, "token_logprobs", lambda *a: calls.append(1) or real(*a))
    target, tok = tiny_model("llama"), tiny_tokenizer(64)
    decoder = SpeculativeDecoder(target, tok, PromptLookupDrafter(), gamma=4)
    out = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=8, ignore_eos=True))
    assert out.logprobs is None and out.prompt_logprobs is None and not calls
    out = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=8, ignore_eos=True, logprobs=0))
    assert calls and out.logprobs is not None and len(out.logprobs) == 8 and all(e.top == () for e in out.logprobs)


def test_a_method_without_target_logits_refuses_logprobs_by_name() -> None:
    target, tok = tiny_model("llama"), tiny_tokenizer(64)
    decoder = HFAssistedDecoder(target, tok, tiny_model("llama", layers=2, seed=1), gamma=3)
    with pytest.raises(UnsupportedParameter, match="logprobs") as caught:
        decoder.generate(PROMPT, GenerationConfig(max_new_tokens=2, logprobs=0))
    assert caught.value.param == "logprobs"


# ------------------------------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def app() -> Iterator[TestClient]:
    """The app in process over a tiny random float64 model, two generations at once (their passes batched)."""
    from viasd.engine import Engine, EngineSpec
    from viasd.models.loading import LoadedModel
    from viasd.serve.app import create_app
    from viasd.serve.settings import ServeSettings

    loaded = LoadedModel(model=tiny_model(), tokenizer=tiny_tokenizer(64), name="tiny", path="tiny")
    engine = Engine(EngineSpec(target="tiny", device="cpu"), target=loaded)
    settings = ServeSettings(
        model_id="tiny", methods=("lookup", "plain"), max_tokens_limit=16, default_max_tokens=4, max_active=2
    )
    with TestClient(create_app(engine, settings)) as client:
        yield client


def openai_client(app: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=app, max_retries=0)


TEXT = "t3 t4 t5 t3 t4"
IDS = [3, 4, 5, 3, 4]


def test_chat_logprobs_streamed_or_not_are_plain_greedy_decodings_through_the_official_client(app: TestClient) -> None:
    tiny = tiny_model()
    client = openai_client(app)
    messages = [{"role": "user", "content": TEXT}]
    common: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
    extra = {"ignore_eos": True}
    want = PlainDecoder(tiny, tiny_tokenizer(64)).generate(
        IDS, GenerationConfig(max_new_tokens=6, ignore_eos=True, logprobs=3)
    )
    for method in ("plain", "lookup"):
        body = {**extra, "method": method}
        reply = client.chat.completions.create(**common, logprobs=True, top_logprobs=3, extra_body=body)
        content = reply.choices[0].logprobs.content
        assert [c.token for c in content] == [f"t{t}" for t in want.tokens]
        for got, entry in zip(content, want.logprobs or [], strict=True):
            assert abs(got.logprob - entry.logprob) <= BETWEEN_METHODS
            assert [a.token for a in got.top_logprobs] == [f"t{t}" for t, _ in entry.top]
            assert got.bytes == list(got.token.encode())
        streamed = [
            c
            for chunk in client.chat.completions.create(**common, logprobs=True, stream=True, extra_body=body)
            for choice in chunk.choices
            if choice.logprobs is not None
            for c in choice.logprobs.content or []
        ]
        assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
        assert all(c.top_logprobs == [] for c in streamed)  # top_logprobs left out: none listed
    plain = client.chat.completions.create(**common, extra_body=extra)
    assert plain.choices[0].logprobs is None  # not asked: null, as before


def test_completions_echo_scores_the_prompt_as_evaluation_harnesses_ask(app: TestClient) -> None:
    """echo + logprobs + max_tokens 0 (lm-eval's loglikelihood): the prompt's numbers, the first null; with tokens
    generated too, the output follows; offsets index the echoed text."""
    tiny = tiny_model()
    rows = fresh_logprobs(tiny, IDS)
    client = openai_client(app)
    scored = client.completions.create(model="tiny", prompt=TEXT, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == TEXT and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == TEXT.split() and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [0, 3, 6, 9, 12]
    for i in range(1, len(IDS)):
        assert abs(lp.token_logprobs[i] - rows[i - 1, IDS[i]].item()) <= AGAINST_FRESH
        best = f"t{int(rows[i - 1].argmax())}"
        assert best in lp.top_logprobs[i] and lp.tokens[i] in lp.top_logprobs[i]  # the top one and the token's own
    more = client.completions.create(
        model="tiny", prompt=IDS, max_tokens=3, echo=True, logprobs=2, temperature=0, extra_body={"ignore_eos": True}
    )
    lp2 = more.choices[0].logprobs
    assert lp2.token_logprobs[: len(IDS)] == lp.token_logprobs
    assert len(lp2.tokens) == len(IDS) + 3 and more.choices[0].text.startswith(TEXT)
    text = more.choices[0].text
    assert all(text.startswith(token, at) for token, at in zip(lp2.tokens, lp2.text_offset, strict=True))


def test_completions_logprobs_stream_as_they_are_answered_whole(app: TestClient) -> None:
    body = {"prompt": TEXT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    whole = app.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    events = app.post("/v1/completions", json={**body, "stream": True}).text.split("\n\n")
    parts = [json.loads(e[6:])["choices"][0]["logprobs"] for e in events if e.startswith("data: {")]
    streamed = {key: [v for p in parts if p for v in p[key]] for key in whole}
    assert streamed == whole


def test_batched_requests_with_logprobs_get_what_they_get_alone(app: TestClient) -> None:
    bodies = [
        {"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1, "method": m}
        for p, m in (("t3 t4 t5 t3 t4", "lookup"), ("t9 t8 t7", "plain"))
    ]
    alone = [app.post("/v1/completions", json=b).json()["choices"][0]["logprobs"] for b in bodies]
    together: list[Any] = [None, None]
    barrier = threading.Barrier(2)

    def request(i: int) -> None:
        barrier.wait(timeout=30)
        together[i] = app.post("/v1/completions", json=bodies[i]).json()["choices"][0]["logprobs"]

    threads = [threading.Thread(target=request, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for got, want in zip(together, alone, strict=True):
        assert got["tokens"] == want["tokens"]
        assert all(abs(a - b) <= 1e-6 for a, b in zip(got["token_logprobs"], want["token_logprobs"], strict=True))


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "[0, 20]"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs", "boolean"),
        ("/v1/chat/completions", {"logprobs": True, "n": 2}, "n", "n=1"),
        ("/v1/completions", {"logprobs": 6}, "logprobs", "[0, 5]"),
        ("/v1/completions", {"logprobs": True}, "logprobs", "integer"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens", "echo"),
        ("/v1/completions", {"max_tokens": 0, "echo": True}, "max_tokens", "echo and logprobs"),
        ("/v1/completions", {"echo": True, "logprobs": 1, "stream": True}, "echo", "stream"),
        ("/v1/completions", {"logprobs": 1, "n": 3}, "n", "n=1"),
    ],
)
def test_bad_logprob_requests_are_one_line_400s_naming_the_parameter(
    app: TestClient, path: str, body: dict[str, Any], param: str, words: str
) -> None:
    base = {"messages": [{"role": "user", "content": "t3"}]} if "chat" in path else {"prompt": "t3"}
    answer = app.post(path, json={**base, **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"] and "\n" not in error["message"], error


def test_methods_without_target_logits_are_refused_before_they_run() -> None:
    from viasd.serve.errors import APIError
    from viasd.serve.request_config import generation_config
    from viasd.serve.schemas import ChatCompletionRequest, CompletionRequest
    from viasd.serve.settings import ServeSettings

    settings = ServeSettings(model_id="m", methods=("plain", "hf-assisted", "llama.cpp", "llama-server"))
    for name in ("hf-assisted", "llama.cpp", "llama-server"):
        method = settings.parsed[name]
        for req in (
            ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "logprobs": True}),
            CompletionRequest.model_validate({"prompt": "x", "logprobs": 0}),
        ):
            with pytest.raises(APIError) as caught:
                generation_config(req, settings, method, 64)
            assert caught.value.param == "logprobs" and name in str(caught.value)
        generation_config(CompletionRequest.model_validate({"prompt": "x"}), settings, method, 64)  # not asked: fine


def test_the_official_client_parses_an_unchecked_token() -> None:
    """A relaxed via token's entry (logprob null, the `unchecked` extension) is parsed by the openai package."""
    from viasd.serve.logprobs import TokenText, chat_logprobs, completion_logprobs
    from viasd.serve.schemas import ChatChoice, ChatCompletion, ChatMessageOut, Usage

    text = TokenText(tiny_tokenizer(64))
    entries = [TokenLogprob(5, -0.5, ((5, -0.5), (6, -1.0))), TokenLogprob(7, None)]
    chat = ChatCompletion(
        id="x",
        created=0,
        model="m",
        choices=[
            ChatChoice(
                message=ChatMessageOut(content="t5 t7"), logprobs=chat_logprobs(entries, text), finish_reason="stop"
            )
        ],
        usage=Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3),
    )
    legacy = completion_logprobs(entries, text, [0, 3])
    assert legacy.unchecked == [1] and legacy.token_logprobs == [-0.5, None] and legacy.top_logprobs[1] is None

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=chat.model_dump_json(), headers={"content-type": "application/json"})

    client = openai.OpenAI(
        base_url="http://x/v1", api_key="k", http_client=httpx.Client(transport=httpx.MockTransport(answer))
    )
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "t3"}], logprobs=True)
    first, second = reply.choices[0].logprobs.content
    assert first.logprob == -0.5 and [t.token for t in first.top_logprobs] == ["t5", "t6"]
    assert second.logprob is None and second.top_logprobs == [] and second.model_extra == {"unchecked": True}


def test_a_byte_level_token_holding_part_of_a_character_has_its_true_bytes() -> None:
    """OpenAI's `bytes` let a client join tokens split inside a character: such a token's text is the replacement
    character, its bytes the byte it stands for; a whole token's bytes are its text's UTF-8."""
    from tiny import tiny_chat_tokenizer
    from viasd.serve.logprobs import TokenText

    tok = tiny_chat_tokenizer(320)
    text = TokenText(tok)
    euro = tok("€")["input_ids"]  # three bytes, none a character alone
    assert b"".join(bytes(text(t)[1]) for t in euro) == "€".encode()
    assert len(euro) > 1 and all(text(t)[0] == "\ufffd" for t in euro)
    word = tok("quick")["input_ids"]
    assert [text(t)[1] for t in word] == [list(text(t)[0].encode()) for t in word]
