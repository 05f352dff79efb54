"""The `auto` method: it times the exact candidates once, keeps the fastest (never one slower than plain in its
probe), caches the choice, stays exact, and says what it chose; a drafter of another tokenizer is left out."""

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
    first = engine()
    decoder = first.decoder("auto")
    record = decoder.choice
    rates = record["tokens_per_second"]
    expected = auto.candidates(None, int4a8=auto.int4a8_is_fast(torch.device("cpu")))
    assert set(rates) == set(expected) and record["chosen"] == auto.pick(rates)
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
    record = {"chosen": "sd:drafter=head", "candidates": names, "tokens_per_second": rates, "date": "2026-12-05"}
    (tmp_path / "k.json").write_text(json.dumps(record))
    probed = lambda *a, **k: pytest.fail("probed again")  # noqa: E731
    assert auto.choose(probed, names, None, "k", tmp_path)["chosen"] == "sd:drafter=lookup+head"
    assert auto.why("sd:drafter=lookup+head", rates).startswith("sd:drafter=head with prompt lookup first")
    assert auto.why("sd:drafter=head", rates) == "fastest exact method in a probe on this machine"


def test_auto_leaves_out_a_drafter_of_another_tokenizer():
    assert "sd" not in auto.candidates(False) and "sd" in auto.candidates(True)
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
