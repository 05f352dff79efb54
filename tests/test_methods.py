"""The method registry: names and variants (`via:gamma=4:pregate=0.5`), parsing, errors, and that variants build
what they say."""

import pytest

from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.round import MAX_GAMMA
from viasd.decode.speculative import SpeculativeDecoder
from viasd.engine import Engine, EngineSpec
from viasd.errors import ViasdError
from viasd.methods import MAX_GAMMA as PARSED_MAX_GAMMA
from viasd.methods import METHODS, OPTIONS, parse_method, parse_method_list
from viasd.models.loading import LoadedModel


def test_plain_names_and_variants_parse():
    assert all(parse_method(name).base == name for name in METHODS)
    spec = parse_method(" via:gamma=3:cap=12:pregate=0.4:profile=my.json ")
    assert (spec.name, spec.base) == ("via:gamma=3:cap=12:pregate=0.4:profile=my.json", "via")
    assert dict(spec.options) == {"gamma": 3, "cap": 12, "pregate": 0.4, "profile": "my.json"}
    assert parse_method("sd:gamma=6").get("gamma") == 6 and parse_method("sd").get("gamma") is None
    assert not parse_method("lookup").uses_drafter and parse_method("hf-assisted:gamma=2").uses_drafter
    # Every method's options are registered options, and the relaxed method says so.
    assert all(set(m.options) <= set(OPTIONS) for m in METHODS.values())
    assert [m.name for m in METHODS.values() if not m.exact] == ["via", "llama.cpp"]  # relaxed; another runtime
    assert PARSED_MAX_GAMMA == MAX_GAMMA


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("warp", "unknown method 'warp'"),
        ("sd:gamma", "write key=value"),
        ("sd:depth=3", "write key=value with key one of gamma, cap, profile, pregate, quant, drafter_quant"),
        ("sd:cap=4", "method 'sd' takes no option 'cap' (it takes: gamma, quant, drafter_quant)"),
        ("plain:gamma=2", "takes no option 'gamma' (it takes: quant)"),
        ("plain:quant=int3", "method option quant: unknown quantization 'int3'"),
        ("hf-assisted:quant=int8", "takes no option 'quant'"),
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
