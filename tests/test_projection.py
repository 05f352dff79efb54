"""Projection (`viasd project`): measured costs and statistics -> predicted tokens/s; its arithmetic by hand,
explicit statistics, the costs file it reads, and the command end to end on tiny models."""

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from tiny import tiny_model, tiny_tokenizer
from viasd.calibration.costs import Costs
from viasd.calibration.projection import (
    Workload,
    costs_from_record,
    explicit_records,
    project,
)
from viasd.calibration.records import GateRecords
from viasd.calibration.replay import first_feed, replay
from viasd.cli import app
from viasd.decode.base import GenerationConfig
from viasd.decode.round import Round, RoundPolicy
from viasd.decode.speculative import SpeculativeDecoder
from viasd.drafters.model_drafter import ModelDrafter
from viasd.errors import ViasdError
from viasd.passes.session import common_prefix_length
from viasd.verify.gates import Gate

# c(n) at n = 1, 2, 4, 8 tokens per pass, linear in between: c_f(3) = 1.15, c_f(6) = 1.35, c_d(6) = 0.135.
COSTS = Costs((1, 2, 4, 8), drafter=(0.1, 0.11, 0.12, 0.15), full=(1.0, 1.1, 1.2, 1.5), slim=((0.6, 0.65, 0.7, 0.9),))
OK = [True, True, False, True, True, True, True, False, True, True]  # the drafter is right at these positions
SD = RoundPolicy(Gate.exact(), gamma=2)


def records(draft_ok, tier=0):
    """One sequence whose every position sits in one tier of Gate('kl', (0.5, 2.0)), the slim view always right."""
    n = len(draft_ok)
    return GateRecords(
        kl=[(0.0, 1.0, 4.0)[tier]] * n,
        confidence=[0.0] * n,
        draft_ok=list(draft_ok),
        draft_top=[1.0] * n,
        slim_ok=[[True] * n],
        slim_agrees=[list(draft_ok)],
    )


def test_plain_is_one_full_pass_per_token_and_sd_matches_a_hand_replay():
    projected = project(Workload([records(OK)], [0], "constructed"), COSTS, SD, None)
    assert projected["plain"].tokens_per_second == pytest.approx(1 / COSTS.full_pass(1))
    # gamma 2 along OK: rounds keep 2 (+1), 2 (+1), 1 (+1) drafts, then the last round may draft 1 and keeps it.
    # Each round: k drafter steps and one target pass over 1 + k tokens; the first step after a round that kept
    # every draft feeds two tokens (c_d(2) = 0.11).
    by_hand = (2 * 0.1 + 1.15) + 2 * (0.11 + 0.1 + 1.15) + (1 * 0.1 + 1.1)
    sd = projected["sd"]
    assert sd.seconds == pytest.approx(by_hand) and sd.tokens == 10
    assert sd.tokens_per_second == pytest.approx(10 / by_hand) and sd.speedup == pytest.approx(10 / by_hand)
    assert sd.counts["target_calls"] == 4 and sd.counts["rounds"] == 4 and "via" not in projected


def test_reading_the_prompt_adds_the_terms_of_each_method():
    workload = Workload([records(OK)], [6], "constructed")
    via = RoundPolicy(Gate("kl", (0.5, 2.0)), gamma=2, cap=32)
    projected = project(workload, COSTS, SD, via)
    plain = 1.35 + 9 * 1.0  # the prompt's pass gives the first token
    assert projected["plain"].seconds == pytest.approx(plain)
    rounds = (2 * 0.1 + 1.15) + 2 * (0.11 + 0.1 + 1.15) + (1 * 0.1 + 1.1)  # as in the test above
    sd = rounds + (1.5 - 1.15) + (0.135 - 0.1)  # c_f(P + 2) - c_f(3), c_d(P) - c_d(1)
    assert projected["sd"].seconds == pytest.approx(sd)
    assert projected["sd"].speedup == pytest.approx(plain / sd)
    via_rounds = replay([records(OK)], via, COSTS).seconds
    assert projected["via"].seconds == pytest.approx(via_rounds + (1.5 - 1.15) + (0.135 - 0.1))  # as sd's first round


