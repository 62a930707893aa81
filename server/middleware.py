"""Two guards that run before any route: a bearer token and a request-body size limit.

Both are plain ASGI middleware so they act before FastAPI reads a body: an oversize upload
is refused from its ``Content-Length`` (or as soon as a chunked body passes the limit)
without ever reaching a tier, and a caller without the token learns nothing but 401.
"""

from __future__ import annotations

import json
import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvtier.server.errors import error_body

OPEN_PATHS = frozenset({"/healthz"})
"""Answered without a token: liveness probes carry no credentials."""


async def _send_error(send: Send, status: int, message: str, headers: list | None = None) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BearerAuth:
    """Every route but :data:`OPEN_PATHS` needs ``Authorization: Bearer <token>``."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization")
        # The scheme is case-insensitive (RFC 9110 11.1); the token is compared whole.
        scheme, _, token = (given or b"").strip().partition(b" ")
        if (
            given is None
            or scheme.lower() != b"bearer"
            or not secrets.compare_digest(token.strip(), self.expected)
        ):
            why = "missing bearer token" if given is None else "wrong bearer token"
            await _send_error(
                send,
                401,
                f"{why}: send 'Authorization: Bearer <server.auth_token>'",
                [(b"www-authenticate", b"Bearer")],
            )
            return
        await self.app(scope, receive, send)


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413, before any of it is used."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        message = f"request body is larger than server.max_body_bytes ({self.limit} bytes)"
        if length is not None:
            try:
                too_big = int(length) > self.limit
            except ValueError:
                await _send_error(send, 400, f"invalid Content-Length {length!r}")
                return
            if too_big:
                await _send_error(send, 413, message)
                return
            # The server reads exactly Content-Length bytes: nothing to count or buffer.
            await self.app(scope, receive, send)
            return
        # Chunked uploads carry no length: buffer up to the limit, then replay the body.
        body = bytearray()
        more = True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                await self.app(scope, _replay([msg]), send)
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.limit:
                await _send_error(send, 413, message)
                return
        await self.app(scope, _replay([{"type": "http.request", "body": bytes(body)}], receive), send)


def _replay(messages: list[Message], then: Receive | None = None) -> Receive:
    queue = list(messages)

    async def receive() -> Message:
        if queue:
            return queue.pop(0)
        if then is not None:
            return await then()  # after the body: wait for the client's disconnect
        return {"type": "http.disconnect"}

    return receive
