"""A draft head as a calibration drafter: its teacher-forced records are what the head drafts in decoding at each depth
of a round, and the replay reads a round's i-th draft at depth i + 1."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from test_calibrate import pair_on_disk
from test_head import PROMPT, random_head
from tiny import tiny_model, tiny_tokenizer
from viasd.calibration.costs import GREEDY
from viasd.calibration.head_drafts import HeadSource, chain_states, context_additions
from viasd.calibration.records import GateRecords, gate_records
from viasd.calibration.replay import replay
from viasd.calibration.teacher import teacher_force
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.decode.round import RoundPolicy
from viasd.drafters.head import HeadDrafter
from viasd.errors import ViasdError
from viasd.heads.attention import AttentionHead, AttentionHeadConfig
from viasd.passes.session import KVSession
from viasd.profile import RoutingProfile
from viasd.verify.gates import Gate


def continued(target, new_tokens: int = 24) -> list[int]:
    config = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    return PROMPT + PlainDecoder(target, tiny_tokenizer(64)).generate(PROMPT, config).tokens


def test_a_heads_records_are_its_drafts_at_every_depth():
    """At every scored position t and depth d, the recorded prediction is the first draft of a head whose target
    session holds the tokens up to t - d (its latest feature there) and that is asked to draft after t: the same
    token and the same distribution, tokens the context showed outside the head's vocabulary included."""
    target = tiny_model("qwen2").float()
    head = random_head(64, 24, scale=0.2, dtype=torch.float32)  # tokens 0..23: the context adds the others it shows
    ids = continued(target)
    start = len(PROMPT)
    seq = teacher_force(target, ids, start)
    source = HeadSource.make(target, head, "digest", depths=4)
    per_depth = source.logits(seq)
    assert len(per_depth) == 4 and all(p.shape == (len(ids) - start, 64) for p in per_depth)
    drafter = HeadDrafter(head, target, compute="float32")
    checked = added = 0
    for depth, logits in enumerate(per_depth, start=1):
        for t in range(start + depth - 1, len(ids) - 1):
            session = KVSession(target)
            drafter.follow(session)
            drafter.reset()
            session.forward(ids[: t - depth + 1])  # its last row: the feature at t - depth
            proposal = drafter.propose(ids[: t + 1], 1, GREEDY, torch.Generator())
            recorded = logits[t - start]
            assert proposal.tokens == [int(recorded.argmax())], (depth, t)
            torch.testing.assert_close(proposal.soft[0].float(), recorded.softmax(-1), rtol=1e-4, atol=1e-5)
            checked += 1
            added += int(recorded.argmax()) >= 24
    assert checked > 60 and added > 0  # some drafts were tokens only the context's additions could score


def test_chain_states_fold_the_sequence_from_the_feature_depth_positions_back():
    """Depth d at position t: the feature of t - d with tokens t - d + 1..t folded in, or from the prompt's last row
    (start - 1) with fewer folds where t - d lies before it."""
    hidden, n, start = 4, 9, 3
    features = torch.randn(n - start + 1, hidden)
    ids = torch.arange(10, 10 + n)

    def step(state, embedded):
        return state * 2 + embedded

    def embed(tokens):
        return tokens.float()[:, None].expand(-1, hidden)

    for depth in (1, 2, 3, 5):
        got = chain_states(step, embed, features, ids, start, depth)
        for t in range(start, n):
            origin = max(t - depth, start - 1)
            want = features[origin - (start - 1)].clone()
            for u in range(origin + 1, t + 1):
                want = want * 2 + float(ids[u])
            torch.testing.assert_close(got[t - start], want)


def test_context_additions_are_first_seen_tokens_the_head_lacks():
    assert context_additions([1, 9, 2, 9, 7, 1], {1, 2}) == ([9, 7], [1, 4])


def test_an_attention_head_is_refused_in_one_line():
    target = tiny_model("qwen2").float()
    head = AttentionHead(
        AttentionHeadConfig(hidden=64, heads=2, kv_heads=1, head_dim=16, width=32, vocab=24), torch.arange(24)
    )
    with pytest.raises(ViasdError, match="attention draft head"):
        HeadSource.make(target, head, "digest", depths=2)


def records(right_by_depth: list[bool], n: int = 40) -> GateRecords:
    """Records where the drafter's prediction at depth d is right iff right_by_depth[d - 1], everywhere."""

    def one(right: bool) -> GateRecords:
        return GateRecords(
            kl=[0.0] * n, confidence=[0.0] * n, draft_ok=[right] * n, draft_top=[0.9] * n,
            slim_ok=[[True] * n], slim_agrees=[[right] * n],
        )  # fmt: skip

    first, *deeper = (one(right) for right in right_by_depth)
    return dataclasses.replace(first, depths=deeper)


