"""The method registry: names and variants (`via:gamma=4:pregate=0.5`), parsing, errors, and that variants build
what they say."""

import pytest
import torch

from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.speculative import SpeculativeDecoder
from viasd.drafters.hybrid import HybridDrafter
from viasd.drafters.model_drafter import ModelDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.engine import Engine, EngineSpec
from viasd.errors import ViasdError
from viasd.methods import METHODS, OPTIONS, parse_method, parse_method_list
from viasd.models.loading import LoadedModel
from viasd.speculation import DEFAULT_STOP, HYBRID_BUDGET, HYBRID_MATCH, MAX_GAMMA


def test_plain_names_and_variants_parse():
    assert all(parse_method(name).base == name for name in METHODS)
    spec = parse_method(" via:gamma=3:cap=12:pregate=0.4:profile=my.json ")
    assert (spec.name, spec.base) == ("via:gamma=3:cap=12:pregate=0.4:profile=my.json", "via")
    assert dict(spec.options) == {"gamma": 3, "cap": 12, "pregate": 0.4, "profile": "my.json"}
    assert parse_method("sd:gamma=6").get("gamma") == 6 and parse_method("sd").get("gamma") is None
    assert not parse_method("lookup").uses_drafter and parse_method("hf-assisted:gamma=2").uses_drafter
    # Every method's options are registered options; the relaxed method and the other runtimes say so.
    assert all(set(m.options) <= set(OPTIONS) for m in METHODS.values())
    assert [m.name for m in METHODS.values() if not m.exact] == ["via", "llama.cpp", "llama-server"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("warp", "unknown method 'warp'"),
        ("sd:gamma", "write key=value"),
        ("sd:depth=3", "key one of gamma, cap, profile, pregate, kind, quant, drafter_quant, lookup, stop"),
        (
            "sd:cap=4",
            "'sd' takes no option 'cap' (it takes: gamma, stop, drafter, match, copy, budget, reach, head, "
            "head_compute, head_vocab, quant, drafter_quant)",
        ),
        ("sd:budget=0.1", "option 'budget' needs drafter=hybrid"),
        ("sd:drafter=hybrid:budget=-1", "budget must be a number >= 0, got -1.0"),
        ("sd:drafter=hybrid:budget=inf", "budget must be a number >= 0, got inf"),
        ("plain:gamma=2", "takes no option 'gamma' (it takes: quant)"),
        ("plain:quant=int3", "method option quant: unknown quantization 'int3'"),
        ("hf-assisted:quant=int8", "takes no option 'quant'"),
        ("lookup:stop=0.4", "method 'lookup' takes no option 'stop' (it takes: gamma, match, copy, quant)"),
        ("sd:stop=1.5", "stop must be a probability in [0, 1], got 1.5"),
        ("sd:stop=nan", "stop must be a probability in [0, 1], got nan"),
        (
            "sd:drafter=big",
            "drafter must be one of model, lookup, hybrid, head, lookup+head, suffix, suffix+head, got 'big'",
        ),
        ("sd:match=2", "option 'match' needs drafter=lookup, hybrid or lookup+head"),
        ("via:copy=8", "option 'copy' needs drafter=lookup, hybrid or lookup+head"),
        ("sd:drafter=head:match=2", "option 'match' needs drafter=lookup, hybrid or lookup+head"),
        ("sd:head=h.safetensors", "option 'head' needs drafter=head or drafter=lookup+head"),
        ("sd:head_compute=int8", "option 'head_compute' needs drafter=head or drafter=lookup+head"),
        ("sd:drafter=head:head_compute=int4", "head_compute must be one of int8, bfloat16, float32, got 'int4'"),
        ("sd:drafter=head:drafter_quant=int4", "option 'drafter_quant' needs a drafter model (a head has none)"),
        ("sd:drafter=lookup:stop=0.3", "option 'stop' needs a model drafter"),
        ("sd:drafter=hybrid:match=0", "match must be in 1..16, got 0"),
        ("sd:drafter=hybrid:copy=65", "copy must be in 1..64, got 65"),
        ("via-exact:pregate=0.5", "takes no option 'pregate'"),
        ("via:gamma=0", "gamma must be in 1..64, got 0"),
        ("sd:gamma=1000", "gamma must be in 1..64, got 1000"),
        ("via:gamma=two", "gamma must be an integer, got 'two'"),
        ("via:pregate=1.5", "pregate must be in [0, 1], got 1.5"),
        ("via:pregate=x", "pregate must be a number"),
        ("via:profile=", "profile needs a file path"),
        ("via:gamma=2:gamma=3", "sets 'gamma' twice"),
    ],
)
def test_bad_method_names_give_one_clear_error(text, message):
    with pytest.raises(ViasdError) as info:
        parse_method(text)
    assert message in str(info.value)


