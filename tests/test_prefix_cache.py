"""The prefix cache across generations (passes/prefix_cache.py): a later prompt that starts like an earlier
generation's tokens starts from their kept KV, and gets what it gets without the cache."""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

import pytest
import torch

from helpers import ATOL, assert_cache_equals, fresh_cache
from tiny import ARCHITECTURES, tiny_model, tiny_tokenizer
from viasd.decode.base import Decoder, GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.decode.round import RoundPolicy
from viasd.decode.speculative import SpeculativeDecoder
from viasd.decode.tiered import TieredDecoder
from viasd.drafters.head import HeadDrafter
from viasd.drafters.hybrid import HybridDrafter
from viasd.drafters.model_drafter import ModelDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.heads.network import DraftHead, HeadConfig
from viasd.passes.prefix_cache import (
    REREAD,
    PrefixCache,
    copy_session,
    exact_reuse,
    read_prompt,
    resumable_cut,
    resume_session,
)
from viasd.passes.session import KVSession
from viasd.verify.gates import Gate
from viasd.verify.sampling import SamplingParams
from viasd.views.layer_skip import LayerMask

FIRST = [3, 4, 5, 6, 7, 3, 4, 5, 9, 12, 14, 15]


def copied_tensors(copy) -> list[torch.Tensor]:
    return [t.clone() for layer in copy.layers for t in (layer.keys, layer.values)]


def unchanged(copy, before: list[torch.Tensor]) -> bool:
    now = [t for layer in copy.layers for t in (layer.keys, layer.values)]
    return all(torch.equal(a, b) for a, b in zip(now, before, strict=True))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_resumed_cache_equals_a_fresh_pass_and_the_entry_is_never_changed(arch):
    model = tiny_model(arch)
    session = KVSession(model)
    session.extend_to(FIRST)
    steps = [20, 21, 22, 23]
    for token in steps:  # decoding steps, then slim entries beyond the committed ones (pending: never kept)
        session.forward([token])
    session.forward_slim([30, 31], LayerMask.skipping(4, [2]))
    copy = copy_session(session)
    assert copy is not None and copy.tokens == tuple(FIRST + steps)
    before = copied_tensors(copy)
    second = FIRST + steps[:2] + [40, 41, 42]
    cut = resumable_cut(copy, second)
    assert cut == len(FIRST) + 2  # the common prefix
    resumed = KVSession(model)
    resume_session(resumed, copy, cut)
    assert resumed.tokens == second[:cut] and not resumed.pending
    resumed.extend_to(second)
    assert_cache_equals(resumed.cache, fresh_cache(model, second), len(second), atol=ATOL.get(arch, 1e-10))
    resumed.forward([43, 44])  # the resumed session writes on, crops back: the entry stays as it was
    resumed.truncate(3)
    resumed.forward([45])
    assert unchanged(copy, before)
    # A prompt the entry holds whole: its last tokens are read again for their logits, never cropped from it.
    assert resumable_cut(copy, FIRST) == len(FIRST) - 2
    assert resumable_cut(copy, [9, 9, 9, 9]) == 0


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_sliding_windows_resume_only_where_the_window_is_held(arch):
    window = 6
    model = tiny_model(arch, sliding_window=window)
    prompt = [(7 * i) % 60 + 3 for i in range(20)]
    session = KVSession(model)
    session.extend_to(prompt)
    for token in (50, 51, 52, 53):
        session.forward([token])
    untrimmed = copy_session(session)  # the sliding layers hold every position since nothing was cropped yet
    assert untrimmed is not None and untrimmed.serves(3)
    session.truncate(session.committed - 1)  # a rollback trims them to the window that ends at the cut
    copy = copy_session(session)
    assert copy is not None
    held = [*prompt, 50, 51, 52]
    assert copy.serves(len(held))
    assert not copy.serves(len(held) - 1)  # a window the sliding layers no longer hold
    assert resumable_cut(copy, [*prompt[:10], 1, 2, 3]) == 0
    assert resumable_cut(copy, [*held[:-1], 60, 61, 62]) == 0
    later = [*held, 60, 61]
    cut = resumable_cut(copy, later)
    assert cut == len(held)
    resumed, fresh = KVSession(model), KVSession(model)
    resume_session(resumed, copy, cut)
    atol = ATOL.get(arch, 1e-10)
    assert torch.allclose(resumed.extend_to(later), fresh.extend_to(later), atol=atol)
    for token in (5, 9, 13):  # decoding on (and a rollback of one step) past the window
        assert torch.allclose(resumed.forward([token]), fresh.forward([token]), atol=atol)
    resumed.truncate(resumed.committed - 1)
    fresh.truncate(fresh.committed - 1)
    assert torch.allclose(resumed.forward([17]), fresh.forward([17]), atol=atol)