def test_the_replay_reads_a_rounds_ith_draft_at_depth_i_plus_one():
    """Right at depth 1 only: every round keeps exactly one draft (the depth-2 draft after it is wrong), where
    records without depths would keep whole blocks."""
    exact = RoundPolicy(Gate.exact(), gamma=4)
    shallow = replay([records([True, False, False])], exact)
    assert shallow.stats.accepted == shallow.stats.rounds - 1 or shallow.stats.accepted == shallow.stats.rounds
    assert shallow.stats.accepted / shallow.stats.rounds > 0.9
    flat = replay([records([True])], exact)
    assert flat.stats.accepted / flat.stats.rounds > 3.5
    deep = replay([records([True, True, True, False])], exact)  # depths beyond the recorded read as the deepest
    assert 2.5 < deep.stats.accepted / deep.stats.rounds <= 3.0


def test_records_with_depths_round_trip_and_malformed_ones_are_refused():
    made = records([True, False, True])
    back = GateRecords.from_dict(dataclasses.asdict(made))
    assert back == made and back.at_depth(3).draft_ok == made.depths[1].draft_ok and back.at_depth(9) == made.depths[1]
    short = dataclasses.asdict(made)
    short["depths"][0]["kl"] = short["depths"][0]["kl"][:-1]
    short["depths"][0]["confidence"] = short["depths"][0]["confidence"][:-1]
    with pytest.raises(ViasdError, match="malformed gate records"):
        GateRecords.from_dict({**short, "depths": [dict(short["depths"][0], draft_ok=[True])]})
    with pytest.raises(ViasdError, match="depths is not a list"):
        GateRecords.from_dict({**dataclasses.asdict(made), "depths": 3})


def test_gate_records_from_per_depth_logits_keep_one_set_per_depth():
    torch.manual_seed(0)
    full, slim = torch.randn(6, 11), torch.randn(6, 11)
    depths = [full + 0.01 * torch.randn(6, 11), torch.randn(6, 11)]
    made = gate_records(depths, [slim], full)
    assert made.draft_ok == [True] * 6 and len(made.depths) == 1
    assert made.depths[0] == gate_records(depths[1], [slim], full)


def test_a_profile_with_a_head_drafter_needs_no_drafter_model(tmp_path):
    """A head-drafted profile records the head's digest, round-trips it, and checks only the target."""
    target = tiny_model("qwen2")
    from viasd.models.fingerprint import model_fingerprint
    from viasd.profile import load_profile, save_profile
    from viasd.views.layer_skip import LayerMask

    profile = RoutingProfile(
        target={"name": "t", "fingerprint": model_fingerprint(target)},
        drafter={"name": "head", "head": "abc"},
        masks=[LayerMask.skipping(4, [2])],
    )
    save_profile(profile, tmp_path / "p.json")
    back = load_profile(tmp_path / "p.json")
    assert back.head_drafter == "abc" and not back.self_drafter
    back.check_models(target, tiny_model("llama"))  # another model as the drafter: not the head's business


