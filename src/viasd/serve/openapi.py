"""The server's OpenAPI document: request bodies, every answer a route gives, and the API key scheme.

The completion routes read their JSON bodies themselves (whatever the Content-Type, as curl sends form
encoding by default), so FastAPI cannot see their request models; they are published here from the
same pydantic models that validate them. Error answers are documented per route from the status codes
the route and the guard in front of it really return, so schema-driven clients and fuzzers see the real
API. Validation failures are answered with 400, never FastAPI's 422, so 422 is left out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from viasd.serve.schemas import ErrorResponse

SECURITY_SCHEME = "apiKey"
_REF = "#/components/schemas/{model}"

# status -> when a route answers with it
_WHEN: dict[int, str] = {
    400: "Invalid request: malformed JSON, an invalid or unsupported field (the message names it and its range), "
    "a prompt too long, max_tokens too large, an unknown or unloaded method",
    401: "Missing or wrong API key (send 'Authorization: Bearer <key>')",
    404: "The model named is not served here",
    413: "The request body is larger than --max-body-bytes",
    503: "The queue is full (code queue_full; retry after the Retry-After header's seconds) or the server is "
    "shutting down",
}


def error_responses(*statuses: int, api_key: bool) -> dict[int | str, dict[str, Any]]:
    """The `responses` of a route for these error statuses (and 401 when the server requires a key)."""
    wanted = sorted({*statuses, *((401,) if api_key else ())})
    responses: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorResponse, "description": _WHEN[status]} for status in wanted
    }
    if 503 in responses:
        retry = {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}
        responses[503]["headers"] = {"Retry-After": retry}
    return responses


def completion_responses(
    model: type[BaseModel], chunk: type[BaseModel], api_key: bool
) -> dict[int | str, dict[str, Any]]:
    """The answers of a completion route: the result as JSON, or as server-sent events when streamed.

    Each event's `data` is a JSON `chunk` (or an error object, should generation fail mid-stream), and the
    last is the literal `[DONE]`.
    """
    json_data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {
            "anyOf": [{"$ref": _REF.format(model=chunk.__name__)}, {"$ref": _REF.format(model="ErrorResponse")}]
        },
    }
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]}},
        "description": f"one server-sent event: data is a JSON {chunk.__name__}, the last one [DONE]",
    }
    ok = {
        "model": model,
        "description": "The completion; with stream=true, server-sent events (text/event-stream)",
        "content": {"text/event-stream": {"schema": event}},
    }
    return {200: ok, **error_responses(400, 404, 413, 503, api_key=api_key)}


@dataclass(frozen=True)
class Served:
    """What this server accepts beyond the models' static constraints, published in its request schemas."""

    model_id: str
    methods: Sequence[str]
    max_tokens: int  # --max-tokens-limit
    vocab_size: int  # token ids in a prompt are below it
    api_key: bool
    tools: bool = False  # whether the chat template offers tools (without, `tools` is refused)


def install_openapi(
    app: FastAPI,
    request_bodies: Mapping[str, type[BaseModel]],
    events: Sequence[type[BaseModel]],
    served: Served,
) -> None:
    """Make `app.openapi()` return the document with the request bodies of `request_bodies` (path -> model),
    narrowed to what this server accepts, and the schemas of the streamed `events`."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = _document(app, request_bodies, events, served)
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]


def _narrow(schemas: dict[str, Any], names: Sequence[str], served: Served) -> None:
    """Publish the server's own limits in the request schemas: the model id, the loaded methods, the
    largest max_tokens, the vocabulary of prompt and stop token ids, and no tools when the chat template offers none
    (every other value is refused with 400 or 404)."""
    limits: dict[str, dict[str, Any]] = {
        "model": {"enum": [served.model_id]},
        "method": {"enum": list(served.methods)},
        "max_tokens": {"maximum": served.max_tokens},
        "max_completion_tokens": {"maximum": served.max_tokens},
    }
    for name in names:
        properties = schemas[name].get("properties", {})
        for field, constraint in limits.items():
            if field in properties:
                _typed_branch(properties[field]).update(constraint)
        for branch in [*properties.get("prompt", {}).get("anyOf", []), properties.get("tokens", {})]:
            if branch.get("items", {}).get("type") == "integer":  # token ids
                branch["items"]["maximum"] = served.vocab_size - 1
        if "tools" in properties and not served.tools:
            _typed_branch(properties["tools"]).update({"maxItems": 0})  # with minItems 1: only null or left out
        if "stop_token_ids" in properties:
            _typed_branch(properties["stop_token_ids"])["items"]["maximum"] = served.vocab_size - 1


def _typed_branch(prop: dict[str, Any]) -> dict[str, Any]:
    """The non-null alternative of an optional property's schema (the property itself when not optional)."""
    branches = [b for b in prop.get("anyOf", []) if b.get("type") != "null"]
    return branches[0] if len(branches) == 1 else prop


def _document(
    app: FastAPI, request_bodies: Mapping[str, type[BaseModel]], events: Sequence[type[BaseModel]], served: Served
) -> dict[str, Any]:
    schema = get_openapi(
        title=app.title, version=app.version, summary=app.summary, description=app.description, routes=app.routes
    )
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    published = [(model, "validation") for model in request_bodies.values()]
    published += [(model, "serialization") for model in events]
    refs, definitions = models_json_schema(published, ref_template=_REF)
    for name, definition in definitions.get("$defs", {}).items():
        schemas.setdefault(name, definition)
    for path, model in request_bodies.items():
        body = {"required": True, "content": {"application/json": {"schema": refs[(model, "validation")]}}}
        schema["paths"][path]["post"]["requestBody"] = body
    _narrow(schemas, [model.__name__ for model in request_bodies.values()], served)
    _drop_422(schema)
    if served.api_key:
        components["securitySchemes"] = {SECURITY_SCHEME: {"type": "http", "scheme": "bearer"}}
        for operation in _operations(schema, lambda path: path != "/health"):
            operation["security"] = [{SECURITY_SCHEME: []}]
    return schema


def _operations(schema: dict[str, Any], keep: Callable[[str], bool]) -> list[dict[str, Any]]:
    return [op for path, item in schema.get("paths", {}).items() if keep(path) for op in item.values()]


def _drop_422(schema: dict[str, Any]) -> None:
    """Remove FastAPI's 422 answers and their schemas: this server answers invalid input with 400."""
    for operation in _operations(schema, lambda path: True):
        operation.get("responses", {}).pop("422", None)
    schemas = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
