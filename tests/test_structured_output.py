"""Structured output (a JSON schema as a grammar, verify/grammar.py): the masks against llguidance's own matcher,
greedy speculative output equal to plain greedy output under a schema with every drafter (and valid against it),
sampling that follows the target's law restricted by the grammar (chi-square, false-alarm rate ALPHA), and the
server's response_format: honoured, or refused with a 400 that names the parameter."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator

import jsonschema_rs
import pytest
import torch
from fastapi.testclient import TestClient
from llguidance import LLMatcher

from helpers import Recording
from laws import ALPHA, pooled_pvalue
from test_head import random_head
from test_serve import metric
from tiny import tiny_chat_tokenizer, tiny_model
from viasd.decode.base import GenerationConfig, eos_token_ids
from viasd.decode.hf_assisted import HFAssistedDecoder
from viasd.decode.plain import PlainDecoder
from viasd.decode.round import RoundPolicy
from viasd.decode.speculative import SpeculativeDecoder
from viasd.decode.tiered import TieredDecoder
from viasd.drafters.base import Proposal
from viasd.drafters.head import HeadDrafter
from viasd.drafters.hybrid import HybridDrafter
from viasd.drafters.model_drafter import ModelDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.errors import UnsupportedParameter, ViasdError
from viasd.verify.gates import Gate
from viasd.verify.grammar import JSON_LAYOUT, Grammar, grammar_tokenizer
from viasd.verify.sampling import SamplingParams, warp_probs
from viasd.views.layer_skip import LayerMask

VOCAB = 320
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
EXAMPLE = '{"name": "fox", "age": 4, "ok": true}'


def chat_prompt(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


def schema_grammar(target, tok, schema=SCHEMA) -> Grammar:
    return Grammar.json_schema(grammar_tokenizer(tok, eos_token_ids(target, tok), VOCAB), schema)


def reference_allowed(grammar: Grammar, prefix: list[int], ends: frozenset[int], width: int) -> torch.Tensor:
    """The tokens allowed after `prefix`, token by token from a fresh llguidance matcher (not our masks)."""
    matcher = LLMatcher(grammar.tokenizer, LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), JSON_LAYOUT))
    assert matcher.consume_tokens(prefix)
    allowed = torch.tensor([t not in ends and matcher.validate_tokens([t]) == 1 for t in range(width)])
    for t in ends:
        allowed[t] = matcher.is_accepting()
    return allowed


def test_masks_follow_the_grammar_after_the_drafts_before_each_row():
    """A verifier's rows over a block: row i allows what the grammar allows after the output and drafts[:i]; end
    tokens only where the text is complete; rows behind a forbidden draft allow everything (never reached)."""
    target, tok = tiny_model("llama", vocab_size=VOCAB), tiny_chat_tokenizer(VOCAB)
    prompt, ends = chat_prompt(tok, "hi"), frozenset({1, 2})
    text = tok.encode(EXAMPLE)
    grammar = schema_grammar(target, tok).bound(len(prompt), ends)
    output, drafts = text[:3], text[3:9]
    rows = grammar.masks(prompt + output, drafts, len(drafts) + 1, VOCAB)
    for i in range(len(drafts) + 1):
        assert torch.equal(rows[i], reference_allowed(grammar, output + drafts[:i], ends, VOCAB)), i
    assert not rows[:, sorted(ends)].any()  # the object is open: nothing may end it
    done = grammar.masks(prompt + text, [], 1, VOCAB)[0]
    assert done.nonzero().flatten().tolist() == sorted(ends)  # complete: only an end token
    assert grammar.allowed_length(prompt + output, drafts) == len(drafts)
    # A draft the grammar forbids: drafts are cut there, and the rows behind it allow everything.
    bad = [*drafts[:2], tok.encode("x")[0], *drafts[3:]]
    assert grammar.allowed_length(prompt + output, bad) == 2
    rows = grammar.masks(prompt + output, bad, len(bad) + 1, VOCAB)
    assert rows[3:].all() and not rows[2].all()
    assert grammar.allowed_length(prompt + text, [2, 5]) == 1  # an end token where the text is complete
    probs = torch.rand(len(bad), VOCAB)
    cut = Proposal(bad, probs, probs, "x", [0.5] * len(bad)).within(SamplingParams(grammar=grammar), prompt + output)
    assert (cut.tokens, cut.probs.shape[0], cut.soft.shape[0], len(cut.tops)) == (bad[:2], 2, 2, 2)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_speculative_equals_plain_under_a_schema(arch):
    """Every drafter (prompt lookup, a small model, a layer-skip view, a draft head, lookup + head) and via's exact
    paths give plain greedy's tokens under a JSON schema, and the text validates against it."""
    target, tok = tiny_model(arch, vocab_size=VOCAB), tiny_chat_tokenizer(VOCAB)
    prompt = chat_prompt(tok, f"Reply as {EXAMPLE} or as {EXAMPLE}")
    config = GenerationConfig(max_new_tokens=60, sampling=SamplingParams(grammar=schema_grammar(target, tok)))
    plain = PlainDecoder(target, tok).generate(prompt, config)
    assert plain.finish_reason == "eos"
    jsonschema_rs.validate(SCHEMA, json.loads(plain.text))
    free = PlainDecoder(target, tok).generate(prompt, GenerationConfig(max_new_tokens=60))
    assert free.tokens[:8] != plain.tokens[:8]  # the grammar changes the output
    small = tiny_model(arch, vocab_size=VOCAB, layers=2, seed=1)
    head = random_head(64, VOCAB)
    drafters = {
        "prompt-lookup": PromptLookupDrafter(),
        "small-model": ModelDrafter(small),
        "self": ModelDrafter(target, LayerMask.skipping(4, [2]), name="self"),
        "head": Recording(HeadDrafter(head, target)),
        "lookup+head": HybridDrafter(PromptLookupDrafter(3, 2), HeadDrafter(head, target), 0.0),
        "target-itself": ModelDrafter(target),  # every draft stands: each row is masked after the drafts before it
    }
    for name, drafter in drafters.items():
        out = SpeculativeDecoder(target, tok, drafter, gamma=4).generate(prompt, config)
        assert (out.tokens, out.finish_reason) == (plain.tokens, plain.finish_reason), name
    assert out.stats.accepted > len(plain.tokens) // 2
    exact = TieredDecoder(target, tok, ModelDrafter(small), [LayerMask.skipping(4, [2])], RoundPolicy(Gate.exact()))
    assert exact.generate(prompt, config).tokens == plain.tokens
    lossless = TieredDecoder(  # drafts settled by a slim view that is the whole target, masked alike
        target, tok, ModelDrafter(small), [LayerMask.full(4)], RoundPolicy(Gate("kl", (-1.0, math.inf)), cap=8)
    )
    out = lossless.generate(prompt, config)
    assert out.tokens == plain.tokens and out.stats.unchecked_tokens > 0


