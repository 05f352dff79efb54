"""The ASGI guard in front of the app: API key, body size limit and request counting.

A plain ASGI middleware rather than FastAPI dependencies, so that a wrong key is refused (401) and an
oversized body is cut off (413) before any of the body is parsed, and without Starlette's
BaseHTTPMiddleware, which interferes with streaming responses and disconnect detection.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Collection, MutableMapping
from typing import Any

from viasd.serve.errors import error_bytes
from viasd.serve.metrics import Metrics

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


async def send_error(
    send: Send, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None
) -> None:
    """Send a complete JSON error response."""
    body = error_bytes(status, message, code)
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value)
    return None


class _Disconnected(Exception):
    """The client went away while sending its body."""


class _TooLarge(Exception):
    """The body exceeded the limit."""


class GuardMiddleware:
    """Checks the API key, caps the request body, and counts responses by path and status."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: Metrics,
        api_key: str | None,
        max_body_bytes: int,
        known_paths: Collection[str],
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.known_paths = frozenset(known_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # if the app fails before it starts a response

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self._guarded(scope, receive, counting_send)
        finally:
            path = scope["path"] if scope["path"] in self.known_paths else "other"
            self.metrics.count_request(path, status)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            refusal = self._auth_refusal(scope)
            if refusal:
                await send_error(send, 401, refusal, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
                return
        if scope["method"] in _BODY_METHODS:
            length = _header(scope, b"content-length")
            if length is not None:
                if not length.strip().isdigit():
                    await send_error(send, 400, "the Content-Length header is not a number")
                    return
                if int(length) > self.max_body_bytes:
                    await self._too_large(send)
                    return
            try:
                body = await self._read_body(receive)
            except _Disconnected:
                return
            except _TooLarge:
                await self._too_large(send)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _auth_refusal(self, scope: Scope) -> str | None:
        """Why the request's credentials are refused, or None when they are good."""
        header = _header(scope, b"authorization")
        if header is None:
            return "missing API key: send the header 'Authorization: Bearer <key>'"
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key or b""):
            return "invalid API key"
        return None

    async def _too_large(self, send: Send) -> None:
        await send_error(
            send,
            413,
            f"the request body is larger than this server accepts ({self.max_body_bytes} bytes, --max-body-bytes)",
            "request_too_large",
        )

    async def _read_body(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out the buffered body once, then passes through (for disconnect events)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
