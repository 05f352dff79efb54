"""Errors as OpenAI shapes them: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

import json
from typing import Any

# HTTP status -> OpenAI error type
_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """A request that cannot be served, with the status and the message the client sees."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code, self.param)


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The JSON object of an error response."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_bytes(status: int, message: str, code: str | None = None) -> bytes:
    return json.dumps(error_body(status, message, code)).encode()