def test_relaxed_via_keeps_the_schema():
    """via with a slim view that differs from the target is not exact, but every tier is masked: the text is valid."""
    target, tok = tiny_model("llama", vocab_size=VOCAB), tiny_chat_tokenizer(VOCAB)
    prompt = chat_prompt(tok, f"Reply as {EXAMPLE}")
    config = GenerationConfig(max_new_tokens=60, sampling=SamplingParams(grammar=schema_grammar(target, tok)))
    relaxed = RoundPolicy(Gate("kl", (-1.0, math.inf)), cap=8)  # every draft settled by the skipping view
    decoder = TieredDecoder(target, tok, PromptLookupDrafter(), [LayerMask.skipping(4, [1, 2])], relaxed)
    out = decoder.generate(prompt, config)
    assert out.finish_reason == "eos"
    jsonschema_rs.validate(SCHEMA, json.loads(out.text))


INTEGER = {"type": "integer"}


def masked_law(target, grammar, prompt, params, ends, length, schema=INTEGER):
    """Exact probability of each output (cut at an end token) under the warped target restricted by the grammar,
    the allowed tokens read from fresh llguidance matchers."""
    law: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], p: float) -> None:
        if len(prefix) == length:
            law[tuple(prefix)] = law.get(tuple(prefix), 0.0) + p
            return
        with torch.inference_mode():
            logits = target(input_ids=torch.tensor([prompt + prefix])).logits[0, -1:].float()
        matcher = LLMatcher(grammar.tokenizer, LLMatcher.grammar_from_json_schema(json.dumps(schema), JSON_LAYOUT))
        assert matcher.consume_tokens(prefix)
        allowed = torch.tensor([t not in ends and matcher.validate_tokens([t]) == 1 for t in range(VOCAB)])
        allowed[sorted(ends)] = matcher.is_accepting()
        probs = warp_probs(logits.masked_fill(~allowed, -math.inf), params)[0]
        for token in probs.nonzero().flatten().tolist():
            if token in ends:
                law[tuple(prefix)] = law.get(tuple(prefix), 0.0) + p * float(probs[token])
            else:
                walk([*prefix, token], p * float(probs[token]))

    walk([], 1.0)
    return law


