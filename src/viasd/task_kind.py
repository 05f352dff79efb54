"""Task kinds: whether a request asks for code or for prose, read from its prompt.

VIA-SD's relaxed tiers commit tokens the full target never checks. In prose a token the target would not have
chosen rarely changes what the answer says; in code one can break the program. A routing profile may therefore
hold a stricter round policy for code (`kinds` in the profile), and `via` picks it per request by this module's
reading of the prompt. The reading leans towards "code": a prose prompt read as code only costs speed, a code
prompt read as prose can cost correctness.
"""

from __future__ import annotations

import re

from viasd.errors import ViasdError

CODE = "code"
PROSE = "prose"
TASK_KINDS = (CODE, PROSE)
AUTO = "auto"  # read the kind from the prompt

# A code block, or a line that starts like source code does in the languages people ask for most.
_CODE_LINE = re.compile(
    r"```|^[ \t]*(def |class |import |from [\w.]+ import |#include|function |public |package |fn |SELECT |"
    r"CREATE TABLE |#!/)",
    re.MULTILINE,
)
# Words that ask for code, looked for where a request's instruction sits (its first and last EDGE characters), not in
# the middle of a long document the prompt quotes (a news story about a TV program, a passage on cell functions).
# "function" stays (maths prompts read as code, which only costs speed), "class" and "method" do not.
_CODE_WORD = re.compile(
    r"\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|kotlin|swift|sql|bash|shell|powershell|html|css|"
    r"regex|code|coding|function|functions|program|programming|script|implement|implementation|algorithm|"
    r"compile|compiler|debug|api|json|yaml)\b",
    re.IGNORECASE,
)
EDGE = 400


def prompt_kind(text: str) -> str:
    """`code` when the prompt contains source code or asks for it, else `prose`."""
    asks = _CODE_WORD.search(text[:EDGE]) or _CODE_WORD.search(text[-EDGE:])
    return CODE if asks or _CODE_LINE.search(text) else PROSE


def parse_kind(value: str) -> str | None:
    """A task kind as given by a user: `code`, `prose`, or `auto` (None: read it from the prompt)."""
    if value == AUTO:
        return None
    if value not in TASK_KINDS:
        raise ViasdError(f"unknown task kind {value!r}; choose one of {', '.join((AUTO, *TASK_KINDS))}")
    return value