def test_reselect_for_the_head_then_via_drafts_with_lookup_and_the_head(tmp_path, monkeypatch):
    """`viasd calibrate --drafters model,head` weighs both drafters; `viasd calibrate --reselect P --drafters head`
    makes a profile whose drafter is the target's head (its digest),
    with the head's pass costs measured and per-depth records; `via-exact` with it drafts with the head (and lookup)
    and gives plain greedy's tokens, and no drafter model is checked against it."""
    from typer.testing import CliRunner

    from viasd.cli import app
    from viasd.engine import Engine, EngineSpec
    from viasd.heads.file import load_head, save_head
    from viasd.heads.find import trained_head_path
    from viasd.models.fingerprint import model_fingerprint
    from viasd.profile import load_profile

    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path / "cache"))
    dirs, common = pair_on_disk(tmp_path)
    first, headed = tmp_path / "p.json", tmp_path / "h.json"
    runner = CliRunner()
    made = runner.invoke(app, ["calibrate", *common, "--output", str(first), "--skip-ratio", "0.34", "--iterations",
                               "2", "--prompts", "2", "--search-prompts", "1", "--new-tokens", "12", "--gammas", "2,3",
                               "--caps", "8,16", "--no-progress"])  # fmt: skip
    assert made.exit_code == 0, made.output
    missing = runner.invoke(
        app, ["calibrate", *common, "--reselect", str(first), "--drafters", "head", "-o", str(headed)]
    )
    assert missing.exit_code != 0 and "no draft head for this target" in missing.output
    timing = ["costs", *common, "--views", "full,skip=0.34", "--head", "--tokens", "1,2,4", "--context", "8",
              "--repeats", "1", "--out"]  # fmt: skip
    random_timed = runner.invoke(app, [*timing, str(tmp_path / "random.json")])
    assert random_timed.exit_code == 0 and "timing a random one" in random_timed.output  # no head: the same work
    assert "no trained weights" in json.loads((tmp_path / "random.json").read_text())["weights"]["head"]
    engine = Engine(EngineSpec(target=str(dirs["target"]), drafter=str(dirs["drafter"]), dtype="fp32", device="cpu"))
    fingerprint = model_fingerprint(engine.target.model)
    save_head(trained_head_path(fingerprint), random_head(64, 64, scale=0.2, dtype=torch.float32), fingerprint, "v", {})
    both = tmp_path / "both.json"
    made = runner.invoke(app, ["calibrate", *common, "--output", str(both), "--skip-ratio", "0.34", "--iterations",
                               "2", "--prompts", "2", "--search-prompts", "1", "--new-tokens", "12", "--gammas", "2,3",
                               "--caps", "8,16", "--drafters", "model,head", "--no-progress"])  # fmt: skip
    assert made.exit_code == 0, made.output
    chosen = load_profile(both)
    assert {c["drafter"] for c in chosen.search["candidates"]} == {"model", "head"}
    assert set(chosen.calibration["costs"]["seconds"]) >= {"drafter:model", "drafter:head", "full"}
    assert (chosen.head_drafter is not None) == (chosen.calibration["costs"]["drafter"] == "head")
    result = runner.invoke(
        app, ["calibrate", *common, "--reselect", str(first), "--drafters", "head", "-o", str(headed)]
    )
    assert result.exit_code == 0, result.output
    profile = load_profile(headed)
    assert profile.head_drafter == load_head(trained_head_path(fingerprint)).digest
    assert "drafter head" in result.output
    cal = profile.calibration
    assert cal["costs"]["drafter"] == "head" and len(cal["costs"]["seconds"]["drafter:head"]) == len(
        cal["costs"]["lengths"]
    )
    assert len(cal["statistics"]["draft_ok_rate_by_depth"]) == 8
    assert profile.masks == load_profile(first).masks
    prompt = PROMPT * 2  # a repeat, so that prompt lookup copies in some rounds
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    plain = engine.generate(prompt, "plain", config)
    exact = engine.generate(prompt, f"via-exact:profile={headed}", config)
    assert exact.tokens == plain.tokens
    assert "head" in exact.stats.sources and "lookup" in exact.stats.sources
    assert engine.decoder(f"via:profile={headed}").drafter.describe().startswith("hybrid")
    via = ["generate", "t3 t4 t5", *common, "--method", f"via:profile={headed}", "-n", "4", "--json"]
    ran = runner.invoke(app, via)
    assert ran.exit_code == 0, ran.output
    assert "drafter" not in json.loads(ran.stdout)  # no drafter model loaded, none named
    # `viasd costs --head` times the head as the profile's drafter; `viasd project` reads that table for it.
    costs, out = tmp_path / "costs.json", tmp_path / "projection.json"
    timed = runner.invoke(app, [*timing[:-1], "--views", "full,profile", "--profile", str(headed), "--out", str(costs)])
    assert timed.exit_code == 0, timed.output
    record = json.loads(costs.read_text())
    head = record["tables"][-1]
    assert (head["role"], head["model"], list(head["views"])) == ("drafter", f"{dirs['target']} head", ["head"])
    assert len(head["views"]["head"]) == 3 and min(head["views"]["head"]) > 0
    assert record["weights"]["head"] == "as found for the target"
    projected = runner.invoke(app, ["project", *common, "--costs", str(costs), "--profile", str(headed), "--out",
                                    str(out), "--no-prefill"])  # fmt: skip
    assert projected.exit_code == 0, projected.output
    report = json.loads(out.read_text())
    assert report["costs"]["drafter_view"] == "head" and report["costs"]["drafter"].endswith(" head")
    assert report["costs"]["slim_views"] == ["profile"] and report["methods"]["via"]["decided"]
