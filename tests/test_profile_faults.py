"""Routing profiles are input: each field is checked by type and range before anything is built from it, a huge or
deeply nested file is refused before it is parsed deeply, and every fault is one ViasdError line (exit code 2)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from viasd.cli import app
from viasd.errors import ViasdError
from viasd.profile import RoutingProfile, load_profile
from viasd.verify.gates import Gate
from viasd.views.layer_skip import LayerMask


def _valid() -> dict[str, Any]:
    return RoutingProfile(
        target={"name": "t", "fingerprint": "x"},
        drafter={"name": "d", "fingerprint": "y", "quant": "int4"},
        masks=[LayerMask.skipping(4, [2])],
        quant=["int8"],
        gate=Gate("kl", (0.05, 1.0)),
    ).to_dict()


CODE_POLICY = {"gate": {"signal": "kl", "thresholds": [0.0, 0.5]}, "gamma": 3, "cap": 8, "pregate": 0.7, "stop": 0.3}


def test_a_kinds_own_policy_round_trips_and_the_rest_keep_the_profiles(tmp_path: Path) -> None:
    profile = load_profile(_write(tmp_path, {**_valid(), "kinds": {"code": CODE_POLICY}}))
    code, prose = profile.policy("code"), profile.policy("prose")
    assert (code.gate.thresholds, code.gamma, code.cap, code.pregate, code.stop) == ((0.0, 0.5), 3, 8, 0.7, 0.3)
    assert prose == profile.policy() and prose.gate.thresholds == (0.05, 1.0)
    assert profile.policy("code", gamma=5).gamma == 5 and list(profile.policies()) == ["code"]
    again = load_profile(_write(tmp_path, profile.to_dict()))
    assert again.policy("code") == code and "kinds" not in RoutingProfile.from_dict(_valid()).to_dict()


def test_a_kind_may_name_its_own_slim_view_and_the_others_keep_the_profiles(tmp_path: Path) -> None:
    own = {**CODE_POLICY, "quant": ["int4a8:gguf"]}
    profile = load_profile(_write(tmp_path, {**_valid(), "kinds": {"code": own}}))
    assert profile.slim_quant(0, "code").name == "int4a8:gguf" and profile.slim_quant(0, "code").gguf
    assert profile.slim_quant(0, "prose").name == "int8" and profile.slim_quant(0).name == "int8"
    assert profile.own_views() == ["code"]
    again = load_profile(_write(tmp_path, profile.to_dict()))
    assert again.to_dict()["kinds"]["code"]["quant"] == ["int4a8:gguf"] and again.policy("code") == profile.policy(
        "code"
    )
    assert load_profile(_write(tmp_path, {**_valid(), "kinds": {"code": CODE_POLICY}})).own_views() == []


def test_a_kind_whose_policy_is_exact_says_so_in_one_word_and_round_trips(tmp_path: Path) -> None:
    """`"gate": "exact"` in a file sends every drafted token of that kind to the full target (its one threshold, -inf,
    is not JSON); an infinite or other word is still refused."""
    exact = {**CODE_POLICY, "gate": "exact"}
    profile = load_profile(_write(tmp_path, {**_valid(), "kinds": {"code": exact}}))
    assert profile.policy("code").gate.always_full and not profile.policy("prose").gate.always_full
    assert profile.to_dict()["kinds"]["code"]["gate"] == "exact"
    assert load_profile(_write(tmp_path, profile.to_dict())).policy("code") == profile.policy("code")
    for bad in ("lenient", {"signal": "kl", "thresholds": [float("-inf")]}):
        with pytest.raises(ViasdError, match="routing profile"):
            load_profile(_write(tmp_path, {**_valid(), "kinds": {"code": {**CODE_POLICY, "gate": bad}}}))


def _write(tmp_path: Path, data: dict[str, Any] | str) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data, allow_nan=True))
    return path


def _refused(path: Path) -> str:
    with pytest.raises(ViasdError) as caught:
        load_profile(path)
    message = str(caught.value)
    assert "\n" not in message and len(message) < 300, message
    return message


def test_the_valid_profile_loads(tmp_path: Path) -> None:
    profile = load_profile(_write(tmp_path, _valid()))
    assert profile.gate.thresholds == (0.05, 1.0) and [q.name for q in profile.quant if q] == ["int8"]


def test_a_huge_file_is_refused_by_its_size_before_it_is_parsed(tmp_path: Path) -> None:
    """A valid profile padded to 50 MB: refused by its size alone, without reading it all."""
    text = json.dumps(_valid())
    path = _write(tmp_path, text[:-1] + " " * (50 * 1024 * 1024) + "}")
    started = time.perf_counter()
    assert "larger than 4 MiB" in _refused(path)
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deeply_nested_json_is_refused_in_one_line(tmp_path: Path, depth: int) -> None:
    """Nesting past the parser's recursion limit (RecursionError) or past the profile's own bound."""
    data = _valid()
    text = json.dumps(data)[:-1] + ', "calibration": ' + '{"a": ' * depth + "1" + "}" * depth + "}"
    assert "nested deeper than" in _refused(_write(tmp_path, text))


@pytest.mark.parametrize("where", ["gamma", "calibration"])
def test_an_integer_past_pythons_digit_limit_is_one_line(tmp_path: Path, where: str) -> None:
    """CPython refuses to read integers of more than 4300 digits (a ValueError of its own, not a JSON error)."""
    text = json.dumps({**_valid(), where: 0}).replace(f'"{where}": 0', f'"{where}": {"9" * 5000}')
    assert "an integer longer than 4300 digits" in _refused(_write(tmp_path, text))
    result = CliRunner().invoke(app, ["calibrate", "--reselect", str(tmp_path / "profile.json")])
    assert result.exit_code == 2 and "an integer longer than 4300 digits" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quant": "int8"}, "quant must be a list, got 'int8'"),  # was read letter by letter
        ({"quant": 5}, "quant must be a list"),
        ({"quant": [5]}, "a quantization must be a recipe name"),
        ({"drafter": {"name": "d", "fingerprint": "y", "quant": 8}}, "a quantization must be a recipe name"),
        ({"drafter": {"name": "d", "fingerprint": "y", "self": "yes"}}, "drafter.self must be true or false"),
        ({"target": "t"}, "target must be a JSON object"),
        ({"target": {"name": "t", "fingerprint": 7}}, "target.fingerprint must be text"),
        ({"masks": {"num_layers": 4}}, "masks must be a list"),
        ({"masks": [{"num_layers": 10**12}]}, "masks[0].num_layers must be in 1..4096"),
        ({"masks": [{"num_layers": 5000}]}, "masks[0].num_layers must be in 1..4096"),
        ({"masks": [{"num_layers": "4"}]}, "masks[0].num_layers must be an integer"),
        ({"masks": [{"num_layers": 4, "skip_layers": [1] * 5000}]}, "skip_layers lists 5000 layers of 4"),
        ({"masks": [{"num_layers": 4, "skip_mlp": "12"}]}, "skip_mlp must be a list"),
        ({"masks": [{"num_layers": 4}, {"num_layers": 6}], "quant": []}, "masks are of different layer counts"),
        ({"gate": {"signal": "kl", "thresholds": [float("inf"), float("inf")]}}, "thresholds must be finite"),
        ({"gate": {"signal": "kl", "thresholds": [0.05, float("inf")]}}, "thresholds must be finite"),
        ({"gate": {"signal": "kl", "thresholds": [-float("inf"), 1.0]}}, "thresholds must be finite"),
        ({"gate": {"signal": "kl", "thresholds": [-5.0, 1.0]}}, "thresholds must be finite numbers >= -1"),
        ({"gate": {"signal": "kl", "thresholds": ["0.05", "1"]}}, "gate thresholds must be numbers"),
        ({"gate": {"signal": "kl", "thresholds": [True, 1.0]}}, "gate thresholds must be numbers"),
        ({"gate": {"signal": "kl", "thresholds": "0.05"}}, "gate.thresholds must be a list"),
        ({"gate": [0.05, 1.0]}, "gate must be a JSON object"),
        ({"gamma": "4"}, "gamma must be an integer"),
        ({"gamma": True}, "gamma must be an integer"),
        ({"gamma": 0}, "gamma must be in 1..64"),
        ({"cap": 10**30}, "cap on tokens committed without the full target must be in 1..1048576"),
        ({"cap": 10**400}, "cap on tokens committed without the full target must be in 1..1048576"),
        ({"cap": float("inf")}, "cap on tokens committed without the full target must be an integer"),
        ({"pregate": "0.5"}, "pre-gate must be a probability in [0, 1]"),
        ({"pregate": True}, "pre-gate must be a probability in [0, 1]"),
        ({"stop": float("inf")}, "draft stop threshold must be a probability in [0, 1]"),
        ({"stop": 10**400}, "draft stop threshold must be a probability in [0, 1]"),
        ({"search": [1, 2]}, "search must be a JSON object"),
        ({"kinds": [1]}, "kinds must be a JSON object"),
        ({"kinds": {"sql": {}}}, "unknown task kind 'sql' in kinds; known: code, prose"),
        ({"kinds": {"code": {**CODE_POLICY, "gamma": 0}}}, "kinds.code.gamma must be in 1..64"),
        ({"kinds": {"code": {**CODE_POLICY, "pregate": 2}}}, "kinds.code.pregate must be a probability"),
        ({"kinds": {"code": {**CODE_POLICY, "gate": None}}}, "kinds.code.gate must be a JSON object"),
        ({"kinds": {"code": {**CODE_POLICY, "gate": {"signal": "kl", "thresholds": [0.1]}}}}, "need 2 gate thresholds"),
        ({"kinds": {"code": {**CODE_POLICY, "quant": "int8"}}}, "kinds.code.quant must be a list"),
        ({"kinds": {"code": {**CODE_POLICY, "quant": ["int8", "int8"]}}}, "kinds.code.quant has 2 entries for 1"),
        ({"kinds": {"code": {**CODE_POLICY, "quant": ["int3"]}}}, "unknown quantization 'int3'"),
        ({"created": 20261202}, "created must be text"),
    ],
)
def test_a_field_of_the_wrong_type_or_out_of_range_is_one_line(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    data = {**_valid(), **change}
    assert message in _refused(_write(tmp_path, data))


def test_calibrations_own_markers_still_load(tmp_path: Path) -> None:
    """Calibration writes -1 for 'no accept tier' and 1e9 for 'only the cap sends tokens to the full target'."""
    data = {**_valid(), "gate": {"signal": "confidence", "thresholds": [-1.0, 1e9]}}
    assert load_profile(_write(tmp_path, data)).gate.thresholds == (-1.0, 1e9)


def test_the_cli_turns_a_bad_profile_into_exit_code_2(tmp_path: Path) -> None:
    path = _write(tmp_path, {**_valid(), "quant": "int8"})
    result = CliRunner().invoke(app, ["calibrate", "--reselect", str(path)])
    assert result.exit_code == 2 and "quant must be a list" in result.output, result.output
    assert "Traceback" not in result.output