def test_accepted_tokens_skip_the_full_target_and_the_speedup_is_a_mean_over_sequences():
    """All positions in the accept tier, drafts right: via rounds pay drafter steps and one slim pass each."""
    via = RoundPolicy(Gate("kl", (0.5, 2.0)), gamma=2, cap=32)
    right = records([True] * 9)
    projected = project(Workload([right, records(OK)], [0, 0], "constructed"), COSTS, SD, via)
    alone = replay([right], via, COSTS)
    # The first round goes to the full target (c_f(3)), then two rounds of 2 drafts and a bonus from the slim view.
    assert alone.stats.target_calls == 1 and alone.stats.slim_calls == 2
    assert alone.seconds == pytest.approx(2 * 0.1 + 1.15 + 2 * (2 * 0.1 + 0.675) + 2 * 0.01)  # rounds 2, 3 feed 2
    ratios = [9 * 1.0 / alone.seconds, 10 * 1.0 / replay([records(OK)], via, COSTS).seconds]
    assert projected["via"].speedup == pytest.approx(math.sqrt(ratios[0] * ratios[1]))
    assert projected["via"].tokens_per_second == pytest.approx(19 / projected["via"].seconds)


def test_explicit_statistics_have_the_figures_asked_for_and_are_refused_when_impossible():
    made = explicit_records(0.8, (0.3, 0.4, 0.3), slim_agreement=0.9, sequences=40, length=200, seed=1)
    n = 40 * 200
    kl = [v for seq in made for v in seq.kl]
    assert abs(sum(v == 0.0 for v in kl) / n - 0.3) < 0.03 and abs(sum(v == 4.0 for v in kl) / n - 0.3) < 0.03
    assert abs(sum(v for seq in made for v in seq.draft_ok) / n - 0.8) < 0.03
    assert abs(sum(v for seq in made for v in seq.slim_ok[0]) / n - 0.9) < 0.03
    assert made == explicit_records(0.8, (0.3, 0.4, 0.3), slim_agreement=0.9, sequences=40, length=200, seed=1)
    routed = replay(made, RoundPolicy(Gate("kl", (0.5, 2.0)), gamma=4), COSTS)
    assert routed.decided["accept"] > 0 and routed.decided["slim"] > 0 and routed.decided["full"] > 0
    for bad in ({"tiers": (0.5, 0.6, 0.1)}, {"tiers": (1.0, 0.0)}, {"slim_agreement": 1.5}):
        with pytest.raises(ViasdError):
            explicit_records(0.8, **bad)
    with pytest.raises(ViasdError, match="acceptance must be a probability"):
        explicit_records(float("nan"))


def costs_record(contexts=(128, 1024), drafter=True):
    tables = [
        {"role": "target", "model": "t", "context": c, "views": {"full": [c * 1.0, c * 2.0], "skip=0.45": [0.5, 1.0]}}
        for c in contexts
    ]
    if drafter:
        tables.append({"role": "drafter", "model": "d", "context": 128, "views": {"full": [0.1, 0.2]}})
    return {"tokens": [1, 2], "tables": tables, "machine": {"device": "cuda:0", "gpu": "H200"}}


def test_costs_come_from_the_nearest_measured_context_and_missing_tables_are_named():
    costs, used = costs_from_record(costs_record(), ["skip=0.45"], context=900)
    assert used["context"] == 1024 and costs.full == (1024.0, 2048.0) and costs.slim == ((0.5, 1.0),)
    assert costs.drafter == (0.1, 0.2) and used["drafter_context"] == 128
    assert costs_from_record(costs_record(), ["skip=0.45"])[1]["context"] == 128
    with pytest.raises(ViasdError, match="no drafter table"):
        costs_from_record(costs_record(drafter=False), ["skip=0.45"])
    with pytest.raises(ViasdError, match=r"no target view 'skip=0.25' .*measured: full, skip=0.45"):
        costs_from_record(costs_record(), ["skip=0.25"])
    with pytest.raises(ViasdError, match="no model tables"):
        costs_from_record({"tokens": [1], "seconds": {"kernels": {}}}, ["x"])


def test_a_draft_heads_costs_come_from_its_own_table_and_it_reads_no_prompt():
    """With a drafter model's table and the head's in one file, `head` picks the head's; the head starts from the
    target's feature, so reading the prompt costs it nothing, where a drafter model pays c_d(P) - c_d(1)."""
    from viasd.calibration.projection import prompt_parts

    record = costs_record()
    record["tables"].append({"role": "drafter", "model": "t head", "context": 128, "views": {"head": [0.01, 0.02]}})
    head, used = costs_from_record(record, ["skip=0.45"], drafter="head")
    model, _ = costs_from_record(record, ["skip=0.45"])
    assert head.drafter == (0.01, 0.02) and used["drafter"] == "t head" and model.drafter == (0.1, 0.2)
    assert not head.drafter_reads_prompt and model.drafter_reads_prompt
    assert prompt_parts(50, 4, head)["draft"] == 0.0
    assert prompt_parts(50, 4, model)["draft"] == pytest.approx(model.drafter_pass(50) - model.step)
    assert prompt_parts(50, 4, head)["verify"] == prompt_parts(50, 4, model)["verify"]


