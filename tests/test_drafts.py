"""Drafts that adapt: the per-round draft length (a drafter confidence stop threshold) and the hybrid drafter
(prompt lookup when it matches, the model drafter otherwise). Both stay exact: greedy output equals plain
decoding's on several architectures, sampling follows the target's law (chi-square against the exact joint)."""

import math

import pytest
import torch

from helpers import Recording
from laws import ALPHA, exact_joint, pooled_pvalue
from tiny import ARCHITECTURES, tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.decode.round import RoundPolicy
from viasd.decode.speculative import SpeculativeDecoder
from viasd.decode.stats import GenerationStats
from viasd.decode.tiered import TieredDecoder
from viasd.drafters.base import stopped_length, stops_after
from viasd.drafters.hybrid import HybridDrafter, uses_model
from viasd.drafters.model_drafter import ModelDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.errors import ViasdError
from viasd.verify.gates import Gate
from viasd.verify.sampling import SamplingParams
from viasd.views.layer_skip import LayerMask

PROMPT = [3, 4, 5, 6, 7, 9, 12, 3, 4, 5]  # its tail "3 4 5" occurred earlier: prompt lookup matches at once
GREEDY = SamplingParams()
GEN = torch.Generator().manual_seed(0)


def hybrid(drafter_model, match=2, copy=None, budget=0.0):
    lookup = PromptLookupDrafter(max_ngram=max(3, match), min_ngram=match, copy=copy)
    return HybridDrafter(lookup, ModelDrafter(drafter_model), budget)


# ----------------------------------------------------------------------------------- the draft length rule


def test_drafting_stops_after_the_first_token_under_the_threshold():
    assert stopped_length([0.9, 0.8, 0.3, 0.9], 0.5) == 3  # the unsure token is included, nothing after it
    assert stopped_length([0.2, 0.9], 0.5) == 1  # a round always drafts at least one token
    assert stopped_length([0.9, 0.8], 0.5) == 2 and stopped_length([], 0.5) == 0
    assert stopped_length([0.0, 0.0], 0.0) == 2  # 0: off, whatever the confidence
    assert stops_after(0.39, 0.4) and not stops_after(0.4, 0.4)


def test_the_model_drafter_stops_where_the_rule_says_and_saves_its_steps():
    drafter = tiny_model("llama", layers=2, seed=1)
    context = [3, 4, 5, 6, 7, 3, 4, 5, 9, 12, 8, 2, 30]
    full = ModelDrafter(drafter).propose(context, 8, GREEDY, GEN)
    tops = full.soft.max(dim=-1).values.tolist()
    for stop in (0.0, 0.2, 0.25, 0.35, 1.0):
        model = ModelDrafter(drafter)
        out = model.propose(context, 8, GREEDY, GEN, stop)
        n = stopped_length(tops, stop)
        assert out.tokens == full.tokens[:n] and torch.equal(out.soft, full.soft[:n]) and out.source == "model"
        assert out.probs is None  # greedy drafts are argmaxes: one-hot, with no probability rows built
        assert out.tops == tops[:n] and out.confidence == min(tops[:n])  # read from the device with the tokens
        assert model.forward_passes == n  # one step per draft token: the stop saves the rest
    assert 1 < stopped_length(tops, 0.25) < 8, tops  # one of the thresholds above cuts the block inside
    # The replay (calibration) decides with the same rule: see tests/test_round.py.


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_with_a_stop_threshold_or_the_hybrid_drafter_equals_plain(arch):
    target, tok = tiny_model(arch), tiny_tokenizer(64)
    small = tiny_model(arch, layers=2, seed=1)
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(PROMPT, config).tokens
    both = {"lookup", "model"}
    variants = {  # name: drafter, stop threshold, the draft sources expected
        "stop": (ModelDrafter(small), 0.3, {"model"}),
        "hybrid": (hybrid(small, match=1), 0.0, both),
        "hybrid-stop": (hybrid(small, match=2, copy=3), 0.3, both),
        "hybrid-short-budget": (hybrid(small, match=2, budget=5.0), 0.3, {"lookup"}),  # 40 < 5 x 10 prompt tokens
        "self-stop": (ModelDrafter(target, LayerMask.skipping(4, [2]), name="self"), 0.5, {"self"}),
    }
    for name, (drafter, stop, sources) in variants.items():
        recording = Recording(drafter)
        out = SpeculativeDecoder(target, tok, recording, gamma=5, stop=stop).generate(PROMPT, config)
        assert out.tokens == plain, name
        assert {source for _, _, source in recording.rounds} == sources, (name, recording.rounds)
        drafted = [(k, n) for k, n, source in recording.rounds if source != "lookup"]
        if stop and drafted:  # the rule must have cut some rounds short and let others draft more than one token
            assert any(n < k for k, n in drafted) and any(n > 1 for k, n in drafted), (name, recording.rounds)
        assert sum(s.drafted for s in out.stats.sources.values()) == out.stats.drafted
        assert (out.stats.drafter_calls == 0) == ("".join(sources) == "lookup")


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_via_with_a_stop_threshold_and_the_hybrid_drafter_stays_exact_where_it_should(arch):
    """Exact mode equals classic SD under the same drafts; a full-model 'slim' view keeps relaxed rounds lossless,
    so with copied drafts (no distributions: the KL gate sends them to the full target) and early stops mixed in,
    greedy output still equals plain decoding's."""
    target, tok = tiny_model(arch), tiny_tokenizer(64)
    small = tiny_model(arch, layers=2, seed=1)
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(PROMPT, config)
    sd = SpeculativeDecoder(target, tok, hybrid(small), gamma=4, stop=0.3).generate(PROMPT, config)
    exact = RoundPolicy(Gate.exact(), gamma=4, stop=0.3)
    via_exact = TieredDecoder(target, tok, hybrid(small), [LayerMask.skipping(4, [2])], exact).generate(PROMPT, config)
    assert via_exact.tokens == sd.tokens == plain.tokens
    assert (via_exact.stats.target_calls, via_exact.stats.drafted) == (sd.stats.target_calls, sd.stats.drafted)
    assert via_exact.stats.sources == sd.stats.sources and set(sd.stats.sources) == {"lookup", "model"}
    lossless = RoundPolicy(Gate("kl", (-1.0, math.inf)), gamma=4, cap=8, stop=0.3)
    via = TieredDecoder(target, tok, hybrid(small), [LayerMask.full(4)], lossless).generate(PROMPT, config)
    assert via.tokens == plain.tokens and via.stats.tiers["slim"].decided > 0
    assert via.stats.target_calls < sd.stats.target_calls