def tiny_head(seed: int = 0) -> DraftHead:
    """A random draft head over the tiny models' whole vocabulary, peaked enough to draft."""
    torch.manual_seed(seed)
    head = DraftHead(HeadConfig(hidden=64, width=32, vocab=64), torch.arange(64)).to(torch.float64)
    for parameter in head.parameters():
        torch.nn.init.normal_(parameter, std=0.05)
    return head


def tiny_decoders(arch: str = "qwen2") -> dict[str, Decoder]:
    target = tiny_model(arch)
    tok = tiny_tokenizer(64)
    drafter = tiny_model(arch, layers=2, seed=1)
    relaxed = RoundPolicy(Gate("confidence", (0.02, 0.6)), cap=6)
    return {
        "plain": PlainDecoder(target, tok),
        "sd": SpeculativeDecoder(target, tok, ModelDrafter(drafter), gamma=3),
        "lookup": SpeculativeDecoder(target, tok, PromptLookupDrafter(), gamma=4),
        "hybrid": SpeculativeDecoder(target, tok, HybridDrafter(PromptLookupDrafter(), ModelDrafter(drafter))),
        "head": SpeculativeDecoder(target, tok, HeadDrafter(tiny_head(), target), gamma=4),
        "via": TieredDecoder(target, tok, ModelDrafter(drafter), [LayerMask.skipping(4, [1])], relaxed),
    }


def cached(decoder: Decoder, cache: PrefixCache, key: str, prompt: list[int], config: GenerationConfig) -> list[int]:
    """What the server does: a generation started from the cache, kept there when it ends."""
    result = decoder.generate(prompt, config, resume=functools.partial(cache.resume, key))
    cache.keep(key, decoder.sessions())
    return result.tokens


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=7)])
@pytest.mark.parametrize("method", ["plain", "sd", "lookup", "hybrid", "head", "via"])
def test_a_later_turn_gets_with_the_cache_what_it_gets_without(method, params):
    decoder = tiny_decoders()[method]
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True, sampling=params)
    cache = PrefixCache(1 << 30)
    first = cached(decoder, cache, method, FIRST, config)
    second = FIRST + first + [40, 41, 42, 43]
    third_turn = cached(decoder, cache, method, second, config)
    counts = cache.counts()
    assert counts.hits == 1 and counts.misses == 1 and counts.reused_tokens > len(FIRST)
    assert third_turn == decoder.generate(second, config).tokens  # the same decoder, the cache off
    # A regenerated answer (the same prompt again) and a prompt sharing only the start come out the same too.
    for prompt in (second, [*FIRST[:6], 33, 34, 35]):
        assert cached(decoder, cache, method, prompt, config) == decoder.generate(prompt, config).tokens
    assert cache.counts().hits == 3


def test_entries_of_one_method_never_start_another():
    decoders = tiny_decoders()
    cache = PrefixCache(1 << 30)
    config = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    cached(decoders["sd"], cache, "sd", FIRST, config)
    assert cache.resume("plain", decoders["plain"].sessions(), [*FIRST, 40, 41]) == 0
    assert cache.counts().misses == 2


def session_bytes(model, tokens: list[int]) -> int:
    session = KVSession(model)
    session.forward(tokens)
    copy = copy_session(session)
    assert copy is not None
    return copy.nbytes


