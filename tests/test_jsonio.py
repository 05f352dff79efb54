"""The one JSON reader for user files: each way `json.loads` fails is one JSONFault line, and CPython's own limits
(4300 digits for an integer read from text, the recursion limit for nesting) are kept, not raised."""

from __future__ import annotations

import sys

import pytest

from viasd.jsonio import JSONFault, parse_json


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"n": ' + "9" * 4301 + "}", f"an integer longer than {sys.get_int_max_str_digits()} digits"),
        ("[" + "-" + "1" * 100_000 + "]", "an integer longer than"),
        ("[" * 100_000, "JSON nested deeper than the parser can read"),
        (b'{"a": "\xff"}', "not UTF-8 text (byte 0xff at 7)"),
        ('{"a": 1,}', "not JSON (Expecting property name enclosed in double quotes: line 1 column 9)"),
    ],
)
def test_every_fault_is_one_jsonfault_line(text: str | bytes, reason: str) -> None:
    with pytest.raises(JSONFault) as caught:
        parse_json(text)
    message = str(caught.value)
    assert message.startswith(reason) and "\n" not in message and "set_int_max_str_digits" not in message


def test_values_within_cpythons_limits_read_as_json_loads_reads_them() -> None:
    assert parse_json('{"n": ' + "9" * 4300 + "}") == {"n": int("9" * 4300)}
    assert parse_json(b'[1.5e308, 1e999, "caf\xc3\xa9"]') == [1.5e308, float("inf"), "café"]