# ------------------------------------------------------------------------------------------ hybrid drafter


def test_the_hybrid_copies_on_a_match_and_asks_the_model_otherwise():
    small = tiny_model("qwen2", layers=2, seed=1)
    drafter = hybrid(small, match=2, copy=3)
    copied = drafter.propose([1, 5, 6, 7, 8, 9, 5, 6], 5, GREEDY, GEN)
    assert (copied.tokens, copied.probs, copied.source) == ([7, 8, 9], None, "lookup")  # 2-gram match, 3 copied
    assert drafter.forward_passes == 0  # copying costs the model drafter nothing
    assert drafter.propose([1, 5, 6, 7], 4, GREEDY, GEN, 0.0).source == "model"  # only 1-gram matches: too short
    assert drafter.propose([5, 6, 5, 6], 1, GREEDY, GEN).tokens == [5]  # never beyond the round's limit k
    with pytest.raises(ValueError):
        PromptLookupDrafter(copy=0)


def test_the_hybrid_leaves_the_model_out_of_generations_too_short_to_pay_for_its_prefill():
    assert uses_model(1000, 256, 0.08) and uses_model(1000, 80, 0.08) and not uses_model(1000, 79, 0.08)
    assert uses_model(1000, None, 0.08) and uses_model(1000, 1, 0.0)
    small = tiny_model("qwen2", layers=2, seed=1)
    drafter = hybrid(small, match=3, budget=0.5)
    prompt = [1, 5, 6, 7, 8, 9, 10, 11, 12, 5]
    drafter.reset(len(prompt), 4)  # 4 < 0.5 x 10: prompt lookup alone, any match copied
    assert drafter.propose(prompt, 4, GREEDY, GEN).tokens == [6, 7, 8, 9]  # a 1-gram match
    assert drafter.propose([*prompt, 13, 14], 4, GREEDY, GEN).tokens == []  # no match at all: no draft
    assert drafter.forward_passes == 0  # the model drafter never read the prompt
    drafter.reset(len(prompt), 5)
    out = drafter.propose(prompt, 4, GREEDY, GEN)  # only a 1-gram match: too short, the model drafts
    assert out.source == "model" and len(out) == 4 and drafter.forward_passes == 4
    drafter.reset()  # not told: decided at the first proposal, with no budget known
    assert drafter.propose(prompt, 4, GREEDY, GEN).source == "model"
    with pytest.raises(ValueError):
        hybrid(small, budget=float("nan"))


