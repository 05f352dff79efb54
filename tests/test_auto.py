"""The `auto` method: it times the exact candidates once, settles near-ties in a run-off on longer answers, keeps the
fastest (never one slower than plain in its probe), caches the choice, stays exact, and says what it chose; a
drafter of another tokenizer is left out."""

import json

import pytest
import torch

from tiny import tiny_model, tiny_tokenizer
from viasd import auto
from viasd.decode.base import GenerationConfig
from viasd.engine import Engine, EngineSpec
from viasd.models.loading import LoadedModel

PROMPT = [3, 4, 5, 6, 7, 3, 4, 5, 9, 12]


def engine(drafter=True):
    tok = tiny_tokenizer(64)
    target = LoadedModel(tiny_model("qwen2"), tok, "t", "t")
    small = LoadedModel(tiny_model("qwen2", layers=2, seed=1), tok, "d", "d") if drafter else None
    return Engine(EngineSpec(target="t", drafter="d"), target=target, drafter=small)


def test_auto_probes_once_picks_the_fastest_and_stays_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path / "models"))
    monkeypatch.setattr(auto, "PROBE_PROMPTS", ("t3 t4 t5", "t9 t8 t7 t6"))
    monkeypatch.setattr(auto, "RUNOFF_PROMPTS", ("t5 t6 t7 t8", "t2 t3"))
    first = engine()
    decoder = first.decoder("auto")
    record = decoder.choice
    rates = record["tokens_per_second"]
    expected = auto.candidates(None, int4a8=auto.int4a8_is_fast(torch.device("cpu")))
    assert set(rates) == set(expected) and record["chosen"] == auto.pick(auto.deciding_rates(record))
    assert set(record.get("runoff") or ()) == set(auto.contenders(rates))  # near-ties ran again
    assert "plain" in rates  # plain was probed too: the method chosen is never slower than plain in the probe
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    out = first.generate(PROMPT, "auto", config)
    assert out.tokens == first.generate(PROMPT, "plain", config).tokens
    assert out.stats.method == "auto" and out.stats.choice["method"] == record["chosen"]
    assert out.stats.to_dict()["choice"]["tokens_per_second"] == rates
    # A second engine on the same machine and models reads the choice instead of probing again.
    monkeypatch.setattr(auto, "probe", lambda *a, **k: pytest.fail("probed again"))
    again = engine().decoder("auto")
    assert again.choice["chosen"] == record["chosen"] and "cached" in again.choice


def test_auto_picks_the_fastest_or_its_lookup_variant_within_the_tie_and_never_one_slower_than_plain():
    rates = {"plain": 20.0, "lookup": 21.0, "sd:drafter=head": 36.0, "sd:drafter=lookup+head": 35.0}
    assert auto.pick(rates) == "sd:drafter=lookup+head"  # 2.8% behind: the probe cannot show what lookup gains
    assert auto.pick({**rates, "sd:drafter=lookup+head": 30.0}) == "sd:drafter=head"  # clearly slower
    quant = {"plain": 20.0, "sd:drafter_quant=int4a8": 25.0, "sd:drafter=hybrid:drafter_quant=int4a8": 24.5}
    assert auto.pick(quant) == "sd:drafter=hybrid:drafter_quant=int4a8"
    assert auto.pick({"plain": 20.0, "sd:drafter=head": 20.5, "sd:drafter=lookup+head": 19.9}) == "sd:drafter=head"
    assert auto.pick({"plain": 20.0, "lookup": 19.5}) == "plain"  # plain has no lookup variant to defer to
    assert auto.pick({"plain": 20.0, "lookup": 20.0}) == "plain"  # a tie goes to plain


def test_a_cached_choice_is_made_again_from_its_timings(tmp_path):
    names = ["plain", "sd:drafter=head", "sd:drafter=lookup+head"]
    rates = {"plain": 20.0, "sd:drafter=head": 36.0, "sd:drafter=lookup+head": 35.0}
    final = {"sd:drafter=head": 30.0, "sd:drafter=lookup+head": 29.0}  # the run-off of the two within 10%
    record = {"chosen": "sd:drafter=head", "candidates": names, "tokens_per_second": rates, "date": "2026-12-05"}
    (tmp_path / "k.json").write_text(json.dumps({**record, "runoff": final}))
    probed = lambda *a, **k: pytest.fail("probed again")  # noqa: E731
    assert auto.choose(probed, names, None, "k", tmp_path)["chosen"] == "sd:drafter=lookup+head"
    assert auto.why("sd:drafter=lookup+head", final).startswith("sd:drafter=head with prompt lookup first")
    assert auto.why("sd:drafter=head", rates) == "fastest exact method in a probe on this machine"