def sampled_under(decoder, prompt, grammar, length, n):
    """Outputs of n generations sampled at temperature 1 under `grammar` (seeds 0..n-1): counts, and their stats."""
    counts: dict[tuple[int, ...], int] = {}
    stats = []
    for seed in range(n):
        sampling = SamplingParams(temperature=1.0, seed=seed, grammar=grammar)
        out = decoder.generate(prompt, GenerationConfig(max_new_tokens=length, sampling=sampling))
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
        stats.append(out.stats)
    return counts, stats


def test_sampling_under_a_grammar_follows_the_masked_target():
    """Chi-square of the first two tokens of JSON integers, sampled by speculative decoding with a model drafter,
    against the exact law of the target restricted by the grammar (false-alarm rate ALPHA)."""
    n, length = 1500, 2
    target = tiny_model("qwen2", vocab_size=VOCAB, init_scale=0.1)
    tok = tiny_chat_tokenizer(VOCAB)
    drafter = ModelDrafter(tiny_model("qwen2", vocab_size=VOCAB, layers=2, seed=5, init_scale=0.1))
    decoder = SpeculativeDecoder(target, tok, drafter, gamma=2)
    grammar = schema_grammar(target, tok, INTEGER)
    prompt = chat_prompt(tok, "a number")
    params = SamplingParams(temperature=1.0, grammar=grammar)
    counts, stats = sampled_under(decoder, prompt, grammar, length, n)
    rejected = sum(s.evaluated - s.accepted for s in stats)
    assert rejected > n // 10, "the drafter must disagree often enough to exercise rejection"
    law = masked_law(target, grammar, prompt, params, eos_token_ids(target, tok), length)
    assert len(law) > 20  # the grammar leaves a real choice: digits, '-', multi-digit tokens
    assert set(counts) <= {cell for cell, p in law.items() if p > 0}  # nothing the grammar forbids
    assert pooled_pvalue(law, counts, n) > ALPHA


class Silent:
    """A drafter that never drafts: every draft of its rounds is text the grammar forces."""

    name, forward_passes, pass_seconds, sessions = "silent", 0, 0.0, ()

    def reset(self, prompt_length=None, budget=None) -> None:
        pass

    def follow(self, target) -> None:
        pass

    def propose(self, context, k, params, generator, stop=0.0) -> Proposal:
        return Proposal([], source=self.name)


def test_text_the_grammar_forces_is_drafted_and_kept_exact():
    """After '{' the schema forces '"name": "', after a name's closing quote ', "age": ': the library's spelling of
    that text is drafted, so even a drafter that never drafts gets rounds of several tokens; the tokens stay plain
    greedy's under the schema."""
    target, tok = tiny_model("llama", vocab_size=VOCAB), tiny_chat_tokenizer(VOCAB)
    prompt = chat_prompt(tok, f"Reply as {EXAMPLE}")
    grammar = schema_grammar(target, tok).bound(len(prompt), frozenset(eos_token_ids(target, tok)))
    assert tok.decode(grammar.forced(prompt)) == '{"name": "'
    after_name = tok.encode('{"name": "fox"')
    assert tok.decode(grammar.forced(prompt + after_name)) == ', "age":'  # the space may start the number's token
    config = GenerationConfig(max_new_tokens=60, sampling=SamplingParams(grammar=schema_grammar(target, tok)))
    plain = PlainDecoder(target, tok).generate(prompt, config)
    out = SpeculativeDecoder(target, tok, Silent(), gamma=8).generate(prompt, config)
    assert (out.tokens, out.finish_reason) == (plain.tokens, plain.finish_reason)
    forced = out.stats.sources["grammar"]
    assert forced.accepted >= 6 and out.stats.rounds < len(plain.tokens) - 5


FORCED = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