def test_the_memory_bound_holds_and_the_least_recently_used_entry_goes_first():
    model = tiny_model()
    decoder = PlainDecoder(model, tiny_tokenizer(64))
    config = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    prompts = [[10 + i] * 6 + [3, 4, 5, 6] for i in range(4)]  # unrelated prompts of one length
    one = session_bytes(model, prompts[0] + [0] * 3)  # an entry: the prompt and all but the last new token
    cache = PrefixCache(2 * one + one // 2)  # room for two
    for prompt in prompts[:3]:
        cached(decoder, cache, "plain", prompt, config)
        assert cache.counts().bytes <= cache.capacity_bytes
    counts = cache.counts()
    assert counts.entries == 2 and counts.evictions == 1 and counts.bytes == 2 * one
    assert cache.resume("plain", decoder.sessions(), prompts[0] + [1, 2]) == 0  # the oldest went
    assert cache.resume("plain", decoder.sessions(), prompts[1] + [1, 2]) > 0  # now the most recently used
    cached(decoder, cache, "plain", prompts[3], config)  # evicts prompts[2]'s entry, not prompts[1]'s
    assert cache.resume("plain", decoder.sessions(), prompts[2] + [1, 2]) == 0
    assert cache.resume("plain", decoder.sessions(), prompts[1] + [1, 2]) > 0
    assert cache.counts().evictions == 2 and cache.counts().bytes <= cache.capacity_bytes
    # An entry that extends another replaces it (a chat's next turn), without counting as an eviction.
    answer = decoder.generate(prompts[1], config).tokens
    cached(decoder, cache, "plain", [*prompts[1], *answer, 7], config)
    assert cache.counts().entries == 2 and cache.counts().evictions == 2
    assert cache.counts().bytes <= cache.capacity_bytes
    small = PrefixCache(one - 1)  # an entry larger than the whole bound is not kept
    cached(decoder, small, "plain", prompts[0], config)
    assert small.counts().entries == 0 and small.counts().bytes == 0
    off = PrefixCache(0)
    cached(decoder, off, "plain", prompts[0], config)
    assert off.counts() == type(off.counts())()


def test_an_entry_larger_than_the_cache_is_counted_in_the_metrics_and_said_once(caplog):
    """Such an entry was never kept and nothing said so: a cache too small for the prompts served did nothing."""
    from viasd.serve.metrics import prefix_cache_text

    model = tiny_model()
    decoder = PlainDecoder(model, tiny_tokenizer(64))
    config = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    prompt = [10] * 6 + [3, 4, 5, 6]
    small = PrefixCache(session_bytes(model, prompt + [0] * 3) - 1)
    with caplog.at_level(logging.WARNING, logger="viasd"):
        for _ in range(3):
            cached(decoder, small, "plain", prompt, config)
    assert small.counts().refused == 3 and small.counts().entries == 0
    said = [r.getMessage() for r in caplog.records if "prefix cache" in r.getMessage()]
    assert len(said) == 1 and "exceed the whole cache" in said[0] and "--prefix-cache-mb" in said[0], said
    assert metric(prefix_cache_text(small.counts()), "viasd_prefix_cache_refused_total") == 3
    roomy = PrefixCache(1 << 20)
    cached(decoder, roomy, "plain", prompt, config)
    assert roomy.counts().refused == 0 and roomy.counts().entries == 1


# ---------------------------------------------------------------------------------------------- the server


def metric(text: str, name: str) -> float:
    """The value of the unlabelled sample `name` in a Prometheus text."""
    (value,) = [line.split()[-1] for line in text.splitlines() if line.startswith(f"{name} ")]
    return float(value)


def served_texts(app, bodies: list[dict[str, Any]], together: bool) -> list[str]:
    """The completions' texts, asked one after another or all at once."""
    if not together:
        return [app.post("/v1/completions", json=body).json()["choices"][0]["text"] for body in bodies]
    texts: list[str] = [""] * len(bodies)
    barrier = threading.Barrier(len(bodies))

    def ask(index: int) -> None:
        barrier.wait(timeout=30)
        texts[index] = app.post("/v1/completions", json=bodies[index]).json()["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return texts


def test_served_later_turns_alone_and_batched_get_what_they_get_with_the_cache_off(tmp_path, monkeypatch):
    """Second turns of four conversations (plain, prompt lookup and sd), asked alone and eight at once on an app
    that runs four generations together with the cache on, answer as the app with the cache off does; /metrics
    counts it."""
    from fastapi.testclient import TestClient

    from viasd.engine import Engine, EngineSpec
    from viasd.models.loading import LoadedModel
    from viasd.serve.app import create_app
    from viasd.serve.settings import ServeSettings
    from viasd.views.recipe import QuantRecipe

    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path))
    loaded = LoadedModel(model=tiny_model(), tokenizer=tiny_tokenizer(64), name="tiny", path="tiny")
    drafter = LoadedModel(model=tiny_model(layers=2, seed=1), tokenizer=tiny_tokenizer(64), name="d", path="d")
    # The 4-bit view: viasd's kernels give a row the same bits whatever else is in its pass.
    spec = EngineSpec(target="tiny", drafter="d", device="cpu", quant=QuantRecipe.parse("int4a8"))
    engine = Engine(spec, target=loaded, drafter=drafter)
    prompts = ["t3 t4 t5 t6 t3 t4", "t9 t8 t7", "t20 t21 t22 t20 t21", "t5 t5 t6 t7 t8 t9 t10"]

    def body(prompt: str, index: int) -> dict[str, Any]:
        return {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "method": ("plain", "lookup", "sd")[index % 3]}  # fmt: skip

    def settings(megabytes: int) -> ServeSettings:
        return ServeSettings(model_id="tiny", methods=("plain", "lookup", "sd"), max_tokens_limit=16,
                             default_max_tokens=4, max_active=4, prefix_cache_mb=megabytes)  # fmt: skip

    with TestClient(create_app(engine, settings(0))) as app:
        firsts = served_texts(app, [body(prompts[i % 4], i) for i in range(8)], together=False)
        seconds = [body(f"{prompts[i % 4]} {firsts[i]} t30 t31", i) for i in range(8)]
        want = served_texts(app, seconds, together=False)
        assert "viasd_prefix_cache" not in app.get("/metrics").text
    with TestClient(create_app(engine, settings(64))) as app:
        assert served_texts(app, [body(prompts[i % 4], i) for i in range(8)], together=False) == firsts
        assert served_texts(app, seconds, together=False) == want
        assert served_texts(app, seconds, together=True) == want
        text = app.get("/metrics").text
    assert metric(text, "viasd_prefix_cache_hits_total") >= 16
    assert metric(text, "viasd_prefix_cache_reused_tokens_total") > 0
    assert 0 < metric(text, "viasd_prefix_cache_bytes") <= metric(text, "viasd_prefix_cache_capacity_bytes") == 64 << 20
    assert metric(text, "viasd_prefix_cache_evictions_total") == 0 and all(firsts)