def test_the_runoff_takes_the_methods_within_the_tie_of_the_fastest_and_only_near_ties():
    rates = {"plain": 20.0, "lookup": 21.0, "sd": 30.0, "sd:drafter=head": 36.0, "sd:drafter=lookup+head": 35.0}
    assert auto.contenders(rates) == ["sd:drafter=head", "sd:drafter=lookup+head"]  # sd is 17% behind
    assert auto.contenders({**rates, "sd": 33.0}) == ["sd:drafter=head", "sd:drafter=lookup+head", "sd"]
    assert auto.contenders({"plain": 20.0, "sd": 30.0}) == []  # one method that close: nothing to settle
    many = {f"m{i}": 30.0 - 0.1 * i for i in range(6)}
    assert auto.contenders({**many, "plain": 10.0}) == ["m0", "m1", "m2", "m3"]  # at most RUNOFF_SIZE
    # Plain runs again only when the probe has it that close; otherwise every contender beat it in the probe.
    assert auto.contenders({"plain": 20.0, "lookup": 21.0}) == ["lookup", "plain"]
    assert auto.contenders({"plain": 20.0, "lookup": 20.0}) == ["plain", "lookup"]  # plain first on a tie


def test_a_near_tie_is_settled_by_the_runoff_once_and_an_older_cached_probe_gets_only_the_runoff(tmp_path):
    """The probe's 1% lead of the head is overturned by the run-off (as on the dense target on a Zen 4); the choice
    is saved with the run-off's timings and read back without timing anything; a cached probe from before run-offs
    existed is completed by a run-off alone."""
    names = ["plain", "sd:drafter=head", "sd:drafter=lookup+head", "sd:drafter_quant=int4a8"]
    first = {"plain": 7.2, "sd:drafter=head": 11.4, "sd:drafter=lookup+head": 11.0, "sd:drafter_quant=int4a8": 11.3}
    final = {"sd:drafter=head": 8.5, "sd:drafter=lookup+head": 9.7, "sd:drafter_quant=int4a8": 10.8}
    timed = []

    def probe(decoder_of, methods, tokenizer, log, texts=auto.PROBE_PROMPTS, new_tokens=auto.PROBE_TOKENS, label=""):
        timed.append((list(methods), new_tokens))
        return {name: (first if texts == auto.PROBE_PROMPTS else final)[name] for name in methods}

    lines = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(auto, "probe", probe)
        record = auto.choose(None, names, None, "k", tmp_path, lines.append)
        assert record["chosen"] == "sd:drafter_quant=int4a8" and record["runoff"] == final
        runoff = ["sd:drafter=head", "sd:drafter_quant=int4a8", "sd:drafter=lookup+head"]  # fastest first
        assert timed == [(names, auto.PROBE_TOKENS), (runoff, auto.RUNOFF_TOKENS)]
        assert any("3 methods within 10%" in line for line in lines)
        assert auto.why(record["chosen"], final, True).endswith("run-off of the 3 closest in a probe on this machine")
        assert auto.choose(None, names, None, "k", tmp_path)["chosen"] == "sd:drafter_quant=int4a8"
        assert len(timed) == 2  # read back: nothing timed again
        older = {"chosen": "sd:drafter=head", "candidates": names, "tokens_per_second": first, "date": "2026-12-04"}
        (tmp_path / "old.json").write_text(json.dumps(older))
        assert auto.choose(None, names, None, "old", tmp_path)["chosen"] == "sd:drafter_quant=int4a8"
        assert timed[2:] == [(runoff, auto.RUNOFF_TOKENS)]
        assert json.loads((tmp_path / "old.json").read_text())["runoff"] == final
    # A run-off that names methods that are not candidates is a damaged record: one line, probed again.
    damaged = {**older, "runoff": {"sd:drafter=other": 3.0}}
    (tmp_path / "bad.json").write_text(json.dumps(damaged))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(auto, "probe", probe)
        lines.clear()
        assert auto.choose(None, names, None, "bad", tmp_path, lines.append)["runoff"] == final
        assert "its run-off is not timings of its candidates" in lines[0]


def test_auto_leaves_out_a_drafter_of_another_tokenizer():
    assert "sd" not in auto.candidates(False) and "sd:drafter_quant=int4" in auto.candidates(True)
    assert "sd" in auto.candidates(True, quantize=False)  # on a GPU the drafter runs as loaded
    assert auto.candidates(False)[0] == "plain"