def save_pair(tmp_path):
    tok = tiny_tokenizer(64)
    dirs = {}
    for name, model in (("target", tiny_model("llama", layers=6)), ("drafter", tiny_model("llama", layers=2, seed=1))):
        dirs[name] = tmp_path / name
        model.to(torch.float32).save_pretrained(dirs[name])
        tok.save_pretrained(dirs[name])
    return dirs


def test_costs_then_explicit_projection_from_the_command_line(tmp_path):
    dirs = save_pair(tmp_path)
    models = ["--target", str(dirs["target"]), "--drafter", str(dirs["drafter"]), "--dtype", "fp32", "--device", "cpu"]
    costs = tmp_path / "costs.json"
    runner = CliRunner()
    made = runner.invoke(app, ["costs", *models, "--views", "full,skip=0.34", "--drafter-views", "full", "--tokens",
                               "1,2,4,8", "--context", "8,24", "--repeats", "1", "--out", str(costs)])  # fmt: skip
    assert made.exit_code == 0, made.output
    record = json.loads(costs.read_text())
    assert [(t["role"], t["context"]) for t in record["tables"]] == [
        ("target", 8), ("target", 24), ("drafter", 8), ("drafter", 24)
    ]  # fmt: skip
    assert record["weights"] == {"target": "as loaded", "drafter": "as loaded"} and record["machine"]["torch"]
    out = tmp_path / "projection.json"
    args = ["project", "--costs", str(costs), "--acceptance", "0.8", "--tiers", "0.3,0.4,0.3", "--slim",
            "skip=0.34", "--context", "20", "--out", str(out)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["statistics"].startswith("explicit, assumed (not measured)") and "explicit, assumed" in result.output
    full = next(t for t in record["tables"] if t["role"] == "target" and t["context"] == 24)["views"]["full"]
    plain = report["methods"]["plain"]["tokens_per_second"]
    assert report["costs"]["context"] == 24 and plain == pytest.approx(1 / full[0])
    assert set(report["methods"]) == {"plain", "sd", "via"} and report["methods"]["via"]["decided"]["slim"] > 0
    assert report["policies"]["sd"] == {"gamma": 4, "stop": 0.0}  # explicit statistics carry no drafter confidence
    # --full names the view the target runs as (a GGUF target's `gguf`): plain's rate is that view's.
    as_run = runner.invoke(app, [*args[:-2], "--full", "skip=0.34", "--out", str(out)])
    assert as_run.exit_code == 0, as_run.output
    skipped = next(t for t in record["tables"] if t["role"] == "target" and t["context"] == 24)["views"]["skip=0.34"]
    report = json.loads(out.read_text())
    assert report["costs"]["full_view"] == "skip=0.34"
    assert report["methods"]["plain"]["tokens_per_second"] == pytest.approx(1 / skipped[0])
    for bad, message in (
        (["project", "--costs", str(costs)], "name the statistics"),
        (["project", "--costs", str(costs), "--acceptance", "0.8", "--tiers", "0.5,0.6,0.1"], "add up to 1"),
        (["project", "--costs", str(tmp_path / "none.json"), "--acceptance", "0.8", "--slim", "x"], "not found"),
        (["project", "--costs", str(costs), "--acceptance", "0.8", "--slim", "skip=0.34", "--sd-stop", "2"], "[0, 1]"),
        (
            ["project", "--costs", str(costs), "--acceptance", "0.8", "--slim", "skip=0.34", "--full", "gguf"],
            "no target view 'gguf'",
        ),
    ):
        refused = runner.invoke(app, bad)
        assert refused.exit_code == 2 and message in refused.output, refused.output


def test_projection_from_a_profile_against_a_bench_run(tmp_path):
    """A profile's records regenerated from its prompts, the prompts counted, the bench's speedups beside; and
    the profile's prompts written as bench questions."""
    from viasd.bench.tasks import load_specbench
    from viasd.models.fingerprint import model_fingerprint
    from viasd.models.loading import load_model
    from viasd.profile import RoutingProfile, save_profile
    from viasd.views.layer_skip import LayerMask

    dirs = save_pair(tmp_path)
    target, drafter = (load_model(str(dirs[n]), device="cpu", dtype="fp32").model for n in ("target", "drafter"))
    texts = ["t3 t4 t5 t6 t7 t3 t4", "t9 t12 t8 t2 t30 t9"]
    # The search --reselect repeats (a small one: the tiny records need no more).
    search = {"quality_budget": 0.05, "gammas": [3, 4], "caps": [8], "pregates": [0.0], "stops": [0.0, 0.5]}
    profile = RoutingProfile(
        target={"name": "tiny", "fingerprint": model_fingerprint(target)},
        drafter={"name": "tiny-drafter", "fingerprint": model_fingerprint(drafter)},
        masks=[LayerMask.skipping(6, [2, 3])],
        gate=Gate("kl", (0.2, 2.0)),
        gamma=3,
        cap=8,
        search={"chunk": 8},
        calibration={"prompts": texts, "new_tokens": 12, **search},
    )
    path = tmp_path / "p.json"
    save_profile(profile, path)
    models = ["--target", str(dirs["target"]), "--drafter", str(dirs["drafter"]), "--dtype", "fp32", "--device", "cpu"]
    runner = CliRunner()
    questions = tmp_path / "questions.jsonl"
    wrote = runner.invoke(app, ["project", "--profile", str(path), "--write-questions", str(questions)])
    assert wrote.exit_code == 0, wrote.output
    assert [task.turns[0] for task in load_specbench(questions)] == texts
    costs = tmp_path / "costs.json"
    made = runner.invoke(app, ["costs", *models, "--views", "full,profile", "--profile", str(path), "--drafter-views",
                               "full", "--tokens", "1,2,4,8,16", "--context", "16", "--repeats", "1", "--out",
                               str(costs)])  # fmt: skip
    assert made.exit_code == 0, made.output
    # The tiny models' timings are all noise (a pass of 16 tokens can time below one of 1): the projection is
    # checked with the measured file's structure and costs that grow with the tokens, as real passes' do.
    record = json.loads(costs.read_text())
    for table in record["tables"]:
        for rank, view in enumerate(table["views"]):
            table["views"][view] = [(1 + rank) * 1e-3 + 1e-4 * n for n in record["tokens"]]
    costs.write_text(json.dumps(record))
    run = tmp_path / "run"
    run.mkdir()
    summary = [{"method": m, "category": "all", "speedup": s} for m, s in (("plain", 1.0), ("sd", 1.5), ("via", 1.2))]
    (run / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "projection.json"
    args = ["project", *models, "--costs", str(costs), "--profile", str(path), "--bench", str(run), "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["prompt_counted"] and report["sequences"] == 2 and report["statistics"].startswith("measured")
    assert report["bench"]["measured_speedup"] == {"plain": 1.0, "sd": 1.5, "via": 1.2}
    assert report["policies"]["via"]["gamma"] == 3 and report["costs"]["slim_views"] == ["profile"]
    assert report["policies"]["sd"] == {"gamma": 4, "stop": 0.5}  # the bench's sd: its default stop threshold
    assert "projected / measured" in result.output
    single = record["tables"][0]["views"]["full"][0]
    plain = report["methods"]["plain"]
    assert plain["tokens_per_second"] < 1 / single  # reading the prompt costs more than one single-token pass
    assert plain["seconds"] > plain["tokens"] * single
    # --reselect: the policies picked for these costs under the profile's recorded search; without the prompt terms
    # the projection is the selection's own replay, so sd re-selected is at least sd as the bench runs it (gamma 4,
    # stop 0.5: in the search), and via stays within the budget.
    fixed = [*args[:-4], "--no-prefill", "--out", str(out)]
    assert runner.invoke(app, fixed).exit_code == 0
    before = json.loads(out.read_text())["methods"]
    picked = runner.invoke(app, [*fixed, "--reselect"])
    assert picked.exit_code == 0, picked.output
    report = json.loads(out.read_text())
    assert report["reselected"]["quality_budget"] == 0.05 and "policies re-selected" in picked.output
    assert report["reselected"]["gammas"] == [3, 4] and report["policies"]["via"]["gamma"] in (3, 4)
    assert report["methods"]["sd"]["tokens_per_second"] >= before["sd"]["tokens_per_second"] - 1e-9
    assert report["methods"]["via"]["error_rate"] <= 0.05
    refused = runner.invoke(app, ["project", "--costs", str(costs), "--acceptance", "0.8", "--slim", "x", "--reselect"])
    assert refused.exit_code == 2 and "give --profile" in refused.output


def test_the_first_drafter_step_of_a_round_feeds_what_the_replay_charges():
    """The decoder's drafter feeds two tokens at the first step after a round that kept every draft (its unfed last
    draft and the bonus token), else one: the rule `first_feed` charges as c_d(2) or c_d(1)."""
    target = tiny_model("qwen2", layers=4, seed=0)
    drafter = tiny_model("qwen2", layers=4, seed=0)
    with torch.no_grad():  # a perturbed copy of the target: right often, not always
        generator = torch.Generator().manual_seed(0)
        for p in drafter.parameters():
            p.add_(0.03 * p.std() * torch.randn(p.shape, generator=generator))
    model_drafter = ModelDrafter(drafter)
    fed: list[int] = []  # tokens of each propose's first pass
    rounds: list[tuple[int, int]] = []  # (drafted, kept) per round, from the committed text that followed
    extend, propose = model_drafter.session.extend_to, model_drafter.propose

    def counting_extend(sequence, keep=1):
        shared = min(common_prefix_length(model_drafter.session.tokens, sequence), len(sequence) - keep)
        fed.append(len(sequence) - shared)
        return extend(sequence, keep)

    proposals: list[tuple[int, list[int]]] = []

    def recording_propose(context, k, params, generator, stop=0.0):
        out = propose(context, k, params, generator, stop)
        proposals.append((len(context), list(out.tokens)))
        return out

    model_drafter.session.extend_to = counting_extend
    model_drafter.propose = recording_propose
    decoder = SpeculativeDecoder(target, tiny_tokenizer(64), model_drafter, gamma=3)
    prompt = [5, 9, 11, 3, 7]
    tokens = decoder.generate(prompt, GenerationConfig(max_new_tokens=40, ignore_eos=True)).tokens
    text = prompt + tokens
    for start, drafts in proposals:
        kept = 0
        while kept < len(drafts) and start + kept < len(text) and text[start + kept] == drafts[kept]:
            kept += 1
        rounds.append((len(drafts), kept))
    drafting = [i for i, (drafted, _) in enumerate(rounds) if drafted]  # a round without drafts runs no drafter
    assert len(fed) == len(drafting) and fed[0] == len(prompt)  # the first round's step reads the prompt
    expected = [first_feed(Round([], rounds[i - 1][0], full_kept=rounds[i - 1][1])) for i in drafting[1:]]
    assert fed[1:] == expected
    assert 1 in expected and 2 in expected  # both cases happened


def test_a_profile_names_the_cost_views_of_its_slim_tiers_and_drafter():
    from viasd.calibration.project_command import profile_views
    from viasd.profile import RoutingProfile
    from viasd.views.layer_skip import LayerMask

    def made(masks, quant, drafter):
        thresholds = tuple(0.1 * (i + 1) for i in range(len(masks) + 1))
        return RoutingProfile({"name": "t", "fingerprint": "f"}, drafter, masks, quant, Gate("kl", thresholds))

    full, skip = LayerMask.full(6), LayerMask.skipping(6, [2, 3])
    quantized = made([full], ["int8"], {"name": "d", "fingerprint": "g", "quant": "int4"})
    assert profile_views(quantized) == ("int8", "int4")  # the shipped kind: int8 slim view, int4 drafter
    assert profile_views(made([skip, full], [None, "int8"], None)) == ("profile,int8", "full")
    assert profile_views(made([skip], ["int8"], None)) == ("profile+int8", "full")
    own = made([full], ["int8"], {"name": "t", "fingerprint": "f", "self": True, "quant": "int8"})
    assert profile_views(own) == ("int8", None)  # the command asks for --drafter-view then
    assert profile_views(made([skip], [None], {"name": "head", "head": "abc"})) == ("profile", "head")


def test_the_bench_sd_method_is_found_or_named(tmp_path):
    from viasd.calibration.project_command import _bench_rows

    def run(*methods):
        (tmp_path / "summary.json").write_text(
            json.dumps([{"method": m, "category": "all", "speedup": 1.0 + i / 10} for i, m in enumerate(methods)])
        )
        return tmp_path

    def speedups(run_dir, sd=None):  # what `viasd project --bench` compares with the projection
        return {name: row["speedup"] for name, row in _bench_rows(run_dir, sd).items()}

    assert speedups(run("plain", "sd:drafter_quant=int4", "via")) == {"plain": 1.0, "sd": 1.1, "via": 1.2}
    assert speedups(run("plain", "sd", "sd:gamma=8", "via"))["sd"] == 1.1  # plain sd when there is one
    assert speedups(run("plain", "sd", "sd:gamma=8"), "sd:gamma=8") == {"plain": 1.0, "sd": 1.2}
    with pytest.raises(ViasdError, match="--bench-sd"):
        speedups(run("plain", "sd:gamma=8", "sd:stop=0"))
    with pytest.raises(ViasdError, match="no method 'sd:x'"):
        speedups(run("plain", "sd"), "sd:x")
