"""The route of a pass (passes/route.py) as a value: one decision from the pass's length and explicit facts, for a
single token, a block, a prompt, batched rows, a chunked prompt, a quantized view's split prompt, no kernels, and a
model the loop does not cover; sessions take it once per pass and count their passes by it."""

import json
import subprocess
import sys

import torch

from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.passes.batching import PassBatcher
from viasd.passes.features import FeatureStore
from viasd.passes.route import Facts, Kind, Leg, Route, Schedule, Stack, decide
from viasd.passes.session import KVSession
from viasd.views.layer_skip import LayerMask
from viasd.views.view import View

LOOPED = Facts(loop=True, attention_kernel=True)
ALONE, BATCHED, QUEUED = Schedule.ALONE, Schedule.BATCHED, Schedule.QUEUED


def test_steps_and_blocks_take_the_loop_and_prompts_the_models_forward():
    assert decide(1, 1, LOOPED) == Route(Kind.LOOP, (Leg(0, 1, 1, ALONE, Stack.LOOP, True),))
    assert decide(5, 5, LOOPED) == Route(Kind.LOOP, (Leg(0, 5, 5, ALONE, Stack.LOOP, True),))
    assert decide(16, 1, LOOPED).kind is Kind.LOOP  # PACK_UP_TO tokens at most
    assert decide(17, 1, LOOPED) == Route(Kind.MODEL, (Leg(0, 17, 1, ALONE, Stack.MODEL),))


def test_a_low_bit_view_runs_fused_and_without_kernels_the_loop_uses_the_references():
    fused = Facts(loop=True, fused=True, attention_kernel=True)
    assert decide(4, 4, fused) == Route(Kind.FUSED, (Leg(0, 4, 4, ALONE, Stack.FUSED),))
    assert decide(4, 4, Facts(loop=True)) == Route(Kind.LOOP, (Leg(0, 4, 4, ALONE, Stack.LOOP, False),))


def test_what_the_loop_does_not_run_takes_the_models_forward():
    for facts in (Facts(loop=False), Facts(loop=True, skips=True)):  # not covered; a layer skipped, not fused
        assert decide(1, 1, facts) == Route(Kind.MODEL, (Leg(0, 1, 1, ALONE, Stack.MODEL),))
        batched = Facts(facts.loop, chunk=32, skips=facts.skips)
        assert decide(1, 1, batched) == Route(Kind.QUEUED, (Leg(0, 1, 1, QUEUED, Stack.MODEL),))
        assert decide(70, 1, batched).kind is Kind.QUEUED  # never chunked: the batcher cannot merge it


def test_a_view_that_skips_whole_layers_runs_fused_but_never_merges():
    skipping = Facts(loop=True, skips=True, fused=True)
    assert decide(5, 5, skipping) == Route(Kind.FUSED, (Leg(0, 5, 5, ALONE, Stack.FUSED),))
    batched = Facts(loop=True, chunk=32, skips=True, fused=True)
    assert decide(5, 5, batched) == Route(Kind.QUEUED, (Leg(0, 5, 5, QUEUED, Stack.FUSED),))
    assert decide(70, 1, batched) == Route(Kind.QUEUED, (Leg(0, 70, 1, QUEUED, Stack.MODEL),))


def test_with_a_batcher_short_passes_merge_and_long_ones_go_in_chunks():
    facts = Facts(loop=True, chunk=32, fused=True)
    assert decide(3, 3, facts) == Route(Kind.BATCHED, (Leg(0, 3, 3, BATCHED, Stack.FUSED),))
    assert decide(32, 1, facts).kind is Kind.BATCHED  # a chunk's worth: longer than a short pass alone
    route = decide(70, 5, facts)
    assert route.kind is Kind.CHUNKED
    assert [(leg.start, leg.stop, leg.keep, leg.schedule) for leg in route.legs] == [
        (0, 32, 0, BATCHED), (32, 64, 0, BATCHED), (64, 70, 5, BATCHED)
    ]  # fmt: skip
    across = decide(66, 5, facts)  # the kept block starts in the second chunk
    assert [(leg.start, leg.stop, leg.keep) for leg in across.legs] == [(0, 32, 0), (32, 64, 3), (64, 66, 2)]