def test_auto_drafts_with_int4a8_views_only_where_their_kernel_runs():
    fast = auto.candidates(True, int4a8=True)
    assert "sd:drafter_quant=int4a8" in fast and "self:drafter_quant=int4a8" in fast
    assert not any(name.endswith("=int4") or name.endswith("=int8") for name in fast)
    assert "sd:drafter_quant=int4" in auto.candidates(True) and "self:drafter_quant=int8" in auto.candidates(True)
    assert not auto.int4a8_is_fast(torch.device("meta"))  # not a CPU: the kernel is not used there
    # A target converted from a GGUF file with 4-bit blocks drafts for itself with those blocks.
    assert "self:drafter_quant=gguf" in auto.candidates(True, int4a8=True, gguf=True)
    assert "self:drafter_quant=gguf" not in auto.candidates(True, int4a8=False, gguf=True)
    # A drafter from such a file drafts with its own blocks, and never as a dense copy made for the probe.
    from_file = auto.candidates(True, int4a8=True, drafter_gguf=True)
    assert "sd:drafter_quant=gguf" in from_file and "sd:drafter=hybrid:drafter_quant=gguf" in from_file
    assert "sd" not in from_file and "sd" not in fast
    with_head = auto.candidates(True, int4a8=True, head=True)
    assert {"sd:drafter=head", "sd:drafter=lookup+head", "sd:drafter=suffix+head"} <= set(with_head)
    assert "sd:drafter=suffix+head" not in fast  # no head, no head methods


def test_a_default_drafter_of_another_tokenizer_is_refused_before_any_fetch(monkeypatch):
    tok = tiny_tokenizer(64)
    target = LoadedModel(tiny_model("qwen2"), tok, "t", "t")
    spec = EngineSpec(target="t", drafter="qwen2.5-coder-0.5b")  # a default model: its vocabulary is pinned
    monkeypatch.setattr("viasd.engine.load_model", lambda *a, **k: pytest.fail("fetched or loaded the drafter"))
    engine = Engine(spec, target=target)
    assert engine.drafter_fits() is False
    with pytest.raises(Exception, match="--drafter"):
        engine.decoder("sd")
    assert "sd" not in auto.candidates(engine.drafter_fits())


def test_a_probe_is_not_reused_on_another_cpu_or_with_other_kernels(monkeypatch):
    """The cached choice belongs to the machine that timed it: another CPU model (same core count), kernels that run
    differently here, or passes that run another way, probe again."""
    model = tiny_model()
    names = auto.candidates(True)
    key = auto.probe_key(model, {}, names)
    assert auto.probe_key(model, {}, names) == key
    monkeypatch.setattr("viasd.kernels.cpu.cpu_model", lambda: "Some Other CPU")
    other_cpu = auto.probe_key(model, {}, names)
    monkeypatch.setattr("viasd.kernels.w6a8.kernel_status", lambda: "no C compiler found (set CC)")
    other_kernels = auto.probe_key(model, {}, names)
    monkeypatch.setenv("VIASD_KERNELS", "-attention")
    assert len({key, other_cpu, other_kernels, auto.probe_key(model, {}, names)}) == 4


def test_exact_via_is_a_candidate_where_a_routing_profile_fits_the_target_and_relaxed_via_never(tmp_path, monkeypatch):
    """A profile calibrated for this target as it runs makes `via-exact` a candidate (its probe and its output are
    the exact methods'); a profile made for another model does not, and the relaxed `via` never is."""
    from viasd.models.fingerprint import model_fingerprint
    from viasd.profile import RoutingProfile, save_profile
    from viasd.verify.gates import Gate
    from viasd.views.layer_skip import LayerMask

    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path / "models"))
    monkeypatch.setattr(auto, "PROBE_PROMPTS", ("t3 t4 t5", "t9 t8 t7 t6"))
    monkeypatch.setattr(auto, "RUNOFF_PROMPTS", ("t5 t6 t7 t8", "t2 t3"))
    assert "via-exact" in auto.candidates(True, via=True) and not any(
        name.split(":")[0] == "via" for name in auto.candidates(True, via=True, head=True)
    )
    assert auto.candidates(True, via=True, head=True)[-1] == "via-exact:drafter=lookup+head"
    made = engine()
    fits, other = tmp_path / "fits.json", tmp_path / "other.json"
    layers = len(made.target.model.model.layers)
    for path, model in ((fits, made.target.model), (other, tiny_model("qwen2", seed=7))):
        target = {"name": "t", "fingerprint": model_fingerprint(model)}
        mask = LayerMask.skipping(layers, [1])
        save_profile(RoutingProfile(target, None, [mask], [None], Gate("kl", (0.1, 1.0))), path)
    chosen = {}
    for path in (fits, other):
        tok = tiny_tokenizer(64)
        spec = EngineSpec(target="t", drafter="d", profile=str(path))
        one = Engine(
            spec, target=made.target, drafter=LoadedModel(tiny_model("qwen2", layers=2, seed=1), tok, "d", "d")
        )
        chosen[path] = one.decoder("auto").choice
        config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
        assert one.generate(PROMPT, "auto", config).tokens == one.generate(PROMPT, "plain", config).tokens
    assert "via-exact" in chosen[fits]["tokens_per_second"]
    assert not any(name.startswith("via") for name in chosen[other]["tokens_per_second"])