def test_the_model_drafters_cache_follows_every_committed_token_whichever_part_proposed():
    """Rounds of copied drafts, with rejections in between, then a model round: the model drafter catches up on
    every committed token in its first step, and drafts exactly what a fresh drafter would from that context."""
    small = tiny_model("llama", layers=2, seed=1)
    drafter = hybrid(small, match=2)
    context = list(PROMPT)
    sources = []
    for step in range(12):
        k = 4
        before = drafter.forward_passes
        out = drafter.propose(context, k, GREEDY, GEN)
        sources.append(out.source)
        if out.source == "model":
            fresh = ModelDrafter(small).propose(context, k, GREEDY, GEN)
            assert out.tokens == fresh.tokens and torch.allclose(out.soft, fresh.soft)
            assert drafter.forward_passes - before == k  # the catch-up rides on the first draft step
            assert drafter.model.session.tokens == context + out.tokens[:-1]
        # Commit part of the draft (the rest is rolled back), then tokens that repeat an earlier 2-gram (the next
        # round copies) or a fresh one (the next round asks the model).
        kept = out.tokens[: step % 3]
        context = context + kept + ([6, 7] if step % 3 == 0 else [40 + step])
    assert "model lookup model" in " ".join(sources), sources


def test_statistics_per_draft_source_add_up():
    target, tok = tiny_model("qwen2"), tiny_tokenizer(64)
    out = SpeculativeDecoder(target, tok, hybrid(tiny_model("qwen2", layers=2, seed=1), match=1), gamma=4).generate(
        PROMPT, GenerationConfig(max_new_tokens=48, ignore_eos=True)
    )
    stats, sources = out.stats, out.stats.sources
    assert set(sources) == {"lookup", "model"}
    for field in ("drafted", "evaluated", "accepted"):
        assert sum(getattr(s, field) for s in sources.values()) == getattr(stats, field)
    assert sum(s.rounds for s in sources.values()) <= stats.rounds  # rounds with an empty draft count for none
    assert stats.to_dict()["sources"]["lookup"]["rounds"] == sources["lookup"].rounds
    empty = GenerationStats(method="x")
    assert empty.sources == {} and empty.to_dict()["sources"] == {}


def test_bad_stop_thresholds_are_refused_in_one_line_where_they_enter():
    """A method's stop= and `viasd project --sd-stop` are checked once, by the one check of the setting; the decoders
    and round policies built from them take them as checked."""
    from viasd.methods import parse_method
    from viasd.speculation import check_stop

    for stop in (-0.1, 1.5, float("nan")):
        for method in (f"sd:stop={stop}", f"via:stop={stop}", f"self:stop={stop}"):
            with pytest.raises(ViasdError, match=r"^method option stop must be a probability in \[0, 1\]"):
                parse_method(method)
        with pytest.raises(ViasdError, match=r"^--sd-stop must be a probability in \[0, 1\]"):
            check_stop(stop, "--sd-stop")


# ------------------------------------------------------------------------------------------------ sampling


def sample_counts(decoder, prompt, params, length, n):
    counts, rounds = {}, []
    for seed in range(n):
        config = GenerationConfig(
            max_new_tokens=length, ignore_eos=True, sampling=SamplingParams(**{**params.__dict__, "seed": seed})
        )
        out = decoder.generate(prompt, config)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
        rounds.append(out.stats)
    return counts, rounds


SAMPLING = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)]


@pytest.mark.parametrize("params", SAMPLING, ids=["t1", "t0.7-topk5-topp0.9"])
def test_sampling_with_the_hybrid_drafter_follows_the_target_distribution(params):
    """Copied drafts (one-hot draft distributions) and model drafts mixed in the same generations."""
    vocab, length, n = 6, 3, 1500
    target = tiny_model("qwen2", vocab_size=vocab, init_scale=0.15)
    small = tiny_model("qwen2", vocab_size=vocab, layers=2, seed=5, init_scale=0.15)
    prompt = [2, 3, 4, 2]  # the tail "2" occurred earlier: the first round copies; fresh tokens call the model
    recording = Recording(hybrid(small, match=1))
    decoder = SpeculativeDecoder(target, tiny_tokenizer(vocab), recording, gamma=2)
    counts, stats = sample_counts(decoder, prompt, params, length, n)
    lookup = [s.sources["lookup"] for s in stats if "lookup" in s.sources]
    model = [s.sources["model"] for s in stats if "model" in s.sources]
    # Both sources drafted often, and both had drafts rejected: the acceptance rule was exercised on each.
    assert len(lookup) > n // 2 and len(model) > n // 10, (len(lookup), len(model))
    assert sum(s.evaluated - s.accepted for s in lookup) > n // 10
    assert sum(s.evaluated - s.accepted for s in model) > n // 20
    assert pooled_pvalue(exact_joint(target, prompt, params, vocab, length), counts, n) > ALPHA