def test_a_quantized_views_prompt_reads_its_head_with_the_models_weights_alone_and_in_chunks():
    facts = Facts(loop=True, fused=True, attention_kernel=True, own_weights_from=20)
    assert decide(40, 1, facts) == Route(
        Kind.SPLIT, (Leg(0, 39, 1, ALONE, Stack.MODEL, own_weights=True), Leg(39, 40, 1, ALONE, Stack.FUSED))
    )
    assert decide(19, 1, facts).kind is Kind.MODEL  # a head of 18 tokens: the view's own weights
    chunked = decide(70, 1, Facts(loop=True, chunk=32, fused=True, attention_kernel=True, own_weights_from=20))
    assert chunked.kind is Kind.CHUNKED
    # The model's own layers are never fused (only a view's low-bit copies are), and never merged with other
    # generations' passes (torch's products round a row by how many rows there are): queued, each chunk alone.
    assert [(leg.start, leg.stop, leg.keep, leg.own_weights, leg.stack, leg.schedule) for leg in chunked.legs] == [
        (0, 32, 1, True, Stack.MODEL, QUEUED), (32, 64, 1, True, Stack.MODEL, QUEUED),
        (64, 69, 1, True, Stack.LOOP, QUEUED), (69, 70, 1, False, Stack.FUSED, BATCHED),
    ]  # fmt: skip
    # Since they never merge, their chunks may be longer than the batcher's (`own_chunk`); the view's are not.
    longer = Facts(loop=True, chunk=32, own_chunk=128, fused=True, attention_kernel=True, own_weights_from=20)
    assert [(leg.start, leg.stop, leg.own_weights, leg.stack) for leg in decide(300, 1, longer).legs] == [
        (0, 128, True, Stack.MODEL), (128, 256, True, Stack.MODEL), (256, 299, True, Stack.MODEL),
        (299, 300, False, Stack.FUSED),
    ]  # fmt: skip
    no_split = [(leg.start, leg.stop) for leg in decide(70, 1, Facts(loop=True, chunk=32, own_chunk=128)).legs]
    assert no_split == [(0, 32), (32, 64), (64, 70)]  # no own weights: the batcher's chunks, merged


def test_a_session_takes_its_route_from_its_model_cache_view_and_batcher():
    model = tiny_model("qwen2", dtype=torch.float32)  # no attention kernel in float32: a deterministic route
    session = KVSession(model)
    assert session.route(1, None, 1) == Route(Kind.LOOP, (Leg(0, 1, 1, ALONE, Stack.LOOP),))
    assert session.route(2, View(mask=LayerMask.skipping(4, [1])), 2).kind is Kind.MODEL
    session.forward(list(range(3, 23)))
    session.forward([5])
    session.forward([6, 7, 8])
    assert session.routes == {"model": 1, "loop": 2} and session.forward_passes == 3
    batcher = PassBatcher(model, chunk=8, own_chunk=24).attach()
    try:
        assert session.route(3, None, 3) == Route(Kind.BATCHED, (Leg(0, 3, 3, BATCHED, Stack.LOOP),))
        assert session.route(20, None, 1).kind is Kind.CHUNKED
        assert session._facts(None, batcher).own_chunk == 24  # the batcher's, as the route reads it
    finally:
        batcher.detach()
    gemma = KVSession(tiny_model("gemma"))  # an architecture the loop does not cover
    assert gemma.route(1, None, 1) == Route(Kind.MODEL, (Leg(0, 1, 1, ALONE, Stack.MODEL),))


def test_a_generations_statistics_count_its_passes_by_route():
    model = tiny_model("qwen2", dtype=torch.float32)
    decoder = PlainDecoder(model, tiny_tokenizer(64))
    stats = decoder.generate(list(range(3, 23)), GenerationConfig(max_new_tokens=5, ignore_eos=True)).stats
    # The prompt by the model's forward, then a step per token after the first (which the prompt's pass gives).
    assert stats.routes == {"model": 1, "loop": 4} and stats.to_dict()["routes"] == stats.routes
    again = decoder.generate([3, 4, 5], GenerationConfig(max_new_tokens=2, ignore_eos=True)).stats
    assert again.routes == {"loop": 2}  # per generation, not the session's running total


