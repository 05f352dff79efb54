"""Passes of concurrent generations merged by a `PassBatcher` (passes/batching.py): each generation, on its own
thread with its own decoder, gets exactly the tokens it gets alone (greedy, and sampled with its own seed), for plain
decoding, speculative decoding and prompt lookup; passes really are merged; a long prompt goes in chunks; an error
in a pass reaches its generation and the others go on."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.decode.speculative import SpeculativeDecoder
from viasd.drafters.head import HeadDrafter
from viasd.drafters.model_drafter import ModelDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.heads.network import DraftHead, HeadConfig
from viasd.passes import loop
from viasd.passes.batching import PassBatcher, _Request, next_pass, ready
from viasd.passes.executor import PassExecutor
from viasd.passes.loop import Segment
from viasd.passes.session import KVSession
from viasd.verify.sampling import SamplingParams
from viasd.views.quantize import quantize
from viasd.views.recipe import QuantRecipe
from viasd.views.view import View

PROMPTS = [[3, 4, 5, 6, 7, 3, 4, 5], list(range(10, 50)), [9, 8, 7], [20, 21, 22, 20, 21, 22, 20]]


@pytest.fixture(scope="module")
def pair():
    # float64 activations: the torch references round a row alike in blocks of any size (in float32, torch's
    # attention rounds a block of 4 or more queries otherwise on some CPUs, AVX2 ones among them), and the drafts'
    # lengths change under load.
    target, drafter = tiny_model("qwen2"), tiny_model("qwen2", layers=2, seed=1)
    return target, drafter, View(linears=quantize(target, QuantRecipe.parse("int4a8")))


def decoder_for(kind: str, target, drafter, view):
    """A fresh decoder (each generation its own sessions), the target run as its int4a8 view (row-independent)."""
    tok = tiny_tokenizer(64)
    if kind == "plain":
        return PlainDecoder(target, tok, view)
    if kind == "lookup":
        return SpeculativeDecoder(target, tok, PromptLookupDrafter(3, 1), 4, "lookup", view)
    if kind == "head":
        torch.manual_seed(0)
        head = DraftHead(HeadConfig(hidden=64, width=32, vocab=64), torch.arange(64))
        for parameter in head.parameters():
            torch.nn.init.normal_(parameter, std=0.05)
        return SpeculativeDecoder(target, tok, HeadDrafter(head, target), 4, "sd:drafter=head", view)
    return SpeculativeDecoder(target, tok, ModelDrafter(drafter), 4, "sd", view)


def config(index: int, sampled: bool) -> GenerationConfig:
    params = SamplingParams(temperature=0.8, seed=100 + index) if sampled else SamplingParams()
    return GenerationConfig(max_new_tokens=24, ignore_eos=True, sampling=params)


def run_together(kinds, configs, pair, batchers, executor=None):
    """Each generation on its own thread with its own decoder, all started at once, passes merged by `batchers`
    (and, with an executor, run on this thread while it serves)."""
    target, drafter, view = pair
    results: list = [None] * len(kinds)
    start = threading.Barrier(len(kinds))

    def run(i: int, kind: str) -> None:
        decoder = decoder_for(kind, target, drafter, view)
        with contextlib.ExitStack() as active:
            for batcher in batchers:
                active.enter_context(batcher.active())
            start.wait()
            results[i] = decoder.generate(PROMPTS[i % 4], configs[i])

    for batcher in batchers:
        batcher.attach()
    try:
        threads = [threading.Thread(target=run, args=(i, kind)) for i, kind in enumerate(kinds)]
        for thread in threads:
            thread.start()
        if executor is not None:
            deadline = time.monotonic() + 120
            executor.serve(until=lambda: not any(t.is_alive() for t in threads) or time.monotonic() > deadline)
        for thread in threads:
            thread.join(timeout=120)
    finally:
        for batcher in batchers:
            batcher.detach()
    return results


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_concurrent_generations_get_what_they_get_alone(pair, sampled):
    target, drafter, view = pair
    kinds = ["plain", "sd", "lookup", "plain", "sd", "lookup", "plain", "sd"]  # eight at once, methods mixed
    alone = [
        decoder_for(kind, target, drafter, view).generate(PROMPTS[i % 4], config(i, sampled)).tokens
        for i, kind in enumerate(kinds)
    ]
    batchers = [PassBatcher(target, window=0.05), PassBatcher(drafter, window=0.05)]
    together = [result.tokens for result in run_together(kinds, [config(i, sampled) for i in range(8)], pair, batchers)]
    assert together == alone
    assert batchers[0].merged_rows > 0 and batchers[1].merged_rows > 0  # passes really ran together


def test_a_draft_head_drafts_from_merged_passes_and_tokens_stay_what_they_are_alone(pair):
    """The features a head drafts from come out of merged passes too (each segment's own rows)."""
    target, drafter, view = pair
    kinds = ["head", "plain", "head", "sd"]
    alone = [decoder_for(k, target, drafter, view).generate(PROMPTS[i], config(i, False)) for i, k in enumerate(kinds)]
    # Fixed draft lengths: adaptive ones follow measured pass costs, and on a busy machine may draft nothing for a
    # round, which the count below would take for a missing feature.
    batchers = [PassBatcher(target, window=0.05, adapt_drafts=False), PassBatcher(drafter, window=0.05)]
    together = run_together(kinds, [config(i, False) for i in range(4)], pair, batchers)
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert batchers[0].merged_rows > 0
    for kind, mine, own in zip(kinds, together, alone, strict=True):
        if kind == "head":  # it drafted in every round after the first: it found the merged passes' features
            for stats in (mine.stats.sources["head"], own.stats.sources["head"]):
                assert stats.drafted >= stats.rounds - 1 >= 10, stats


def test_a_long_prompt_goes_in_chunks_and_gives_the_same_tokens(pair):
    target, _, view = pair
    prompt = list(range(3, 63)) + list(range(5, 40))  # 95 tokens: three chunks of 32 and a tail
    want = decoder_for("plain", target, None, view).generate(prompt, config(0, False)).tokens
    batcher = PassBatcher(target, chunk=32).attach()
    try:
        with batcher.active():
            got = decoder_for("plain", target, None, view).generate(prompt, config(0, False)).tokens
    finally:
        batcher.detach()
    # Three chunks of the prompt (its last gives token 1), 23 steps; where the view reads a prompt's head with the
    # model's own weights (CPUs with AMX), the head in own-weights chunks (one: they hold up to 256 tokens) and the
    # last token's pass through the view.
    chunks = 3 if view.linears.recipe.own_weights_from("cpu") is None else -(-94 // batcher.own_chunk) + 1
    assert got == want and batcher.passes == chunks + 23


def test_a_block_across_a_chunk_boundary_keeps_all_its_logits(pair):
    """A verification block read with the prompt (prompt and drafts in one pass) may start in one chunk and end in
    the next: 98 tokens go as chunks of 32, 32, 32 and 2, and the last 5 positions' logits come from two of them."""
    target, _, view = pair
    ids = list(range(3, 63)) + list(range(5, 43))
    want = KVSession(target, view).forward(ids, keep=5)
    batcher = PassBatcher(target, chunk=32).attach()
    try:
        with batcher.active():
            got = KVSession(target, view).forward(ids, keep=5)
    finally:
        batcher.detach()
    # Where the view reads a prompt's head with the model's own weights (CPUs with AMX): the head's 93 tokens in one
    # own-weights chunk (up to 256), the kept 5 in one chunk of the view.
    passes = 4 if view.linears.recipe.own_weights_from("cpu") is None else 2
    assert got.shape == want.shape == (5, want.shape[-1]) and batcher.passes == passes
    assert torch.allclose(got, want, atol=1e-4) and torch.equal(got.argmax(-1), want.argmax(-1))


def test_an_error_in_a_pass_reaches_its_generation_and_the_batcher_goes_on(pair, monkeypatch):
    target, _, view = pair
    batcher = PassBatcher(target).attach()
    try:
        from viasd.passes import batching

        real = batching.loop.ragged_pass
        monkeypatch.setattr(batching.loop, "ragged_pass", lambda *a: (_ for _ in ()).throw(MemoryError("no room")))
        with pytest.raises(MemoryError, match="no room"), batcher.active():
            decoder_for("plain", target, None, view).generate(PROMPTS[0], config(0, False))
        monkeypatch.setattr(batching.loop, "ragged_pass", real)
        with batcher.active():
            got = decoder_for("plain", target, None, view).generate(PROMPTS[0], config(0, False)).tokens
    finally:
        batcher.detach()
    assert got == decoder_for("plain", target, None, view).generate(PROMPTS[0], config(0, False)).tokens


def test_drafts_shorten_under_load_and_tokens_stay_what_they_are_alone(pair):
    """With passes whose rows cost what a token costs, four speculative generations draft less per round; greedy
    ones and unseeded ones adapt, a seeded sampled one keeps its draft length (its draws must repeat)."""
    target, drafter, view = pair
    configs = [config(0, False), config(1, False), config(2, False), config(3, True)]  # the last: sampled, seeded
    alone = [decoder_for("sd", target, drafter, view).generate(PROMPTS[i], configs[i]) for i in range(4)]
    batcher = PassBatcher(target, window=0.05)
    for rows in range(1, 65):  # as if every row cost 1 s: speculation cannot pay
        batcher.costs(view).record(rows, float(rows))
    together = run_together(["sd"] * 4, configs, pair, [batcher, PassBatcher(drafter, window=0.05)])
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    per_round = [r.stats.drafted / r.stats.rounds for r in together]
    assert max(per_round[:3]) < 1.0 < 3.0 < per_round[3], per_round
    assert min(r.stats.drafted / r.stats.rounds for r in alone) > 3.0


def test_with_an_executor_every_pass_runs_on_its_thread_and_tokens_stay_the_same(pair, monkeypatch):
    """The server's way: generations on worker threads, every pass (merged or alone) on the executor's thread."""
    target, drafter, view = pair
    kinds = ["plain", "sd", "lookup", "sd"]
    configs = [config(i, False) for i in range(4)]
    alone = [
        decoder_for(kind, target, drafter, view).generate(PROMPTS[i], configs[i]).tokens for i, kind in enumerate(kinds)
    ]
    executor = PassExecutor()
    threads_that_ran = set()
    real = loop.ragged_pass

    def recording(*args, **kwargs):
        threads_that_ran.add(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "ragged_pass", recording)
    batchers = [
        PassBatcher(target, window=0.05, executor=executor),
        PassBatcher(drafter, window=0.05, executor=executor),
    ]
    together = run_together(kinds, configs, pair, batchers, executor)
    assert [r.tokens for r in together] == alone
    assert threads_that_ran == {threading.get_ident()} and executor.jobs_run == sum(b.passes for b in batchers) > 0


def waiting_segments(rows: list[int], views=None) -> list[_Request]:
    """Requests as a batcher queues them, oldest first: segments of `rows` tokens each (no cache: never run)."""
    views = views or [None] * len(rows)
    segments = [Segment(None, torch.zeros(n, dtype=torch.long), 1) for n in rows]  # type: ignore[arg-type]
    return [_Request(view, segment=segment) for segment, view in zip(segments, views, strict=True)]


def test_the_oldest_request_is_always_in_the_next_pass_and_rows_are_bounded():
    waiting = waiting_segments([32, 1, 5, 1, 32, 1])
    assert next_pass(waiting, 40) == [waiting[0], waiting[1], waiting[2], waiting[3], waiting[5]]  # 32+1+5+1+1 rows
    assert next_pass(waiting, 16) == [waiting[0]]  # a chunk over the bound still runs, alone: it never starves
    other_view = View()
    mixed = waiting_segments([1, 1, 1], [other_view, None, other_view])
    assert next_pass(mixed, 64) == [mixed[0], mixed[2]]  # one view per pass: the oldest's
    alone = [_Request(None, alone=lambda: None), *waiting_segments([1])]
    assert next_pass(alone, 64) == [alone[0]]


def test_every_active_generation_waits_somewhere_and_cheaper_models_go_first():
    target, drafter = 1_500, 500  # parameters: the drafter's passes are the cheaper ones
    assert ready(4, 4, target, []) and not ready(4, 3, target, [])  # alone: when all four have asked
    assert not ready(2, 1, target, [(0, drafter)])  # one generation is neither here nor drafting: wait for it
    assert not ready(2, 1, target, [(1, drafter)])  # it is drafting: its drafter pass runs first
    assert ready(2, 1, drafter, [(1, target)])  # ... which is this one
    assert ready(3, 2, target, [(1, target)])  # another view of a model as dear: no order between them
