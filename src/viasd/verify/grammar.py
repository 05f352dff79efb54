"""Structured output: a grammar (a JSON schema, compiled by llguidance) that masks every model's rows, so that only
text it accepts can be generated.

Like the penalties (verify/penalties.py), the mask of a row depends on the tokens before its position: each row is
masked under the grammar's state after the committed output and the drafts before it, for the drafter, the slim
views and the target alike. Greedy speculative decoding under a grammar therefore gives plain greedy decoding's
tokens under it, and speculative sampling follows the target's distribution restricted to what the grammar allows.
End tokens (EOS, stop tokens) are allowed exactly where the grammar accepts.

A generation binds its own matcher (`Grammar.bound`). The matcher follows whichever token sequence it was last asked
about: committing tokens advances it, and a rejected block rolls it back to the longest common prefix.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch

from viasd.errors import ViasdError
from viasd.verify.schema_ends import endless_reference

if TYPE_CHECKING:  # llguidance is imported where a grammar is built: generations without one never load it
    from llguidance import LLTokenizer
    from transformers import PreTrainedTokenizerBase

# JSON's layout under a schema: one space after ',' and ':', no other whitespace (a schema's "x-guidance" entry may
# say otherwise). Free whitespace would let a model pad its output with blanks and never close the object.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Keeps the library quiet: a schema it cannot compile is reported to the user as one line instead.
_SILENT = 0


def grammar_tokenizer(
    tokenizer: PreTrainedTokenizerBase, eos_ids: Collection[int], vocab_size: int | None = None
) -> LLTokenizer:
    """The tokenizer as llguidance reads it (building it takes about a second for a large vocabulary: keep it).

    eos_ids: the tokens that end a generation; vocab_size: the model's logits width when it exceeds the tokenizer's.
    """
    from llguidance.hf import from_tokenizer

    if not getattr(tokenizer, "is_fast", False):
        raise ViasdError("structured output needs a fast (Rust) Hugging Face tokenizer")
    width = max(len(tokenizer), vocab_size or 0)
    try:
        return from_tokenizer(tokenizer, n_vocab=width, eos_token=sorted(eos_ids) or None)  # type: ignore[arg-type]
    except (ValueError, RuntimeError) as error:
        raise ViasdError(f"structured output cannot read this tokenizer: {error}") from error


class Grammar:
    """A compiled grammar over a tokenizer; `bound` gives the matcher one generation follows.

    Compiling checks the grammar: a schema the library cannot compile, one whose output could never end
    (verify/schema_ends.py), and a grammar that allows no first token are refused in one line (ViasdError), so a
    generation under it never meets a dead end.
    """

    def __init__(self, tokenizer: LLTokenizer, source: str, what: str = "the grammar") -> None:
        from llguidance import LLMatcher

        initial = LLMatcher(tokenizer, source, log_level=_SILENT)
        if initial.is_error():
            raise ViasdError(f"{what} cannot be compiled: {_first_line(initial.get_error())}")
        if not initial.is_accepting() and not _writable(initial, tokenizer):
            raise ViasdError(f"{what} allows no output: no token can begin it")
        self.tokenizer = tokenizer
        self.what = what
        self._initial = initial
        self._matcher = initial
        self._consumed: list[int] = []
        self._prompt_length = 0
        self._ends: frozenset[int] = frozenset()

    @classmethod
    def json_schema(cls, tokenizer: LLTokenizer, schema: dict[str, Any] | None, what: str = "the schema") -> Grammar:
        """JSON text that validates against `schema` (None: any JSON object)."""
        from llguidance import LLMatcher

        try:
            text = json.dumps({"type": "object"} if schema is None else schema)
            endless = endless_reference(schema)
            source = LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT)
        except (ValueError, TypeError) as error:
            raise ViasdError(f"{what} cannot be compiled: {_first_line(str(error))}") from error
        except RecursionError:
            raise ViasdError(f"{what} cannot be compiled: it is nested too deeply") from None
        if endless is not None:
            where = "the schema" if endless == "#" else endless
            raise ViasdError(
                f"{what} cannot terminate: {where} leads back to itself without end, so no finite JSON value "
                "satisfies it and the output could never end"
            )
        return cls(tokenizer, source, what)

    def bound(self, prompt_length: int, ends: frozenset[int]) -> Grammar:
        """A fresh matcher for one generation: where its output starts in a context, and its end tokens."""
        fresh = Grammar.__new__(Grammar)
        fresh.tokenizer, fresh.what, fresh._initial = self.tokenizer, self.what, self._initial
        fresh._matcher = self._initial.deep_copy()
        fresh._consumed = []
        fresh._prompt_length = prompt_length
        fresh._ends = frozenset(ends)
        return fresh

    def masks(self, context: Sequence[int], drafts: Sequence[int], rows: int, width: int) -> torch.Tensor:
        """Which tokens each of `rows` rows allows, [rows, width] bool, rows placed as `penalties.penalised` places
        them: row i follows context + drafts[: len(drafts) - (rows - 1 - i)].

        A row behind a draft the grammar forbids (or behind an end token) allows everything: verification never
        reaches it, since the forbidden draft has no probability under the masked row before it.
        """
        if len(drafts) < rows - 1:
            raise ValueError(f"{rows} rows need at least {rows - 1} drafts before them, got {len(drafts)}")
        output = [*context[self._prompt_length :], *drafts[: len(drafts) - (rows - 1)]]
        tail = drafts[len(drafts) - (rows - 1) :]
        out = torch.ones(rows, width, dtype=torch.bool)
        if self._follow(output) < len(output):
            if self._follow(context[self._prompt_length :]) < len(context) - self._prompt_length:
                raise ViasdError(f"the committed output left {self.what} (a decoder skipped the grammar's mask)")
            return out
        for i in range(rows):
            out[i] = self._mask(width)
            if i + 1 < rows and not self._advance(int(tail[i])):
                break
        return out

    def allowed_length(self, context: Sequence[int], drafts: Sequence[int]) -> int:
        """How many leading drafts the grammar allows after `context` (an end token counts where it accepts)."""
        output = list(context[self._prompt_length :])
        kept = self._follow([*output, *drafts]) - len(output)
        if kept < 0:
            raise ViasdError(f"the committed output left {self.what} (a decoder skipped the grammar's mask)")
        if kept < len(drafts) and int(drafts[kept]) in self._ends and self._matcher.is_accepting():
            kept += 1
        return kept

    def forced(self, context: Sequence[int]) -> list[int]:
        """The tokens that spell the text the grammar forces next after `context` (a JSON key and its quotes and
        colon, say), as the library tokenizes it; none where the output is complete or off the grammar. They are
        drafts, not commitments: a model may spell forced text with other tokens, and verification decides."""
        output = list(context[self._prompt_length :])
        if self._follow(output) < len(output) or self._matcher.is_stopped():
            return []
        forced = []
        for token in self._matcher.compute_ff_tokens():
            if int(token) in self._ends:
                break
            forced.append(int(token))
        return forced

    def _follow(self, tokens: Sequence[int]) -> int:
        """Move the matcher to the state after `tokens`, rolling back what differs; returns how many leading tokens
        it holds (fewer than all where one is forbidden or ends the generation)."""
        same = 0
        for held, token in zip(self._consumed, tokens, strict=False):
            if held != token:
                break
            same += 1
        if same < len(self._consumed):
            if not self._matcher.rollback(len(self._consumed) - same):
                self._matcher = self._initial.deep_copy()  # past what the library keeps: replayed from the start
                self._matcher.consume_tokens(self._consumed[:same])
            del self._consumed[same:]
        for token in tokens[same:]:
            if not self._advance(int(token)):
                break
        return len(self._consumed)

    def _advance(self, token: int) -> bool:
        """Consume one token if the grammar allows it (an end token never is: nothing follows it)."""
        if token in self._ends or self._matcher.validate_tokens([token]) != 1:
            return False
        if not self._matcher.consume_token(token):
            raise ViasdError(f"{self.what}: {_first_line(self._matcher.get_error())}")
        self._consumed.append(token)
        return True

    def _mask(self, width: int) -> torch.Tensor:
        """The tokens allowed next, [width] bool; end tokens exactly where the grammar accepts."""
        if self._matcher.is_error():
            raise ViasdError(f"{self.what}: {_first_line(self._matcher.get_error())}")
        words = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.int32)
        bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = torch.zeros(max(width, bits.numel()), dtype=torch.bool)
        allowed[: bits.numel()] = bits.reshape(-1).bool()
        allowed = allowed[:width]
        ends = [t for t in self._ends if t < width]
        if ends:
            allowed[ends] = self._matcher.is_accepting()
        if not allowed.any():  # a dead end the checks at compile time could not see: said so, never sampled past
            raise ViasdError(f"{self.what} allows no token after the output so far, and no end there")
        return allowed


def constrained(
    logits: torch.Tensor, grammar: Grammar | None, context: Sequence[int], drafts: Sequence[int] | torch.Tensor = ()
) -> torch.Tensor:
    """`logits` [n, V] with the tokens the grammar forbids at each row's position set to -inf (rows placed as
    `penalties.penalised` places them). No grammar returns `logits`; drafts on a device are read to the host."""
    if grammar is None:
        return logits
    tokens = drafts.reshape(-1).tolist() if isinstance(drafts, torch.Tensor) else list(drafts)
    allowed = grammar.masks(context, tokens, logits.shape[0], logits.shape[1]).to(logits.device)
    return logits.float().masked_fill(~allowed, float("-inf"))


def _writable(matcher: Any, tokenizer: LLTokenizer) -> bool:
    """Whether the matcher's state allows a token other than an end token (in its state before any output: whether
    the grammar's language holds any text at all)."""
    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    allowed = ((words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1).bool()
    allowed[[t for t in tokenizer.eos_tokens if t < len(allowed)]] = False
    return bool(allowed.any())


def _first_line(message: str) -> str:
    return (message.strip().splitlines() or ["unknown error"])[0]