def test_method_lists_refuse_duplicates_and_emptiness():
    assert [s.name for s in parse_method_list("plain, sd ,sd:gamma=2,")] == ["plain", "sd", "sd:gamma=2"]
    with pytest.raises(ViasdError, match="named twice: sd"):
        parse_method_list("plain,sd,sd")
    with pytest.raises(ViasdError, match="no methods"):
        parse_method_list(" , ")


@pytest.mark.parametrize("gamma", [0, 1, MAX_GAMMA, MAX_GAMMA + 1])
def test_every_place_that_takes_a_draft_length_takes_the_same_ones(gamma):
    """A draft length the method option refuses, --gamma, a routing profile's file and calibrate's --gammas refuse
    too (one range, 1..MAX_GAMMA, one check), each in one line naming what the user gave."""
    from viasd.calibration.settings import CalibrationSettings
    from viasd.profile import RoutingProfile
    from viasd.verify.gates import Gate
    from viasd.views.layer_skip import LayerMask

    target = {"name": "t", "fingerprint": "f"}
    profile = RoutingProfile(target, None, [LayerMask.full(2)], [None], Gate("kl", (0.1, 1.0))).to_dict()
    takers = [
        ("method option gamma", lambda: parse_method(f"sd:gamma={gamma}")),
        ("--gamma", lambda: EngineSpec(gamma=gamma)),
        ("routing profile: the draft length gamma", lambda: RoutingProfile.from_dict({**profile, "gamma": gamma})),
        ("--gammas", lambda: CalibrationSettings(gammas=(gamma,)).check()),
    ]
    for name, take in takers:
        if 1 <= gamma <= MAX_GAMMA:
            take()
            continue
        with pytest.raises(ViasdError, match=rf"^{name} must be in 1\.\.{MAX_GAMMA}, got {gamma}$"):
            take()


def test_engine_builds_variants_with_their_settings_and_labels():
    tok = tiny_tokenizer(64)
    models = {"t": tiny_model("llama"), "d": tiny_model("llama", layers=2, seed=1)}
    engine = Engine(
        EngineSpec(target="t", drafter="d", gamma=5),
        target=LoadedModel(models["t"], tok, "t", "t"),
        drafter=LoadedModel(models["d"], tok, "d", "d"),
    )
    default, variant = engine.decoder("sd"), engine.decoder("sd:gamma=2")
    assert isinstance(variant, SpeculativeDecoder) and variant is not default
    assert (default.gamma, variant.gamma, variant.method) == (5, 2, "sd:gamma=2")
    assert engine.decoder("sd:gamma=2") is variant  # built once
    prompt = [1, 5, 9, 13]
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    out = engine.generate(prompt, "sd:gamma=2", config)
    assert out.stats.method == "sd:gamma=2" and out.stats.drafted > 0
    assert out.tokens == engine.generate(prompt, "plain", config).tokens  # a variant of an exact method stays exact


def test_a_method_parsed_at_the_edge_is_not_parsed_again(monkeypatch):
    """The CLI parses --method once, before loading models, and hands the engine that value: building, generating
    and describing (`--json`) use it, and its name finds the same decoder, without a second parse."""
    from viasd import engine as engine_module

    tok = tiny_tokenizer(64)
    engine = Engine(
        EngineSpec(target="t", drafter="d"),
        target=LoadedModel(tiny_model("llama"), tok, "t", "t"),
        drafter=LoadedModel(tiny_model("llama", layers=2, seed=1), tok, "d", "d"),
    )
    spec = parse_method("sd:gamma=2")

    def no_second_parse(text):
        raise AssertionError(f"{text!r} parsed again")

    monkeypatch.setattr(engine_module, "parse_method", no_second_parse)
    decoder = engine.decoder(spec)
    assert engine.decoder(" sd:gamma=2") is decoder and decoder.gamma == 2
    out = engine.generate([1, 5, 9], spec, GenerationConfig(max_new_tokens=4, ignore_eos=True))
    assert out.stats.method == "sd:gamma=2"
    described = engine.describe(spec)
    assert described["method"] == "sd:gamma=2" and described["exact"] and described["gamma"] == 2


