"""Structured output on the server: a request's response_format (or vLLM's guided_json / structured_outputs.json)
as a compiled grammar, refused with a 400 naming the parameter when it cannot be compiled, cannot terminate, or is
not compiled within COMPILE_SECONDS. Grammars compile on workers of their own (app.py), never the tokenizer's: a slow
schema holds up no /tokenize and no prompt's encoding."""

from __future__ import annotations

import json
import threading
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from viasd.errors import ViasdError
from viasd.serve.errors import APIError
from viasd.serve.tools import forced_call_schema
from viasd.verify.grammar import Grammar, grammar_tokenizer

if TYPE_CHECKING:
    from llguidance import LLTokenizer
    from transformers import PreTrainedTokenizerBase

    from viasd.serve.schemas import ChatCompletionRequest, CompletionRequest

COMPILE_SECONDS = 10.0  # the most a request's schema may take to be compiled, its wait for a worker included
COMPILE_WORKERS = 2  # grammars compiled at once (the library lets go of the GIL while it compiles)


class GrammarTokenizer:
    """The target's tokenizer as the grammar library reads it, built on the first structured request (about a second
    for a large vocabulary) and kept for the server's life."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_ids: Collection[int], vocab_size: int) -> None:
        self._source = (tokenizer, frozenset(eos_ids), vocab_size)
        self._built: LLTokenizer | None = None
        self._lock = threading.Lock()

    def get(self) -> LLTokenizer:
        with self._lock:
            if self._built is None:
                self._built = grammar_tokenizer(*self._source)
            return self._built


def requested_schema(req: ChatCompletionRequest | CompletionRequest) -> tuple[str, dict[str, Any] | None] | None:
    """Which parameter asks for structured output, and its JSON schema (None: any JSON object); None if none does."""
    asked: list[tuple[str, dict[str, Any] | None]] = []
    fmt = req.response_format or {}
    if fmt.get("type") == "json_object":
        asked.append(("response_format", None))
    elif fmt.get("type") == "json_schema":
        asked.append(("response_format", fmt["json_schema"].get("schema", {})))
    if req.guided_json is not None:
        asked.append(("guided_json", _schema_value(req.guided_json, "guided_json")))
    if req.structured_outputs is not None:
        asked.append(("structured_outputs", _structured_outputs(req.structured_outputs)))
    forced = forced_call_schema(getattr(req, "tools", None), getattr(req, "tool_choice", None))
    if forced is not None:  # a chat request whose tool_choice forces a call
        asked.append(("tool_choice", forced))
    if len(asked) > 1:
        names = " and ".join(name for name, _ in asked)
        raise APIError(400, f"{names} both ask for structured output; give one", param=asked[1][0])
    return asked[0] if asked else None


def request_grammar(req: ChatCompletionRequest | CompletionRequest, tokenizer: GrammarTokenizer) -> Grammar | None:
    """The grammar the request's output must follow (None: free text); a schema that cannot be compiled is a 400
    naming the parameter."""
    asked = requested_schema(req)
    if asked is None:
        return None
    name, schema = asked
    what, param = schema_source(name)
    try:
        return Grammar.json_schema(tokenizer.get(), schema, what=what)
    except ViasdError as error:
        raise APIError(400, str(error), code="invalid_schema", param=param) from error


def schema_source(name: str) -> tuple[str, str]:
    """What a refusal calls the schema the parameter `name` asks for, and the parameter it names."""
    # A forced call's schema is made of the tools' parameters: where it cannot be compiled, they are at fault.
    return ("the tools' parameters", "tools") if name == "tool_choice" else (f"{name}'s JSON schema", name)


def compile_too_slow(name: str) -> APIError:
    """The 400 of a schema not compiled within COMPILE_SECONDS (its compilation goes on, bounded by the library)."""
    what, param = schema_source(name)
    return APIError(
        400,
        f"{what} was not compiled within {COMPILE_SECONDS:g} s: give a simpler schema",
        code="invalid_schema",
        param=param,
    )


def _schema_value(value: Any, name: str) -> dict[str, Any]:
    """A schema given as an object or as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise APIError(400, f"{name} is not valid JSON: {error}", param=name) from error
    if not isinstance(value, dict):
        raise APIError(400, f"{name} must be a JSON schema (an object)", param=name)
    return value


def _structured_outputs(value: Any) -> dict[str, Any] | None:
    """vLLM's structured_outputs: only its 'json' entry (a schema) is honoured."""
    if not isinstance(value, dict):
        raise APIError(400, "structured_outputs must be an object", param="structured_outputs")
    given = sorted(key for key, entry in value.items() if entry is not None and entry is not False)
    other = [key for key in given if key != "json"]
    if other or "json" not in given:
        shown = ", ".join(other) if other else "nothing"
        raise APIError(
            400,
            f"structured_outputs: only 'json' (a JSON schema) is supported, got {shown}",
            param="structured_outputs",
        )
    return _schema_value(value["json"], "structured_outputs.json")