@pytest.mark.parametrize(("params", "stop"), [(SAMPLING[0], 0.5), (SAMPLING[1], 0.6)], ids=["t1", "t0.7-topk5-topp0.9"])
def test_sampling_with_a_stop_threshold_follows_the_target_distribution(params, stop):
    vocab, length, n = 6, 4, 1500
    target = tiny_model("qwen2", vocab_size=vocab, init_scale=0.15)
    small = ModelDrafter(tiny_model("qwen2", vocab_size=vocab, layers=2, seed=5, init_scale=0.15))
    prompt = [2, 2, 3]  # the drafter is sure enough of its first token here, and unsure after some of them
    recording = Recording(small)
    decoder = SpeculativeDecoder(target, tiny_tokenizer(vocab), recording, gamma=3, stop=stop)
    counts, stats = sample_counts(decoder, prompt, params, length, n)
    cuttable = [(k, drafted) for k, drafted, _ in recording.rounds if k > 1]
    cut, full = sum(d < k for k, d in cuttable), sum(d == k for k, d in cuttable)
    assert cut > len(cuttable) // 10 and full > len(cuttable) // 10, (cut, full, len(cuttable))
    assert sum(s.evaluated - s.accepted for s in stats) > n // 10
    assert pooled_pvalue(exact_joint(target, prompt, params, vocab, length), counts, n) > ALPHA


# ----------------------------------------------------------------------------- statistics in bench and server


def test_per_source_counts_flow_into_the_bench_summary_and_report():
    from viasd.bench.metrics import ALL, combine_stats, summarize
    from viasd.bench.report import markdown

    target, tok = tiny_model("qwen2"), tiny_tokenizer(64)
    decoder = SpeculativeDecoder(target, tok, hybrid(tiny_model("qwen2", layers=2, seed=1), match=1), gamma=4)
    turns = [decoder.generate(PROMPT, GenerationConfig(max_new_tokens=n, ignore_eos=True)).stats for n in (20, 30)]
    total = combine_stats(turns, "sd:drafter=hybrid")  # the turns of one task add up, sources included
    for name in ("lookup", "model"):
        for field in ("rounds", "drafted", "evaluated", "accepted"):
            assert getattr(total.sources[name], field) == sum(getattr(t.sources[name], field) for t in turns)
    rows = [
        {"key": key, "method": method, "category": category, "stats": stats, "turns": []}
        for key, category in (("a", "qa"), ("b", "rag"))
        for method, stats in (("sd:drafter=hybrid", total.to_dict()), ("sd", turns[0].to_dict() | {"sources": {}}))
    ]
    summaries = summarize(rows)
    overall = next(s for s in summaries if s.method == "sd:drafter=hybrid" and s.category == ALL)
    assert overall.sources["lookup"]["accepted"] == 2 * total.sources["lookup"].accepted
    assert overall.drafter_calls_per_token == pytest.approx(total.drafter_calls / total.new_tokens)
    text = markdown(summaries, {}, rows)
    assert "## Draft sources" in text and "## Draft sources by category" in text and "drafter passes/token" in text
    lookup_row = next(line for line in text.splitlines() if line.startswith("| sd:drafter=hybrid | lookup |"))
    assert f"{2 * total.sources['lookup'].rounds} (" in lookup_row
    assert "| sd | " not in text.split("## Draft sources")[1].split("##")[0]  # single-source methods are left out


def test_server_metrics_count_rounds_and_accepted_drafts_per_source():
    import re

    from viasd.serve.metrics import Metrics

    target, tok = tiny_model("qwen2"), tiny_tokenizer(64)
    decoder = SpeculativeDecoder(target, tok, hybrid(tiny_model("qwen2", layers=2, seed=1), match=1), gamma=4)
    stats = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=30, ignore_eos=True)).stats
    metrics = Metrics(["sd:drafter=hybrid"])
    metrics.record("sd:drafter=hybrid", stats)
    metrics.record("sd:drafter=hybrid", stats)
    text = metrics.render(waiting=0, running=0, capacity=1)
    for name, field in (("rounds", "rounds"), ("accepted", "accepted")):
        for source in ("lookup", "model"):
            line = f'viasd_draft_source_{name}_total{{method="sd:drafter=hybrid",source="{source}"}}'
            match = re.search(re.escape(line) + r" (\d+)", text)
            assert match and int(match.group(1)) == 2 * getattr(stats.sources[source], field), (line, text)
