"""A request's response_format, checked for its shape where the request is parsed (serve/schemas.py); what it asks
for is compiled to a grammar later (serve/structured.py)."""

from __future__ import annotations

from typing import Any

# The response_format types the server honours; "text" asks for nothing.
FORMAT_TYPES = ("text", "json_object", "json_schema")


def format_check(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """A response_format's shape, checked where the request is parsed (a ValueError names what is wrong)."""
    if value is None:
        return None
    kind = value.get("type", "text")
    if kind not in FORMAT_TYPES:
        raise ValueError(f"type must be one of {', '.join(map(repr, FORMAT_TYPES))}, got {kind!r}")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("type 'json_schema' needs a json_schema object with the schema under 'schema'")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise ValueError("json_schema.schema must be a JSON object")
    return value
