"""Reading JSON that users hand in (profiles, questions, a run's records): every fault is one `JSONFault` line.

`json.loads` fails in four ways besides bad syntax: bytes that are not UTF-8, nesting past the interpreter's
recursion limit (RecursionError), and an integer longer than CPython's limit on converting text to integers
(`sys.get_int_max_str_digits()`, 4300 digits by default: a plain ValueError whose message points at a Python
setting). The limit is kept, as CPython sets it against quadratic-time parsing; only the fault is made one line.
"""

from __future__ import annotations

import json
import sys
from typing import Any


class JSONFault(ValueError):
    """JSON text that cannot be read; the message says why in one line, fit to follow a file name and a colon."""


def parse_json(text: str | bytes) -> Any:
    """The value of JSON `text`, or a JSONFault saying in one line why there is none."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise JSONFault(f"not JSON ({error.msg}: line {error.lineno} column {error.colno})") from None
    except UnicodeDecodeError as error:
        raise JSONFault(f"not UTF-8 text (byte {error.object[error.start]:#04x} at {error.start})") from None
    except RecursionError:
        raise JSONFault("JSON nested deeper than the parser can read") from None
    except ValueError as error:
        if "integer string conversion" not in str(error):
            raise JSONFault(f"not JSON ({error})") from None
        limit = sys.get_int_max_str_digits()
        raise JSONFault(f"an integer longer than {limit} digits (the most Python reads from text)") from None