def test_drafter_and_draft_length_options_build_what_they_say():
    tok = tiny_tokenizer(64)
    models = {"t": tiny_model("llama"), "d": tiny_model("llama", layers=2, seed=1)}
    engine = Engine(
        EngineSpec(target="t", drafter="d"),
        target=LoadedModel(models["t"], tok, "t", "t"),
        drafter=LoadedModel(models["d"], tok, "d", "d"),
    )
    sd = engine.decoder("sd")
    assert isinstance(sd.drafter, ModelDrafter) and sd.stop == DEFAULT_STOP
    assert engine.decoder("sd:stop=0").stop == 0.0 and engine.decoder("sd:stop=0.45").stop == 0.45
    hybrid = engine.decoder("sd:drafter=hybrid")
    assert isinstance(hybrid.drafter, HybridDrafter) and hybrid.stop == DEFAULT_STOP
    assert (hybrid.drafter.lookup.min_ngram, hybrid.drafter.lookup.copy) == (HYBRID_MATCH, None)
    assert hybrid.drafter.ratio == HYBRID_BUDGET and engine.decoder("sd:drafter=hybrid:budget=0").drafter.ratio == 0
    tuned = engine.decoder("sd:drafter=hybrid:match=4:copy=6:gamma=8:stop=0.3").drafter
    assert (tuned.lookup.min_ngram, tuned.lookup.max_ngram, tuned.lookup.copy) == (4, 4, 6)
    lookup = engine.decoder("sd:drafter=lookup")
    assert isinstance(lookup.drafter, PromptLookupDrafter) and not parse_method("sd:drafter=lookup").uses_drafter
    assert engine.decoder("lookup:match=2:copy=3").drafter.min_ngram == 2
    assert engine.decoder("lookup").drafter.min_ngram == 1  # prompt lookup as before unless asked
    assert engine.decoder("self:stop=0.5").stop == 0.5 and engine.decoder("self").stop == 0.0
    # Every variant stays exact: greedy output equals plain decoding's.
    prompt, config = [1, 5, 9, 13, 1, 5], GenerationConfig(max_new_tokens=24, ignore_eos=True)
    want = engine.generate(prompt, "plain", config).tokens
    variants = (
        "sd",
        "sd:stop=0.5",
        "sd:drafter=hybrid",
        "sd:drafter=hybrid:match=1:gamma=6:budget=0",
        "lookup:match=2",
    )
    for name in variants:
        out = engine.generate(prompt, name, config)
        assert out.tokens == want, name
        assert sum(s.drafted for s in out.stats.sources.values()) == out.stats.drafted


def test_self_drafting_skips_layers_even_when_the_profile_slims_by_quantization(tmp_path):
    """A profile whose slim view is a quantized copy has a full layer mask; `self` then drafts with a spread mask
    (skipping layers), not with the whole target, and stays exact. A profile mask that skips layers is used."""
    from viasd.models.fingerprint import model_fingerprint
    from viasd.profile import RoutingProfile, save_profile
    from viasd.verify.gates import Gate
    from viasd.views.layer_skip import LayerMask

    tok = tiny_tokenizer(64)
    target = tiny_model("llama", layers=4)
    fingerprint = {"name": "t", "fingerprint": model_fingerprint(target)}
    quantized, cut = tmp_path / "quantized.json", tmp_path / "cut.json"
    save_profile(RoutingProfile(fingerprint, None, [LayerMask.full(4)], ["int8"], Gate("kl", (0.1, 1.0))), quantized)
    save_profile(RoutingProfile(fingerprint, None, [LayerMask.skipping(4, [2])], [None], Gate("kl", (0.1, 1.0))), cut)
    loaded = LoadedModel(target, tok, "t", "t")
    engine = Engine(EngineSpec(target="t", drafter="d", profile=str(quantized)), target=loaded)
    mask = engine.self_mask()
    assert not mask.is_full and not all(mask.attention)
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    assert engine.generate([1, 5, 9], "self", config).tokens == engine.generate([1, 5, 9], "plain", config).tokens
    again = Engine(EngineSpec(target="t", drafter="d", profile=str(cut)), target=loaded)
    assert again.self_mask() == LayerMask.skipping(4, [2])


