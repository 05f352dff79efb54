"""Mask search, objectives, teacher forcing, gate records, replay, selection and routing profiles, on tiny models."""

import dataclasses
import json
import math
import warnings

import optuna
import pytest
import torch
from transformers import DynamicCache
from typer.testing import CliRunner

from tiny import tiny_model, tiny_tokenizer
from viasd.calibration import candidates as candidates_module
from viasd.calibration import continuations as continuations_module
from viasd.calibration import mask_step
from viasd.calibration.costs import Costs
from viasd.calibration.objectives import Scores, kl_target_slim, margin_violation, score, top1_agreement
from viasd.calibration.pipeline import calibrate_pair
from viasd.calibration.records import GateRecords, gate_records
from viasd.calibration.replay import replay
from viasd.calibration.reselection import profile_records, reselect
from viasd.calibration.search import mask_evaluator, mask_from_scores, random_baseline, scores_for, search_mask
from viasd.calibration.selection import NO_ACCEPT, NO_FULL, select_policy
from viasd.calibration.settings import CalibrationSettings
from viasd.calibration.teacher import slim_logits, teacher_force
from viasd.calibration.workfile import WorkFile
from viasd.cli import app
from viasd.decode.base import GenerationConfig
from viasd.decode.round import RoundPolicy
from viasd.drafters.hybrid import HybridDrafter
from viasd.engine import Engine, EngineSpec
from viasd.errors import ViasdError
from viasd.models.loading import LoadedModel
from viasd.passes.cache_argument import cache_argument
from viasd.profile import RoutingProfile, load_profile, model_fingerprint, save_profile
from viasd.verify.gates import Gate
from viasd.views.layer_skip import LayerMask, decoder_layers
from viasd.views.quantize import quantize
from viasd.views.recipe import QuantRecipe
from viasd.views.view import View, applied