def test_sampling_with_forced_drafts_follows_the_masked_target():
    """Chi-square of outputs that start with forced text ('{"n": ') and then sample an integer, drafted by the
    grammar and a small model, against the exact law of the target restricted by the grammar (false-alarm rate
    ALPHA): one-hot forced drafts leave sampling exact, even where the model spells forced text its own way."""
    n = 1500
    target = tiny_model("qwen2", vocab_size=VOCAB, init_scale=0.2)
    tok = tiny_chat_tokenizer(VOCAB)
    drafter = ModelDrafter(tiny_model("qwen2", vocab_size=VOCAB, layers=2, seed=5, init_scale=0.4))
    decoder = SpeculativeDecoder(target, tok, drafter, gamma=7)
    grammar = schema_grammar(target, tok, FORCED)
    prompt = chat_prompt(tok, "a number")
    length = len(grammar.bound(len(prompt), frozenset()).forced(prompt)) + 2  # the forced text, then two tokens
    params = SamplingParams(temperature=1.0, grammar=grammar)
    counts, stats = sampled_under(decoder, prompt, grammar, length, n)
    forced = sum(s.sources["model"].evaluated for s in stats if "model" in s.sources)
    rejected = sum(s.evaluated - s.accepted for s in stats)
    assert forced > n  # first rounds drafted the forced text and the model's tokens after it
    assert rejected > n // 10, "the drafter must disagree often enough to exercise rejection"
    law = masked_law(target, grammar, prompt, params, eos_token_ids(target, tok), length, FORCED)
    assert len(law) > 10 and set(counts) <= {cell for cell, p in law.items() if p > 0}
    assert pooled_pvalue(law, counts, n) > ALPHA


def test_uncompilable_schema_and_unable_method_are_refused_in_one_line():
    target, tok = tiny_model("llama", vocab_size=VOCAB), tiny_chat_tokenizer(VOCAB)
    with pytest.raises(ViasdError, match="cannot be compiled: Invalid type: frobnicate"):
        schema_grammar(target, tok, {"type": "frobnicate"})
    decoder = HFAssistedDecoder(target, tok, tiny_model("llama", vocab_size=VOCAB, layers=2, seed=1), gamma=3)
    config = GenerationConfig(max_new_tokens=4, sampling=SamplingParams(grammar=schema_grammar(target, tok)))
    with pytest.raises(UnsupportedParameter, match="response_format") as caught:
        decoder.generate(chat_prompt(tok, "hi"), config)
    assert caught.value.param == "response_format"


# ------------------------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def chat_app() -> Iterator[TestClient]:
    """The app in process over a tiny random model with a byte-level chat tokenizer, serving lookup and plain."""
    from viasd.engine import Engine, EngineSpec
    from viasd.models.loading import LoadedModel
    from viasd.serve.app import create_app
    from viasd.serve.settings import ServeSettings

    loaded = LoadedModel(tiny_model(vocab_size=VOCAB), tiny_chat_tokenizer(VOCAB), name="tiny", path="tiny")
    engine = Engine(EngineSpec(target="tiny", device="cpu"), target=loaded)
    settings = ServeSettings(model_id="tiny", methods=("lookup", "plain"), max_tokens_limit=80, default_max_tokens=60)
    with TestClient(create_app(engine, settings)) as test_client:
        yield test_client


def ask(app: TestClient, **body):
    messages = [{"role": "user", "content": f"Reply as {EXAMPLE}"}]
    return app.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, **body})