# ------------------------------------------------------------------- exact reuse on the fused low-bit layers


def fused_runs() -> bool:
    from viasd.kernels import fused_layers
    from viasd.kernels.build import Library

    return isinstance(fused_layers.kernel(), Library)


needs_fused = pytest.mark.skipif(not fused_runs(), reason="no fused layers here")


def int4a8_session(model) -> KVSession:
    from viasd.views.quantize import quantize
    from viasd.views.recipe import QuantRecipe
    from viasd.views.view import View

    return KVSession(model, View(linears=quantize(model, QuantRecipe.parse("int4a8"))))


@needs_fused
def test_a_prompt_read_in_pieces_after_a_resumed_prefix_holds_a_fresh_reads_bits():
    """On the fused layers a row is the same bits in any pass, so a prompt read in pieces of at most 16 tokens is
    a fresh read's wherever the resumed part ends: the invariant the server's and the chat's prefix reuse rest on."""
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    earlier = int4a8_session(model)
    assert exact_reuse([earlier]) is None
    first = [(5 * i) % 60 + 2 for i in range(40)]
    assert read_prompt(earlier, first) == 0 and earlier.committed == len(first) - REREAD
    assert earlier.routes == {"fused": 3}  # 16, 16 and 6 tokens
    earlier.forward(first[-REREAD:])
    for token in (7, 8, 9, 10, 11):  # decoding steps and a verification block
        earlier.forward([token])
    earlier.forward([12, 13, 14, 15])
    copy = copy_session(earlier)
    assert copy is not None
    later = [*earlier.tokens, *[(3 * i) % 60 + 2 for i in range(23)]]
    resumed, fresh = int4a8_session(model), int4a8_session(model)
    cut = resumable_cut(copy, later)
    assert cut == len(earlier.tokens)
    resume_session(resumed, copy, cut)
    assert read_prompt(resumed, later) == cut and read_prompt(fresh, later) == 0
    held = len(later) - REREAD
    assert resumed.tokens == fresh.tokens == later[:held]
    for a, b in zip(resumed.cache.layers, fresh.cache.layers, strict=True):
        assert torch.equal(a.keys[..., :held, :], b.keys[..., :held, :])
        assert torch.equal(a.values[..., :held, :], b.values[..., :held, :])
    assert torch.equal(resumed.forward(later[held:]), fresh.forward(later[held:]))


def test_reuse_is_exact_only_on_the_fused_layers():
    why = exact_reuse([KVSession(tiny_model())], "method 'plain'")  # float32: torch's products, not the fused layers
    assert why is not None and "not on viasd's fused low-bit layers" in why
    assert exact_reuse([], "method 'hf'") == "method 'hf' runs no KV session of viasd's"


