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
from kvtier.server.identity import IDENTITY_KEY, Identity, required_scope


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
    """Every route but ``/healthz`` needs ``Authorization: Bearer <token>`` of a token whose
    scopes cover the request (:func:`~kvtier.server.identity.required_scope`); the caller's
    identity is left in the scope for the routes (its tenant is its chunks' namespace)."""

    def __init__(self, app: ASGIApp, tokens: dict[bytes, Identity]) -> None:
        self.app = app
        self.tokens = tokens

    def _identity(self, token: bytes) -> Identity | None:
        found = None
        for known, ident in self.tokens.items():  # every one compared: constant time
            if secrets.compare_digest(token, known):
                found = ident
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        needed = required_scope(scope.get("method", ""), scope.get("path", ""))
        if scope["type"] != "http" or needed is None:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization")
        # The scheme is case-insensitive (RFC 9110 11.1); the token is compared whole.
        scheme, _, token = (given or b"").strip().partition(b" ")
        ident = self._identity(token.strip()) if scheme.lower() == b"bearer" else None
        if ident is None:
            why = "missing bearer token" if given is None else "wrong bearer token"
            await _send_error(
                send,
                401,
                f"{why}: send 'Authorization: Bearer <token>' (server.auth_token or one of "
                "server.tokens)",
                [(b"www-authenticate", b"Bearer")],
            )
            return
        if needed not in ident.scopes:
            await _send_error(
                send, 403,
                f"this token (tenant {ident.tenant!r}, scopes {sorted(ident.scopes)}) lacks "
                f"the {needed!r} scope that {scope['method']} {scope['path']} needs",
            )
            return
        scope[IDENTITY_KEY] = ident
        await self.app(scope, receive, send)


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413, before any of it is used; and
    past ``budget`` bytes of bodies in flight across all requests, answer 503 with
    ``Retry-After`` instead of taking the memory (a body counts from admission until its
    request is answered)."""

    def __init__(self, app: ASGIApp, limit: int, budget: int | None = None) -> None:
        self.app = app
        self.limit = limit
        self.budget = budget
        self.inflight = 0
        """Bytes of request bodies admitted and not yet answered."""

    async def _admitted(self, scope: Scope, receive: Receive, send: Send, nbytes: int) -> None:
        if self.budget is not None and nbytes and self.inflight + nbytes > self.budget:
            await _send_error(
                send, 503,
                f"the server holds {self.inflight} bytes of request bodies in flight; "
                f"{nbytes} more would pass server.max_inflight_bytes ({self.budget}): retry",
                [(b"retry-after", b"1")],
            )
            return
        self.inflight += nbytes
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight -= nbytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        message = f"request body is larger than server.max_body_bytes ({self.limit} bytes)"
        if length is not None:
            try:
                declared = int(length)
                too_big = declared > self.limit
            except ValueError:
                await _send_error(send, 400, f"invalid Content-Length {length!r}")
                return
            if too_big:
                await _send_error(send, 413, message)
                return
            # The server reads exactly Content-Length bytes: nothing to count or buffer.
            await self._admitted(scope, receive, send, declared)
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
        replay = _replay([{"type": "http.request", "body": bytes(body)}], receive)
        await self._admitted(scope, replay, send, len(body))


def _replay(messages: list[Message], then: Receive | None = None) -> Receive:
    queue = list(messages)

    async def receive() -> Message:
        if queue:
            return queue.pop(0)
        if then is not None:
            return await then()  # after the body: wait for the client's disconnect
        return {"type": "http.disconnect"}

    return receive