optuna.logging.set_verbosity(optuna.logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def logits_from_probs(rows):
    return torch.tensor(rows, dtype=torch.float64).log()


# ------------------------------------------------------------------------------------------ objectives


def test_kl_is_zero_iff_the_distributions_are_equal():
    q = torch.randn(5, 11)
    assert torch.allclose(kl_target_slim(q, q), torch.zeros(5), atol=1e-6)
    assert torch.allclose(kl_target_slim(q + 3.0, q), torch.zeros(5), atol=1e-6)  # logits up to a constant
    s = q.clone()
    s[2, 0] += 2.0
    kl = kl_target_slim(s, q)
    assert kl[2] > 1e-3 and torch.allclose(kl[[0, 1, 3, 4]], torch.zeros(4), atol=1e-6)


def test_margin_cost_is_zero_when_the_slim_top_token_leads_by_the_margin():
    target = logits_from_probs([[0.7, 0.2, 0.1]])
    leads = logits_from_probs([[0.9, 0.05, 0.05]])  # log(0.9/0.05) = 2.9 nats > margin 1
    assert float(margin_violation(leads, target, margin=1.0)[0]) == 0.0
    # Same top token, but a lead of only log(0.5/0.4) = 0.22 nats < min(margin, target gap 1.25).
    thin = logits_from_probs([[0.5, 0.4, 0.1]])
    expected = math.log(0.4 / 0.5) + min(1.0, math.log(0.7 / 0.2))
    assert float(margin_violation(thin, target, margin=1.0)[0]) == pytest.approx(expected, rel=1e-5)
    # Wrong top token: violations add up over every rival that beats the target's top token.
    wrong = logits_from_probs([[0.2, 0.7, 0.1]])
    assert float(margin_violation(wrong, target, margin=1.0)[0]) > float(margin_violation(thin, target, margin=1.0)[0])
    # A near-tie in the target does not demand a confident slim view: equal probabilities for the tied pair
    # cost nothing there, and only the clearly worse third token needs the margin.
    tie = logits_from_probs([[0.45, 0.45, 0.1]])
    assert float(margin_violation(tie, tie, margin=1.0)[0]) == pytest.approx(0.0, abs=1e-6)


def test_margin_cost_of_a_broken_position_is_bounded_by_the_rivals():
    vocab = 1000
    target = torch.full((1, vocab), -10.0)
    target[0, 0] = 10.0
    flat = torch.zeros(1, vocab)
    flat[0, 0] = -30.0  # the slim view ranks the target's token below 999 others
    cost = float(margin_violation(flat, target, margin=1.0, rivals=16)[0])
    assert cost == pytest.approx(16 * 31.0, rel=1e-4)  # 16 rivals, each 30 nats ahead plus the 1-nat margin


def test_agreement_counts_matching_top_tokens_and_scores_pool():
    target = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 0.0, 1.0]])
    slim = torch.tensor([[2.0, 1.0, 0.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    assert top1_agreement(slim, target).tolist() == [1.0, 0.0, 1.0]
    a, b = score(slim[:2], target[:2]), score(slim[2:], target[2:])
    pooled = a + b
    assert pooled.count == 3 and pooled.mean("agreement") == pytest.approx(2 / 3)
    assert pooled.value("agreement") == pytest.approx(1 / 3) and pooled.value("kl") == pooled.mean("kl")
    with pytest.raises(ViasdError, match="objective"):
        pooled.value("entropy")


# --------------------------------------------------------------------------------------- teacher forcing


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_slim_view_with_every_layer_reproduces_the_full_pass(arch):
    model = tiny_model(arch, layers=4)
    seq = teacher_force(model, list(range(3, 30)), 8)
    for chunk in (1, 5, 100):
        assert torch.allclose(slim_logits(model, None, seq, chunk), seq.full_logits, atol=1e-5)
    mask = LayerMask.skipping(4, [2])
    batched = slim_logits(model, mask, seq, 4, batched=True)
    assert torch.allclose(batched, slim_logits(model, mask, seq, 4, batched=False), atol=1e-5)
    assert not torch.allclose(batched, seq.full_logits, atol=1e-3)
    assert seq.cache.get_seq_length() == len(seq.ids)  # the full cache is left as it was


def test_teacher_forcing_reads_every_position_with_the_view_and_keeps_a_fresh_passs_cache():
    """The teacher asks the route, with every position the view's: where a session would read a long prompt's head
    by the model's own weights (an int4 view on a CPU, `own_weights_from`), the teacher's logits and cache are still
    one fresh forward pass of the view's over the whole sequence."""
    model = tiny_model("qwen2", layers=4)
    view = View(linears=quantize(model, QuantRecipe.parse("int4")))
    ids = [3 + (i * 7) % 60 for i in range(48)]
    assert view.linears.recipe.own_weights_from("cpu") <= 40  # a session's pass over these would split
    seq = teacher_force(model, ids, 40, view)
    fresh = DynamicCache(config=model.config)
    with torch.inference_mode(), applied(model, view):
        want = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=8, **cache_argument(model, fresh))
    assert torch.equal(seq.full_logits, want.logits[0].float())
    for got, expected in zip(seq.cache.layers, fresh.layers, strict=True):
        assert torch.equal(got.keys, expected.keys) and torch.equal(got.values, expected.values)


# ------------------------------------------------------------------------------------------ mask search


def planted_model(layers=12, identity=(3, 7, 8)):
    """A model whose `identity` layers add nothing to the residual stream: skipping them costs nothing."""
    model = tiny_model("qwen2", layers=layers, hidden=32)
    with torch.no_grad():
        for i in identity:
            layer = decoder_layers(model)[i]
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def planted_evaluator():
    model = planted_model()
    seqs = [teacher_force(model, list(range(3 + i, 30 + i)), 8) for i in range(2)]
    return mask_evaluator(model, seqs, chunk=4)


def test_mask_from_scores_has_the_exact_skip_count_and_keeps_the_ends():
    mask = mask_from_scores(10, 3, [0.5, 0.1, 0.9, 0.2, 0.3, 0.8, 0.05, 0.7])
    assert mask.skipped_layers == [2, 4, 7]
    assert mask_from_scores(10, 3, scores_for(10, [1, 5, 8])).skipped_layers == [1, 5, 8]
    # A seed built for 2 layers, asked for 3, adds the kept layer with the lowest preference.
    pref = [0.9, 0.8, 0.7, 0.1, 0.6, 0.5, 0.4, 0.3]
    assert mask_from_scores(10, 3, scores_for(10, [1, 2], pref)).skipped_layers == [1, 2, 4]
    with pytest.raises(ViasdError):
        scores_for(10, [0, 3])


@pytest.mark.parametrize("objective", ["margin", "kl", "agreement"])
def test_search_finds_the_planted_identity_layers(objective):
    evaluate = planted_evaluator()
    result = search_mask(evaluate, 12, 3, objective=objective, iterations=30, seed=1)
    assert result.mask.skipped_layers == [3, 7, 8]
    assert result.value == pytest.approx(0.0, abs=1e-6)
    assert result.trials == 30 and len(result.history) == 30
    for record in result.history:
        assert len(record["skip"]) == 3 and 0 not in record["skip"] and 11 not in record["skip"]
    assert {r["sampler"] for r in result.history} == {"random", "bo-tpe"}
    # The searched mask beats random masks of the same ratio.
    baseline = random_baseline(evaluate, 12, 3, 4, seed=5)
    assert all(s.value(objective) > result.value for m, s in baseline if m.skipped_layers != [3, 7, 8])


def test_search_resumes_from_its_log(tmp_path):
    calls = []

    def evaluate(mask):
        calls.append(mask)
        return Scores(margin=float(sum(mask.skipped_layers)), kl=0.0, agreement=0.0, count=1)

    db = tmp_path / "search.db"
    first = search_mask(evaluate, 10, 2, iterations=6, storage=db, study_name="s", seed=3)
    n_first = len(calls)
    resumed = search_mask(evaluate, 10, 2, iterations=10, storage=db, study_name="s", seed=3, resume=True)
    assert resumed.trials == 10 and resumed.history[:6] == first.history
    assert len(calls) - n_first <= 4  # only the new trials are evaluated (duplicates are not)
    fresh = search_mask(evaluate, 10, 2, iterations=3, storage=db, study_name="s", seed=3)
    assert fresh.trials == 3  # without --resume the study starts over
    # A seeded search starts with the queued seed.
    seeded = search_mask(evaluate, 10, 2, iterations=2, seeds=[scores_for(10, [1, 2])], seed=3)
    assert seeded.history[0]["sampler"] == "seed" and seeded.history[0]["skip"] == [1, 2]
    assert seeded.mask.skipped_layers == [1, 2]


def test_a_corrupt_search_log_is_a_one_line_error(tmp_path):
    db = tmp_path / "search.db"
    db.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ViasdError, match="search log"):
        search_mask(lambda m: Scores(0.0, 0.0, 0.0, 1), 10, 2, iterations=1, storage=db, resume=True)


# ------------------------------------------------------------------------------------------- calibration

LENGTHS = (1, 2, 4, 8, 16, 64)


def costs(draft=0.1, slim=0.15, full=0.2, per_token=0.001):
    return Costs(
        LENGTHS,
        tuple(draft for _ in LENGTHS),
        tuple(full + per_token * n for n in LENGTHS),
        (tuple(slim + per_token * n for n in LENGTHS),),
    )


def gate(signal="kl", k_accept=NO_ACCEPT, k_full=NO_FULL, gamma=4, cap=32, pregate=0.0):
    return RoundPolicy(Gate(signal, (k_accept, k_full)), gamma, cap, pregate)


def exact(gamma):
    return RoundPolicy(Gate.exact(), gamma)


def test_costs_interpolate_between_measured_lengths():
    c = Costs((1, 3, 9), (0.1, 0.1, 0.1), (1.0, 3.0, 3.0), ((1.0, 2.0, 5.0),))
    assert c.step == 0.1 and c.slim_pass(2) == pytest.approx(1.5) and c.slim_pass(6) == pytest.approx(3.5)
    assert c.full_pass(12) == pytest.approx(3.0) and c.slim_pass(11) == pytest.approx(6.0)


def stats_of(draft_ok, slim_ok=None, kl=None, draft_top=None):
    n = len(draft_ok)
    slim_ok = slim_ok if slim_ok is not None else [True] * n
    kl = kl if kl is not None else [0.01 if ok else 3.0 for ok in draft_ok]
    agrees = [d == s for d, s in zip(draft_ok, slim_ok, strict=True)]
    tops = draft_top if draft_top is not None else [1.0] * n
    return GateRecords(kl, [0.0 if a else 0.9 for a in agrees], list(draft_ok), tops, [list(slim_ok)], [agrees])


def test_replay_of_classic_sd_counts_rounds_and_calls():
    stats = [stats_of([True, True, False, True, True, True, True, True, True, True])]
    pred = replay(stats, exact(3), costs(per_token=0.0))
    # Rounds at 0 (accept 2, correct at 2 -> 3 tokens), 3 (3 accepted + bonus -> 4), 7 (2 drafts left: k=2, +1 bonus)
    assert pred.tokens == 3 + 4 + 3 and pred.stats.target_calls == 3 and pred.errors == 0
    assert pred.stats.evaluated == 3 + 3 + 2 and pred.stats.accepted == 2 + 3 + 2
    assert pred.seconds == pytest.approx(8 * 0.1 + 3 * 0.2)
    # A sequence that ends one position after a round: the last token takes a round with no drafts, as decoding does.
    short = replay([stats_of([True, True, False, True])], exact(2), costs(per_token=0.0))
    assert (short.tokens, short.stats.rounds, short.stats.target_calls, short.stats.drafted) == (4, 2, 2, 2)


def test_replay_of_the_accept_tier_skips_the_full_target_and_counts_errors():
    stats = [stats_of([True] * 6 + [False] + [True] * 5, kl=[0.01] * 12)]  # the wrong draft looks confident
    pred = replay(stats, gate("kl", 0.05, 1.0, gamma=3, cap=100), costs())
    # No draft after the first round (which goes to the full target) reaches it; its only other pass is, at most, a
    # last round that had no position left to draft.
    assert pred.stats.target_calls <= 2 and pred.errors == 1 and pred.decided == {"accept": 6, "slim": 0, "full": 3}
    guarded = replay(stats, gate("kl", NO_ACCEPT, 1.0, gamma=3, cap=100), costs())  # the slim tier catches it
    assert (
        guarded.errors == 0
        and guarded.stats.target_calls <= 2
        and guarded.decided == {"accept": 0, "slim": 6, "full": 3}
    )
    capped = replay(stats, gate("kl", 0.05, 1.0, gamma=3, cap=4), costs())
    assert capped.decided["full"] > pred.decided["full"] and capped.stats.target_calls > pred.stats.target_calls


def test_selection_respects_the_quality_budget_and_picks_the_faster_option():
    # The drafter errs at every 5th position: at half of them the gate signal is high (the slim view is unsure), at
    # the other half its wrong drafts look sure (only a slim check, not the accept tier, catches them).
    draft_ok = [i % 5 != 4 for i in range(60)]
    kl = [0.01 if ok or i % 10 == 9 else 2.0 for i, ok in enumerate(draft_ok)]
    stats = [stats_of(draft_ok, [True] * 60, kl), stats_of(draft_ok, [True] * 60, kl)]
    cheap_slim = costs(slim=0.05, full=0.4)
    strict = select_policy(stats, cheap_slim, gammas=(2, 4), caps=(8, 32), quality_budget=0.0)
    assert strict.prediction.error_rate == 0.0
    loose = select_policy(stats, cheap_slim, gammas=(2, 4), caps=(8, 32), quality_budget=0.5)
    assert loose.prediction.tokens_per_second >= strict.prediction.tokens_per_second
    assert loose.prediction.error_rate <= 0.5
    assert strict.prediction.tokens_per_second > strict.sd_prediction.tokens_per_second  # slim is cheap here
    # When the slim pass costs as much as the full pass, the full tier takes every block: no lower-tier
    # commits, since each would cost a slim pass for nothing.
    dear_slim = select_policy(stats, costs(slim=0.4, full=0.4), gammas=(2, 4), caps=(8,), quality_budget=0.0)
    assert dear_slim.prediction.tokens_per_second <= dear_slim.sd_prediction.tokens_per_second
    for sel in (strict, loose, dear_slim):  # the chosen policy is the fastest feasible one among the candidates
        policy = sel.policy
        again = replay(stats, policy, cheap_slim if sel is not dear_slim else costs(slim=0.4, full=0.4))
        assert again.tokens_per_second == pytest.approx(sel.prediction.tokens_per_second)


def test_a_minimum_tier_share_keeps_every_tier_in_use():
    draft_ok = [i % 5 != 4 for i in range(80)]
    kl = [0.01 if i % 3 else 0.5 for i in range(80)]  # three signal levels: accept, slim and full all plausible
    kl = [2.0 if not ok else v for ok, v in zip(draft_ok, kl, strict=True)]
    stats = [stats_of(draft_ok, None, kl)]
    c = costs(slim=0.05, full=0.4)
    sel = select_policy(stats, c, gammas=(3,), caps=(16,), quality_budget=0.05, min_tier_share=0.1)
    decided = sel.prediction.decided
    assert min(decided.values()) >= 0.1 * sum(decided.values())
    _, free_pred = sel.unconstrained
    assert free_pred.tokens_per_second >= sel.prediction.tokens_per_second
    assert "via_unconstrained" in sel.to_dict()
    with pytest.raises(ViasdError, match="tier share"):
        select_policy(stats, c, min_tier_share=0.5)


def test_the_pregate_sends_doubtful_rounds_straight_to_the_full_target():
    draft_ok = [i % 7 != 6 for i in range(60)]
    # Where the drafter errs, the slim view errs with it, and the drafter doubts exactly there.
    stats = [stats_of(draft_ok, draft_ok, draft_top=[0.9 if ok else 0.2 for ok in draft_ok])]
    c = costs(slim=0.3, full=0.4)
    sd = replay(stats, exact(4), c)
    always = replay(stats, gate("kl", 0.05, 1.0, gamma=4, cap=32, pregate=1.0), c)
    # Every round goes to the full target: classic SD's rounds, the first included.
    assert (always.tokens, always.stats.target_calls, always.stats.slim_calls) == (sd.tokens, sd.stats.target_calls, 0)
    assert always.seconds == pytest.approx(sd.seconds)
    plain_gate = replay(stats, gate("kl", 0.05, 1.0, gamma=4, cap=32), c)
    gated = replay(stats, gate("kl", 0.05, 1.0, gamma=4, cap=32, pregate=0.5), c)
    assert 0 < gated.stats.slim_calls < plain_gate.stats.slim_calls and gated.seconds < plain_gate.seconds
    assert gated.errors == plain_gate.errors == 0
    # The selection finds the pre-gate worth it here, and never uses it on records without the drafter's confidence.
    sel = select_policy(stats, c, gammas=(4,), caps=(32,), quality_budget=0.0, pregates=(0.0, 0.5))
    off = select_policy(stats, c, gammas=(4,), caps=(32,), quality_budget=0.0)
    assert sel.policy.pregate == 0.5 and sel.prediction.tokens_per_second > off.prediction.tokens_per_second
    stats[0].draft_top = []  # records without the drafter's confidence
    assert select_policy(stats, c, gammas=(4,), caps=(32,), pregates=(0.0, 0.5)).policy.pregate == 0.0
    with pytest.raises(ViasdError, match="pre-gates"):
        select_policy(stats, c, pregates=(1.5,))


def test_the_replay_stops_drafting_where_the_recorded_drafter_is_unsure():
    # The drafter errs at every 6th position and is unsure there (and only there).
    draft_ok = [i % 6 != 5 for i in range(48)]
    stats = [stats_of(draft_ok, draft_top=[0.9 if ok else 0.2 for ok in draft_ok])]
    c = costs(draft=0.1, full=0.2, per_token=0.0)
    fixed = replay(stats, exact(8), c)
    stopping = replay(stats, RoundPolicy(Gate.exact(), 8, stop=0.5), c)
    # The same tokens commit in the same rounds, but no draft is made behind the unsure (wrong) one.
    assert (stopping.tokens, stopping.stats.rounds, stopping.stats.accepted) == (
        fixed.tokens, fixed.stats.rounds, fixed.stats.accepted
    )  # fmt: skip
    assert stopping.stats.drafted == stopping.stats.evaluated < fixed.stats.drafted
    assert stopping.seconds == pytest.approx(fixed.seconds - 0.1 * (fixed.stats.drafted - stopping.stats.drafted))
    # Under a threshold above every confidence, each round drafts one token.
    one = replay(stats, RoundPolicy(Gate.exact(), 8, stop=1.0), c).stats
    assert one.drafted == one.rounds == one.new_tokens // 2
    # The selection finds the threshold worth it, for classic SD and VIA-SD alike, and never uses it on records
    # without the drafter's confidence.
    sel = select_policy(stats, c, gammas=(8,), caps=(32,), quality_budget=0.0, pregates=(0.0,), stops=(0.0, 0.5))
    assert sel.sd_policy.stop == 0.5 and sel.sd_prediction.seconds == pytest.approx(stopping.seconds)
    assert sel.policy.stop == 0.5 and sel.to_dict()["via"]["policy"]["stop"] == 0.5
    stats[0].draft_top = []
    blind = select_policy(stats, c, gammas=(8,), caps=(32,), stops=(0.0, 0.5))
    assert blind.policy.stop == blind.sd_policy.stop == 0.0
    with pytest.raises(ViasdError, match="draft stop thresholds must be in"):
        select_policy(stats, c, stops=(0.0, 1.2))


def test_an_older_profile_without_a_stop_threshold_loads_with_it_off(tmp_path):
    path = tmp_path / "old.json"
    data = json.loads(_profile_json())
    data.pop("stop")
    path.write_text(json.dumps(data))
    old = load_profile(path)
    assert old.stop == 0.0 and old.policy().stop == 0.0 and old.policy(stop=0.4).stop == 0.4
    path.write_text(_profile_json(stop=0.35))
    assert load_profile(path).policy().stop == 0.35 and load_profile(path).policy(stop=None).stop == 0.35


def test_gate_records_from_logits():
    draft = torch.tensor([[5.0, 0.0, 0.0], [0.0, 5.0, 0.0]])
    slim = torch.tensor([[4.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    deep = torch.tensor([[0.0, 4.0, 0.0], [0.0, 5.0, 0.0]])
    full = torch.tensor([[3.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    s = gate_records(draft, [slim, deep], full)
    assert s.draft_ok == [True, False] and s.slim_ok == [[True, True], [False, False]]
    assert s.slim_agrees == [[True, False], [False, True]]
    assert s.confidence[0] == 0.0 and s.confidence[1] > 0.9 and s.kl[0] < s.kl[1]
    assert s.draft_top == pytest.approx(torch.tensor([5.0, 0.0, 0.0]).softmax(-1).max().item() * torch.ones(2))


# ------------------------------------------------------------------------------------------------ profiles


def loaded(model, name):
    return LoadedModel(model=model, tokenizer=tiny_tokenizer(64), name=name, path=name)


def test_calibration_end_to_end_writes_a_profile_that_round_trips(tmp_path, monkeypatch):
    target, drafter = (
        loaded(tiny_model("qwen2", layers=6), "tiny-target"),
        loaded(tiny_model("qwen2", layers=2, seed=1), "tiny-drafter"),
    )
    settings = CalibrationSettings(
        skip_ratios=(0.2, 0.34), iterations=4, gammas=(2, 3), caps=(8,), prompts=2, search_prompts=1, held_out=1,
        new_tokens=12, cost_repeats=1, random_masks=2,
    )  # fmt: skip
    work = tmp_path / "p.json.work"
    profile = calibrate_pair(target, drafter, settings, storage=tmp_path / "p.json.search.db", work_file=work)
    assert len(profile.masks) == 1 and 0 < len(profile.masks[0].skipped_layers) <= 2
    assert profile.gamma in (2, 3) and profile.cap == 8 and profile.gate.signal in ("kl", "confidence")
    assert profile.search["random_baseline"]["values"] and profile.search["held_out"]["random"]["values"]
    assert profile.calibration["predicted"]["via"]["error_rate"] <= 0.02
    path = tmp_path / "p.json"
    save_profile(profile, path)
    assert json.loads(path.read_text())["format"] == "viasd-routing-profile/1"
    again = load_profile(path)
    assert again.to_dict() == profile.to_dict()
    again.check_models(target.model, drafter.model)
    records = profile_records(profile, target, drafter, WorkFile(work))
    assert sum(len(r) for r in records) == profile.calibration["positions"]
    # A resumed calibration reuses the continuations, the layer scores, the records and the finished searches.
    fail = lambda *a, **k: pytest.fail("computed again")  # noqa: E731
    with monkeypatch.context() as patch:
        for module, name in (
            (continuations_module, "SpeculativeDecoder"),
            (mask_step, "layer_preference"),
            (candidates_module, "model_logits"),
        ):
            patch.setattr(module, name, fail)
        resumed = calibrate_pair(
            target, drafter, settings, storage=tmp_path / "p.json.search.db", work_file=work, resume=True
        )
    assert resumed.search["trials"] == profile.search["trials"]  # (costs are measured again, so the gate may differ)
    # Re-selection from the profile alone (no work file: records regenerated) reproduces the profile's policy,
    # and under other settings picks within them.
    same = reselect(profile, "sha", target, drafter, settings)
    assert (same.gate, same.gamma, same.cap, same.pregate, same.stop) == (
        profile.gate,
        profile.gamma,
        profile.cap,
        profile.pregate,
        profile.stop,
    )
    assert same.masks == profile.masks and same.calibration["reselected"]["from_sha256"] == "sha"
    other = reselect(
        profile, "sha", target, drafter, dataclasses.replace(settings, gammas=(4,), pregates=(0.0,), stops=(0.45,))
    )
    assert other.gamma == 4 and other.pregate == 0.0 and other.calibration["costs"] == profile.calibration["costs"]
    assert other.stop == 0.45 and other.calibration["stops"] == [0.45]
    # The engine takes it for --method via.
    engine = Engine(EngineSpec(target="tiny-target", profile=str(path)), target=target, drafter=drafter)
    assert engine.decoder("via").policy.gamma == profile.gamma
    assert engine.decoder("via").policy.pregate == profile.pregate in settings.pregates
    assert engine.decoder("via:pregate=0.7").policy.pregate == 0.7  # a variant overrides the profile
    assert engine.decoder("via").policy.stop == profile.stop in settings.stops
    assert engine.decoder("via:stop=0").policy.stop == 0.0 and engine.decoder("via-exact:stop=0.6").policy.stop == 0.6
    hybrid = engine.decoder("via:drafter=hybrid:match=3")
    assert isinstance(hybrid.drafter, HybridDrafter) and hybrid.drafter.lookup.min_ngram == 3
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    exact = engine.generate([1, 5, 9, 13, 1, 5], "via-exact:drafter=hybrid:budget=0", config)
    assert exact.tokens == engine.generate([1, 5, 9, 13, 1, 5], "plain", config).tokens and exact.stats.sources
    copied = engine.generate([1, 5, 9, 13, 1, 5], "via:drafter=lookup", config)  # no distributions: gates still work
    assert len(copied.tokens) == 16 and set(copied.stats.sources) <= {"lookup"}


def test_a_profile_for_other_models_is_refused(tmp_path):
    target, other = tiny_model("llama", layers=4), tiny_model("llama", layers=4, seed=7)
    profile = RoutingProfile(
        target={"name": "tiny", "fingerprint": model_fingerprint(target)},
        drafter=None,
        masks=[LayerMask.skipping(4, [2])],
        gate=Gate("kl", (0.1, 1.0)),
    )
    profile.check_models(target)
    with pytest.raises(ViasdError, match="calibrate"):
        profile.check_models(other)
    path = tmp_path / "p.json"
    save_profile(profile, path)
    drafter = loaded(tiny_model("llama", layers=2, seed=1), "d")
    engine = Engine(EngineSpec(target="other", profile=str(path)), target=loaded(other, "other"), drafter=drafter)
    with pytest.raises(ViasdError, match="routing profile was made for target"):
        engine.decoder("via")


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"format": "viasd-routing-profile/1", "masks": 3}', ""])
def test_a_corrupt_profile_file_is_a_one_line_error(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ViasdError):
        load_profile(path)


def test_calibrate_command_reports_bad_options_in_one_line():
    result = CliRunner().invoke(app, ["calibrate", "--objective", "entropy"])
    assert result.exit_code == 2 and "unknown objective" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(app, ["calibrate", "--gammas", "2,x"])
    assert result.exit_code == 2 and "--gammas" in result.output
    for stops, message in (("0,2", "--stops must be in [0, 1]"), ("0,x", "--stops: expected comma-separated")):
        result = CliRunner().invoke(app, ["calibrate", "--stops", stops])
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(app, ["calibrate", "--kind-slim-quant", "int8"])
    assert result.exit_code == 2 and "--kind-slim-quant needs --kind" in result.output
    assert NO_FULL > 1e6


def _profile_json(**changes):
    data = RoutingProfile(
        target={"name": "t", "fingerprint": "x"}, drafter=None, masks=[LayerMask.skipping(4, [2])], gate=Gate()
    ).to_dict()
    for key, value in changes.items():
        if key == "masks":
            data["masks"] = value
        elif key == "thresholds":
            data["gate"]["thresholds"] = value
        else:
            data[key] = value
    return json.dumps(data, allow_nan=True)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"masks": [{"num_layers": 4, "skip_layers": [-1]}]}, "not a layer index in 0..3"),
        ({"masks": [{"num_layers": 4, "skip_mlp": [7]}]}, "not a layer index in 0..3"),
        ({"masks": [{"num_layers": 4, "skip_layers": [True]}]}, "not a layer index"),
        ({"thresholds": [float("nan"), 1.0]}, "gate thresholds must be numbers"),
        ({"thresholds": [0.1, 0.2, 0.3]}, "need 2 gate thresholds"),
        ({"gamma": 1000}, "gamma must be in 1..64"),
        ({"gamma": 2.5}, "gamma must be an integer"),
        ({"cap": 0}, "cap on tokens committed without the full target must be in 1..1048576"),
        ({"pregate": 2.0}, "pre-gate must be a probability"),
        ({"stop": -0.5}, "draft stop threshold must be a probability"),
        ({"stop": float("nan")}, "draft stop threshold must be a probability"),
    ],
)
def test_a_profile_with_impossible_settings_is_refused_in_one_line(tmp_path, changes, message):
    path = tmp_path / "bad.json"
    path.write_text(_profile_json(**changes))
    with pytest.raises(ViasdError) as info:
        load_profile(path)
    assert message in str(info.value) and "\n" not in str(info.value)


def pair_on_disk(tmp_path) -> tuple[dict[str, object], list[str]]:
    """A tiny target (6 layers) and drafter saved in folders, and the command-line options that name them."""
    tok = tiny_tokenizer(64)
    dirs = {}
    # Llama: transformers reloads the tiny word-level tokenizer as it is (for qwen2 it substitutes its own class).
    for name, model in (("target", tiny_model("llama", layers=6)), ("drafter", tiny_model("llama", layers=2, seed=1))):
        dirs[name] = tmp_path / name
        model.save_pretrained(dirs[name])
        tok.save_pretrained(dirs[name])
    common = ["--target", str(dirs["target"]), "--drafter", str(dirs["drafter"]), "--dtype", "fp32", "--device", "cpu"]
    return dirs, common


def test_calibrate_and_reselect_from_the_command_line(tmp_path):
    """`viasd calibrate` on models in directories, then `--reselect` of its profile: the documented way to re-derive
    a profile's round policy reproduces it, and other selection options change only what they govern."""
    _, common = pair_on_disk(tmp_path)
    first = tmp_path / "p.json"
    runner = CliRunner()
    made = runner.invoke(app, ["calibrate", *common, "--output", str(first), "--skip-ratio", "0.34", "--iterations",
                               "3", "--prompts", "2", "--search-prompts", "1", "--new-tokens", "12", "--gammas", "2,3",
                               "--caps", "8,16", "--no-progress"])  # fmt: skip
    assert made.exit_code == 0, made.output
    profile = load_profile(first)
    again = tmp_path / "q.json"
    result = runner.invoke(app, ["calibrate", *common, "--reselect", str(first), "--output", str(again)])
    assert result.exit_code == 0, result.output
    same = load_profile(again)
    policy = (profile.gate, profile.gamma, profile.cap, profile.pregate, profile.stop)
    assert (same.gate, same.gamma, same.cap, same.pregate, same.stop) == policy
    assert same.masks == profile.masks and same.calibration["costs"] == profile.calibration["costs"]
    reselect_args = ["calibrate", *common, "--reselect", str(first)]
    result = runner.invoke(app, [*reselect_args, "--output", str(again), "--gammas", "3", "--stops", "0.55"])
    assert result.exit_code == 0 and load_profile(again).gamma == 3 and load_profile(again).cap in (8, 16)
    assert load_profile(again).stop == 0.55
    what_if = runner.invoke(app, [*reselect_args, "--what-if"])
    assert what_if.exit_code == 0 and "| as configured" in what_if.output
    assert "| slim verifier always right" in what_if.output and "| slim pass at its 1-token cost" in what_if.output
    refused = runner.invoke(app, ["calibrate", *common, "--what-if"])
    assert refused.exit_code == 2 and "--what-if needs --reselect" in refused.output


def test_calibration_chooses_among_quantized_slim_views_and_drafters(tmp_path):
    """Slim views beyond layer masks (the target's int8 view, alone and on a searched mask) and drafters beyond the
    small model (its int4 view, the target's own int8 view) compete in one calibration; the profile it writes
    builds the chosen views, and re-selection reproduces it."""
    target = loaded(tiny_model("qwen2", layers=6, dtype=torch.float32), "tiny-target")
    drafter = loaded(tiny_model("qwen2", layers=2, seed=1, dtype=torch.float32), "tiny-drafter")
    settings = CalibrationSettings(
        skip_ratios=(0.34,), slim_quants=(QuantRecipe.parse("int8"),), drafters=("model", "model:int4", "self:int8"),
        iterations=3,
        gammas=(2, 3), caps=(8,), prompts=2, search_prompts=1, held_out=0, new_tokens=12, cost_repeats=1,
        random_masks=1, pregates=(0.0,),
    )  # fmt: skip
    profile = calibrate_pair(target, drafter, settings, work_file=tmp_path / "p.work")
    candidates = profile.search["candidates"]
    assert {(c["drafter"], c["slim"].get("quant")) for c in candidates} == {
        (d, q) for d in settings.drafters for q in (None, "int8")
    } and len(candidates) == 3 * 3  # the mask, int8 alone, int8 on the mask; three drafters
    best = max(candidates, key=lambda c: c["predicted_via_tokens_per_second"])
    assert profile.calibration["predicted"]["via"]["tokens_per_second"] == best["predicted_via_tokens_per_second"]
    assert [q.name for q in profile.quant] == ([best["slim"]["quant"]] if best["slim"].get("quant") else [])
    assert profile.self_drafter == best["drafter"].startswith("self")
    path = tmp_path / "p.json"
    save_profile(profile, path)
    engine = Engine(EngineSpec(target="tiny-target", profile=str(path)), target=target, drafter=drafter)
    decoder = engine.decoder("via")
    assert (decoder.slims[0].linears is not None) == bool(profile.quant)
    assert (decoder.drafter.session.model is target.model) == profile.self_drafter
    again = reselect(load_profile(path), "sha", target, drafter, settings, work_file=tmp_path / "p.work")
    assert (again.gate, again.gamma, again.cap) == (profile.gate, profile.gamma, profile.cap)


def test_via_uses_the_shipped_int4a8_profile_only_where_its_kernel_runs():
    """Two profiles ship for the default pair: int8 slim verifier and int4 drafter for any x86 CPU, and int4a8 views
    (a few times slower without their compiled kernel) where that kernel runs. Both are for the same models."""
    from viasd.calibration.project_command import profile_views
    from viasd.profile import DEFAULT_PROFILE, GGUF_PROFILE, INT4A8_PROFILE, default_profile_path

    anywhere, fast = default_profile_path(False), default_profile_path(True)
    assert anywhere is not None and anywhere.name == DEFAULT_PROFILE
    assert fast is not None and fast.name == INT4A8_PROFILE
    general, kernel = load_profile(anywhere), load_profile(fast)
    assert general.target == kernel.target and general.drafter["fingerprint"] == kernel.drafter["fingerprint"]
    assert profile_views(general) == ("int8", "int4") and "int4a8" in profile_views(kernel)[0]
    # Where the target runs as its file's blocks, `via` verifies on them with the profile calibrated there.
    on_blocks = default_profile_path(True, stored=True)
    assert on_blocks is not None and on_blocks.name == GGUF_PROFILE
    blocks = load_profile(on_blocks)
    assert blocks.target["fingerprint"] == general.target["fingerprint"] and blocks.target_quant is not None
    # It drafts with the target's shipped draft head; the profile it was re-selected from (the 0.5B drafter) ships too.
    from viasd.heads.file import load_head
    from viasd.heads.find import SHIPPED
    from viasd.profile import shipped_profile_path

    (shipped_head,) = SHIPPED.glob("*.safetensors")
    assert blocks.target_quant.gguf and blocks.head_drafter == load_head(shipped_head).digest
    modelled = shipped_profile_path("qwen2.5-coder-0.5b__qwen2.5-coder-1.5b.gguf.json")
    assert modelled is not None and load_profile(modelled).drafter["fingerprint"] == general.drafter["fingerprint"]
    assert load_profile(modelled).masks == blocks.masks


def test_a_kinds_own_policy_on_a_slim_view_of_its_own(tmp_path):
    """`calibrate --reselect P --kind code --kind-slim-quant R`: the code policy is selected from records made with
    the target's R view, on costs measured now for that view; the profile's own view and policy stay, and `via`
    verifies code requests on the kind's view."""
    from viasd.calibration.reselection import reselect_kind

    target, drafter = (
        loaded(tiny_model("qwen2", layers=4), "tiny-target"),
        loaded(tiny_model("qwen2", layers=2, seed=1), "tiny-drafter"),
    )
    lengths = [1, 2, 3, 4, 5]
    costs = {"lengths": lengths, "seconds": {"drafter": [0.01] * 5, "full": [0.1] * 5, "slim:0": [0.03] * 5}}
    profile = RoutingProfile(
        target={"name": "tiny-target", "fingerprint": model_fingerprint(target.model)},
        drafter={"name": "tiny-drafter", "fingerprint": model_fingerprint(drafter.model)},
        masks=[LayerMask.skipping(4, [2])],
        gate=Gate("confidence", (0.0, 0.0)),
        calibration={"costs": {**costs, "prefix_tokens": 8, "repeats": 1}},
    )
    settings = CalibrationSettings(gammas=(2, 3), caps=(8,), new_tokens=8, quality_budget=0.0)
    new = reselect_kind(profile, "sha", target, drafter, settings, "code", 1, slim_quant=QuantRecipe.parse("int8"))
    assert new.slim_quant(0, "code").name == "int8" and new.slim_quant(0) is None and new.own_views() == ["code"]
    assert new.policy() == profile.policy() and new.policy("code").gamma in (2, 3)
    measured = new.calibration["kinds"]["code"]["costs"]
    assert measured["lengths"] == lengths and {"full", "slim:0", "drafter:model"} <= set(measured["seconds"])
    assert measured["seconds"]["full"] != costs["seconds"]["full"]  # measured here, not copied
    assert new.calibration["kinds"]["code"]["predicted"]["via"]["error_rate"] == 0.0
    path = tmp_path / "p.json"
    save_profile(new, path)
    engine = Engine(EngineSpec(target="tiny-target", profile=str(path)), target=target, drafter=drafter)
    via = engine.decoder("via")
    assert via.kind_slims["code"][0].linears is not None and via.slims[0].linears is None
    with pytest.raises(ViasdError, match="one slim view"):
        two = dataclasses.replace(
            profile,
            masks=[LayerMask.skipping(4, [2]), LayerMask.skipping(4, [1])],
            gate=Gate("confidence", (0.0, 0.0, 0.0)),
        )
        reselect_kind(two, "sha", target, drafter, settings, "code", 1, slim_quant=QuantRecipe.parse("int8"))


def test_a_kinds_own_view_that_cannot_be_made_leaves_that_kind_exact(tmp_path, capsys):
    """A profile whose code policy verifies on a GGUF file's blocks, for a target that came from no GGUF file: code
    requests are verified by the full target (one warning line), prose keeps the profile's policy."""
    target, drafter = (
        loaded(tiny_model("qwen2", layers=4), "tiny-target"),
        loaded(tiny_model("qwen2", layers=2, seed=1), "tiny-drafter"),
    )
    own = {"gate": {"signal": "kl", "thresholds": [0.1, 1.0]}, "gamma": 3, "cap": 8, "pregate": 0.5, "stop": 0.2}
    profile = RoutingProfile(
        target={"name": "tiny-target", "fingerprint": model_fingerprint(target.model)},
        drafter=None,
        masks=[LayerMask.skipping(4, [2])],
        gate=Gate("confidence", (0.0, 0.5)),
        kinds={"code": {**own, "gate": Gate("kl", (0.1, 1.0)), "quant": ["int4a8:gguf"]}},
    )
    path = tmp_path / "p.json"
    save_profile(profile, path)
    engine = Engine(EngineSpec(target="tiny-target", profile=str(path)), target=target, drafter=drafter)
    via = engine.decoder("via")
    code = via.kinds["code"]
    assert code.gate.always_full and (code.gamma, code.cap, code.stop) == (3, 8, 0.2) and not via.kind_slims
    assert via.policy == profile.policy()
    err = capsys.readouterr().err
    assert "int4a8:gguf takes the blocks of the GGUF file" in err and "code requests are verified by the full" in err
    assert len(err.strip().splitlines()) == 1


def test_a_profile_calibrated_on_the_files_blocks_verifies_against_them(tmp_path):
    """`calibrate --quant gguf`: the continuations, the mask search, the gate records and the costs are the target's
    gguf view's, its slim view those blocks with layers skipped; `via` built from the profile verifies against that
    view, so via-exact gives the tokens plain decoding gives over the file's blocks."""
    from helpers import qwen2_with_gguf
    from viasd.methods import parse_method
    from viasd.views.gguf import GgufWeights
    from viasd.views.quantize import quantize

    model, path, _ = qwen2_with_gguf(tmp_path, layers=6)
    target = LoadedModel(model=model, tokenizer=tiny_tokenizer(64), name="tiny-target", path=str(path))
    drafter = loaded(tiny_model("qwen2", layers=2, seed=1, dtype=torch.float32), "tiny-drafter")
    settings = CalibrationSettings(
        skip_ratios=(0.34,), iterations=3, gammas=(2, 3), caps=(8,), prompts=2, search_prompts=1, held_out=0,
        new_tokens=12, cost_repeats=1, random_masks=1, pregates=(0.0,), target_quant=QuantRecipe.parse("gguf"),
    )  # fmt: skip

    def quantized(loaded_model, recipe):
        return quantize(loaded_model.model, recipe, gguf=GgufWeights(path) if recipe.gguf else None)

    profile = calibrate_pair(target, drafter, settings, work_file=tmp_path / "p.work", quantized=quantized)
    assert profile.target["quant"] == QuantRecipe.parse("gguf").name and profile.masks[0].skipped_layers
    assert not profile.quant  # the slim view is the target's own view, layers skipped
    saved = tmp_path / "p.gguf.json"
    save_profile(profile, saved)
    assert load_profile(saved).target_quant == QuantRecipe.parse("gguf")
    engine = Engine(EngineSpec(target="tiny-target", profile=str(saved)), target=target, drafter=drafter)
    via = engine.decoder("via")
    full = via.session.base_view
    assert full is not None and full.linears is not None and full.linears.from_file > 0
    assert via.slims[0].linears is full.linears and via.slims[0].mask == profile.masks[0]
    assert engine.target_as_run(parse_method("via")) == "gguf view of tiny.gguf"
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    prompt = [1, 5, 9, 13, 1, 5]
    assert engine.generate(prompt, "via-exact", config).tokens == engine.generate(prompt, "plain", config).tokens
    refused = Engine(EngineSpec(target="tiny-target", profile=str(saved), quant=QuantRecipe.parse("int8")),
                     target=target, drafter=drafter)  # fmt: skip
    with pytest.raises(ViasdError, match="calibrated on \\(its int4a8:gguf view\\): it takes no --quant int8"):
        refused.decoder("via")