def content(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_response_format_json_schema_is_honoured_alike_by_every_method(chat_app):
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    lookup = content(ask(chat_app, response_format=schema_format))
    jsonschema_rs.validate(SCHEMA, json.loads(lookup))
    assert content(ask(chat_app, response_format=schema_format, method="plain")) == lookup
    assert content(ask(chat_app, guided_json=SCHEMA)) == lookup  # vLLM's extensions
    assert content(ask(chat_app, structured_outputs={"json": json.dumps(SCHEMA)})) == lookup
    with chat_app.stream("POST", "/v1/chat/completions", json={**_body(schema_format), "stream": True}) as got:
        pieces = [json.loads(line[6:]) for line in got.iter_lines() if line.startswith("data: {")]
    assert "".join(p["choices"][0]["delta"].get("content") or "" for p in pieces if p["choices"]) == lookup
    assert isinstance(json.loads(content(ask(chat_app, response_format={"type": "json_object"}))), dict)


def _body(response_format) -> dict:
    messages = [{"role": "user", "content": f"Reply as {EXAMPLE}"}]
    return {"messages": messages, "temperature": 0, "response_format": response_format}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frobnicate"}},
                }
            },
            "response_format",
            "response_format's JSON schema cannot be compiled",
        ),
        ({"response_format": {"type": "yaml"}}, None, "response_format"),
        ({"response_format": {"type": "json_schema"}}, None, "json_schema object"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
        ({"structured_outputs": {"regex": "a+"}}, "structured_outputs", "only 'json'"),
        (
            {"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}},
            "guided_json",
            "give one",
        ),
    ],
    ids=["uncompilable", "unknown-type", "no-schema", "structured-json-text", "structured-regex", "two-at-once"],
)
def test_bad_structured_output_requests_are_400_naming_the_parameter(chat_app, body, param, words):
    response = ask(chat_app, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and "\n" not in error["message"], error
    if param is not None:
        assert error["param"] == param


ENDLESS = [
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},  # only itself: no text at all
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # {"a": {"a": ... for ever
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},  # [[[[ ... for ever
]


@pytest.mark.parametrize("schema", ENDLESS, ids=["self-reference", "required-itself", "items-itself"])
def test_a_schema_that_cannot_terminate_is_a_400_naming_the_parameter_before_any_output(chat_app, schema):
    """Such a schema compiled, then failed the request with an internal message ("a decoder skipped the grammar's
    mask", param null), counted as a failed generation; streamed, a 200 and then an error event."""
    before = chat_app.get("/metrics").text
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for body in (_body(fmt), {**_body(fmt), "stream": True}):
        with chat_app.stream("POST", "/v1/chat/completions", json=body) as response:
            response.read()
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "response_format" and error["code"] == "invalid_schema", error
        assert "response_format's JSON schema cannot terminate" in error["message"], error
        assert "grammar's mask" not in error["message"] and "\n" not in error["message"]
    refused = ask(chat_app, guided_json=schema).json()["error"]
    assert refused["param"] == "guided_json" and "cannot terminate" in refused["message"]
    after = chat_app.get("/metrics").text
    for method in ("lookup", "plain"):
        failed = "viasd_generations_failed_total"
        assert metric(after, failed, method=method) == metric(before, failed, method=method)


def test_schemas_that_end_are_still_compiled():
    """Recursion with a way out (an optional property, an empty list, a null) is no endless schema."""
    target, tok = tiny_model("llama", vocab_size=VOCAB), tiny_chat_tokenizer(VOCAB)
    node = {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}}
    for schema in (
        {"type": "object", "properties": {"a": {"$ref": "#"}}},
        {**node, "required": ["children"]},
        {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["next"]},
    ):
        schema_grammar(target, tok, schema)


def slow_compiles(monkeypatch, seconds: float) -> None:
    """Every schema takes `seconds` more to compile."""
    compile_schema = Grammar.json_schema.__func__

    def slow(cls, *args, **kwargs):
        time.sleep(seconds)
        return compile_schema(cls, *args, **kwargs)

    monkeypatch.setattr(Grammar, "json_schema", classmethod(slow))


def test_a_slow_schema_holds_up_no_tokenizing_and_is_refused_after_its_time(chat_app, monkeypatch):
    """Schemas compiled on the tokenizer's one worker: a slow one stalled /tokenize and every prompt's encoding."""
    import viasd.serve.structured as structured

    slow_compiles(monkeypatch, 1.5)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    answers = []
    asking = threading.Thread(target=lambda: answers.append(ask(chat_app, response_format=fmt, max_tokens=4)))
    asking.start()
    time.sleep(0.3)  # its schema is compiling
    began = time.monotonic()
    tokens = chat_app.post("/tokenize", json={"prompt": "hello"})
    waited = time.monotonic() - began
    asking.join(timeout=60)
    assert tokens.status_code == 200 and waited < 1.0, waited
    assert answers and answers[0].status_code == 200, answers
    monkeypatch.setattr(structured, "COMPILE_SECONDS", 0.5)
    refused = ask(chat_app, response_format=fmt)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "response_format" and "was not compiled within 0.5 s" in error["message"], error