def tiny_engine(dtype: torch.dtype):
    from viasd.engine import Engine, EngineSpec
    from viasd.models.loading import LoadedModel
    from viasd.views.recipe import QuantRecipe

    tok = tiny_tokenizer(64)
    loaded = LoadedModel(model=tiny_model(dtype=dtype), tokenizer=tok, name="tiny", path="tiny")
    drafter = LoadedModel(model=tiny_model(layers=2, seed=1, dtype=dtype), tokenizer=tok, name="d", path="d")
    spec = EngineSpec(target="tiny", drafter="d", device="cpu", quant=QuantRecipe.parse("int4a8"))
    return Engine(spec, target=loaded, drafter=drafter)


SERVED = ("plain", "sd", "sd:drafter=suffix")


def serve_settings(**options):
    from viasd.serve.settings import ServeSettings

    return ServeSettings(model_id="tiny", methods=SERVED, max_tokens_limit=32, default_max_tokens=8, **options)


def completions(client, prompts: list[str], method: str) -> list[str]:
    """Greedy completions through the official client, one after another."""
    out = []
    for prompt in prompts:
        answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                           extra_body={"method": method, "ignore_eos": True})  # fmt: skip
        out.append(answer.choices[0].text)
    return out


@needs_fused
@pytest.mark.parametrize("method", SERVED)
@pytest.mark.parametrize("active", [1, 4])  # 1: no pass batcher, a prompt read alone; 4: merged passes
def test_on_the_fused_layers_the_server_keeps_prefixes_by_default_and_a_hit_answers_as_a_fresh_server(
    method, active, tmp_path, monkeypatch
):
    """Read whole, a prompt's entries were not the bits of one resumed and read on in pieces, and sd's second turns
    came out otherwise (this test without the pieces); read in pieces of 16 either way, they are."""
    import openai
    from fastapi.testclient import TestClient

    from viasd.serve.app import create_app
    from viasd.serve.settings import DEFAULT_PREFIX_CACHE_MB

    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path))
    prompts = ["t3 t4 t5 t6 t3 t4 t7 t8 t9 t10 t11 t12 t13 t14 t15 t16 t17 t18 t19", "t9 t8 t7 t9 t8"]
    settings = serve_settings(max_active=active)
    with TestClient(create_app(tiny_engine(torch.bfloat16), settings)) as app:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=app, max_retries=0)
        firsts = completions(client, prompts, method)
        # The next turns: the earlier prompt and answer, then more (longer than a piece of 16 tokens).
        later = [f"{p}{a} t30 t31 t32 t33 t34 t35 t36 t37 t38 t39 t40 t41 t42 t43 t44 t45 t46 t47"
                 for p, a in zip(prompts, firsts, strict=True)]  # fmt: skip
        resumed = completions(client, later, method)
        text = app.get("/metrics").text
    assert metric(text, "viasd_prefix_cache_capacity_bytes") == DEFAULT_PREFIX_CACHE_MB << 20
    assert metric(text, "viasd_prefix_cache_hits_total") >= len(later)
    assert metric(text, "viasd_prefix_cache_reused_tokens_total") > 0
    with TestClient(create_app(tiny_engine(torch.bfloat16), settings)) as app:  # a fresh server
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=app, max_retries=0)
        assert completions(client, later, method) == resumed
        assert metric(app.get("/metrics").text, "viasd_prefix_cache_hits_total") == 0


def test_off_by_default_where_reuse_cannot_be_exact_said_in_one_line_and_on_when_asked(tmp_path, monkeypatch, caplog):
    from fastapi.testclient import TestClient

    from viasd.serve.app import create_app

    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path))
    engine = tiny_engine(torch.float32)  # float32 products: not the fused layers
    with caplog.at_level(logging.INFO, logger="viasd.serve"), TestClient(create_app(engine, serve_settings())) as app:
        assert "viasd_prefix_cache" not in app.get("/metrics").text
    said = [r.getMessage() for r in caplog.records if "prefix cache" in r.getMessage()]
    assert len(said) == 1 and "off for plain, sd, sd:drafter=suffix: the target runs as int4a8" in said[0], said
    with TestClient(create_app(engine, serve_settings(prefix_cache_mb=8))) as app:
        assert metric(app.get("/metrics").text, "viasd_prefix_cache_capacity_bytes") == 8 << 20


def test_the_prefix_cache_size_is_auto_or_megabytes():
    from viasd.errors import ViasdError
    from viasd.serve.settings import parse_megabytes

    assert parse_megabytes("auto") is None and parse_megabytes(" 64 ") == 64 and parse_megabytes("0") == 0
    with pytest.raises(ViasdError, match="must be 'auto' or a whole number of MiB"):
        parse_megabytes("-1")
