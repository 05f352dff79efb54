"""A streamed output split into content and tool calls as it comes: content is passed on until a call starts; from
there the text is held and parsed when the output ends, so each call is sent whole (its arguments in one delta).
An output that opens as a bare call may be (a JSON object or list, or a code fence around one) is held whole."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from viasd.toolcalls.formats import ParsedOutput, ToolCallFormat


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (so cannot be sent yet)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ToolCallStream:
    """Feed it the output's pieces in order; it answers the content that is safe to send, and at the end the rest."""

    format: ToolCallFormat
    names: Collection[str]
    _sent: list[str] = field(default_factory=list)  # content already given out
    _held: str = ""  # text not given out yet: a possible marker's start, or everything from a call on
    _calling: bool = False  # a call's start marker has been seen, or the output opens as a bare call
    _opening: bool = True  # too little has come to tell whether the output opens as a bare call

    def feed(self, piece: str) -> str:
        """The content that `piece` lets out now (maybe empty)."""
        self._held += piece
        if self._calling:
            return ""
        if self._opening:
            verdict = self.format.opens_bare_call(self._held)
            if verdict is None:
                return ""
            self._opening, self._calling = False, verdict
            if verdict:
                return ""
        found = self._held.find(self.format.start)
        if found >= 0:
            self._calling = True
            out, self._held = self._held[:found], self._held[found:]
        else:
            keep = _held_back(self._held, self.format.start)
            out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        self._sent.append(out)
        return out

    def finish(self) -> tuple[str, ParsedOutput]:
        """At the output's end: the content still to send, and the whole output parsed (as a non-streamed answer
        would parse it)."""
        sent = "".join(self._sent)
        parsed = self.format.parse(sent + self._held, self.names)
        if not parsed.calls:
            return self._held, parsed
        # With calls, the content before the first was sent as it came; what is left is any text after them.
        return (parsed.content or "")[len(sent) :], parsed