def test_self_and_via_share_the_routing_profile_the_engine_read(tmp_path, monkeypatch):
    """An engine reads its routing profile once, whichever of `self` (its mask) and `via` needs it first: both then
    run on the same profile, and a server that builds both reads the file once."""
    from viasd import profile as profile_module
    from viasd.models.fingerprint import model_fingerprint
    from viasd.profile import RoutingProfile, save_profile
    from viasd.verify.gates import Gate
    from viasd.views.layer_skip import LayerMask

    tok = tiny_tokenizer(64)
    target, drafter = tiny_model("llama", layers=4), tiny_model("llama", layers=2, seed=1)
    entry = {"name": "t", "fingerprint": model_fingerprint(target)}
    path = tmp_path / "cut.json"
    save_profile(RoutingProfile(entry, None, [LayerMask.skipping(4, [2])], [None], Gate("kl", (0.1, 1.0))), path)
    reads = []
    real = profile_module.load_profile
    monkeypatch.setattr(profile_module, "load_profile", lambda p: reads.append(p) or real(p))
    engine = Engine(
        EngineSpec(target="t", drafter="d", profile=str(path)),
        target=LoadedModel(target, tok, "t", "t"),
        drafter=LoadedModel(drafter, tok, "d", "d"),
    )
    assert engine.self_mask() == LayerMask.skipping(4, [2])
    assert engine.decoder("via").slims[0].mask == engine.self_mask() and engine.decoder("self")
    assert engine.routing_profile() is engine.routing_profile(str(path)) and reads == [str(path)]


def test_via_drafting_without_the_small_model_never_loads_it_and_checks_it_where_it_drafts(tmp_path, monkeypatch):
    """`via-exact:drafter=lookup` runs with no drafter model (none is loaded for the profile's check); `via-exact`,
    which drafts with it, loads it and refuses one the profile was not calibrated with."""
    from viasd.models.fingerprint import model_fingerprint
    from viasd.profile import RoutingProfile, save_profile
    from viasd.verify.gates import Gate
    from viasd.views.layer_skip import LayerMask

    tok = tiny_tokenizer(64)
    target, drafter = tiny_model("llama", layers=4), tiny_model("llama", layers=2, seed=1)
    entry = {"name": "t", "fingerprint": model_fingerprint(target)}
    path = tmp_path / "cut.json"
    other = {"name": "d", "fingerprint": "0" * 16}  # calibrated with another drafter
    save_profile(RoutingProfile(entry, other, [LayerMask.skipping(4, [2])], [None], Gate("kl", (0.1, 1.0))), path)
    engine = Engine(EngineSpec(target="t", drafter="d", profile=str(path)), target=LoadedModel(target, tok, "t", "t"))
    loads = []
    monkeypatch.setattr(Engine, "_load", lambda self, name: loads.append(name) or LoadedModel(drafter, tok, "d", "d"))
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    prompt = [1, 5, 9, 1, 5]
    out = engine.generate(prompt, "via-exact:drafter=lookup", config)
    assert out.tokens == engine.generate(prompt, "plain", config).tokens and loads == []
    with pytest.raises(ViasdError, match="calibrated with drafter 'd', not this drafter"):
        engine.decoder("via-exact")
    assert loads == ["d"]


@pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines, reason="torch's int8 CPU kernel")
def test_making_a_view_is_setup_time_never_a_generations(tmp_path, monkeypatch):
    """A view's copies are loaded and put in their kernel's form when the method is built (and reported as setup
    seconds), so a generation's seconds are decoding only: torch's int8 kernel packs no weight during it."""
    from viasd.views.linears import Int8DynamicLinear

    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path))
    target = LoadedModel(tiny_model("qwen2", dtype=torch.float32), tiny_tokenizer(64), "t", "t")
    engine = Engine(EngineSpec(target="t"), target=target)
    decoder = engine.decoder("plain:quant=int8")
    packed_while_decoding = []
    real = Int8DynamicLinear._fbgemm_packed

    def watched(self):
        if self._packed is None:
            packed_while_decoding.append(self)
        return real(self)

    monkeypatch.setattr(Int8DynamicLinear, "_fbgemm_packed", watched)
    result = decoder.generate([3, 4, 5, 6], GenerationConfig(max_new_tokens=4, ignore_eos=True))
    assert result.stats.new_tokens == 4 and packed_while_decoding == []
    assert engine.describe("plain:quant=int8")["setup_seconds"]["view t int8"] > 0