def test_features_are_recorded_only_where_the_route_says_a_head_follows(monkeypatch):
    """Feature capture is a fact of the route: every leg of a pass a head follows records its kept positions'
    features (a split's and a chunked prompt's too), no leg of any other does. A session no head follows puts no hook
    on the output head in any route (model, loop, batched, chunked); one a head follows records, in the same routes,
    the final hidden states of a fresh forward pass at exactly the positions whose logits its passes computed."""
    for facts in (Facts(loop=True), Facts(loop=True, chunk=32, own_chunk=128, own_weights_from=8, fused=True)):
        for tokens, keep in ((1, 1), (5, 5), (70, 1), (70, 5)):
            assert not any(leg.features for leg in decide(tokens, keep, facts).legs)
            with_head = Facts(**{**facts.__dict__, "features": True})
            assert all(leg.features for leg in decide(tokens, keep, with_head).legs)
    model = tiny_model("qwen2", dtype=torch.float32)
    head = model.get_output_embeddings()
    hooks: list[int] = []  # the hooks on the output head at each of its calls
    forward = head.forward
    monkeypatch.setattr(head, "forward", lambda rows: (hooks.append(len(head._forward_pre_hooks)), forward(rows))[1])
    tokens = [*range(3, 23), 5, 6, 7, 8, *range(30, 50)]

    def run(session: KVSession) -> None:
        session.forward(tokens[:20])  # the model's forward
        session.forward(tokens[20:21])  # the loop
        batcher = PassBatcher(model, chunk=8).attach()
        try:
            session.forward(tokens[21:24], keep=3)  # batched
            session.forward(tokens[24:], keep=2)  # chunked
        finally:
            batcher.detach()
        assert session.routes == {"model": 1, "loop": 1, "batched": 1, "chunked": 1}

    run(KVSession(model))
    assert len(hooks) == 4 and not any(hooks)  # one head call per pass (a chunk keeping no logits makes none)
    hooks.clear()
    followed = KVSession(model)
    followed.features = FeatureStore()  # as a draft head does when it follows a session (drafters/head.py)
    run(followed)
    assert len(hooks) == 4 and all(hooks)
    kept = [19, 20, 21, 22, 23, len(tokens) - 2, len(tokens) - 1]
    assert [p for p in range(followed.features.known) if followed.features.have[p]] == kept
    with torch.inference_mode():
        fresh = model.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]
    for position in kept:
        torch.testing.assert_close(followed.features.row(position), fresh[position], rtol=1e-5, atol=1e-5)


def test_a_pass_with_its_own_attention_mask_is_one_leg_of_the_models_forward():
    """Teacher forcing's passes bring their own mask: only the model's own forward takes one, whole (the loop and the
    fused stack build their own masks; a split or a chunk would cut the mask)."""
    for facts in (LOOPED, Facts(loop=True, chunk=32, own_chunk=128, own_weights_from=8, fused=True)):
        masked = Facts(**{**facts.__dict__, "masked": True})
        for tokens, keep in ((3, 3), (70, 40)):
            (leg,) = decide(tokens, keep, masked).legs
            assert (leg.start, leg.stop, leg.keep, leg.stack, leg.own_weights) == (0, tokens, keep, Stack.MODEL, False)
    assert decide(70, 40, Facts(loop=True, chunk=32, masked=True)).kind is Kind.QUEUED  # in turn, never merged


def test_the_route_imports_none_of_the_stacks_it_chooses_between():
    """Deciding builds nothing: the route's module loads no stack, no view maker and no model code of viasd's."""
    code = "import json, sys, viasd.passes.route; print(json.dumps(sorted(m for m in sys.modules if 'viasd' in m)))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert set(json.loads(run.stdout)) == {
        "viasd",
        "viasd.passes",
        "viasd.passes.route",
        "viasd.kernels",
        "viasd.kernels.packed_attention",
    }
