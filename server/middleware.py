"""What runs around every route: a bearer token, a request-body size limit and a tenant's
share of the connections (three guards), and the request counter.

The guards are plain ASGI middleware so they act before FastAPI reads a body: an oversize
upload is refused from its ``Content-Length`` (or as soon as a chunked body passes the
limit) without ever reaching a tier, and a caller without the token learns nothing but 401.
The counter is plain ASGI too: Starlette's ``BaseHTTPMiddleware`` costs a task group and a
memory stream per request, paid by every lookup a vLLM scheduler waits on.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvtier.server.connection_limits import CloseReason, ConnectionTable
from kvtier.server.errors import error_body
from kvtier.server.identity import IDENTITY_KEY, Identity, required_scope
from kvtier.server.tenant_budget import TenantBudget


async def _send_error(send: Send, status: int, message: str, headers: list | None = None,
                      type_: str | None = None) -> None:
    body = json.dumps(error_body(status, message, type_)).encode()
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


NO_BODY_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})
NO_BODY_PATHS = frozenset({"/healthz", "/metrics"})
"""Requests that take no body: one that comes with a body is refused before any is read."""


class BodyLimit:
    """Every byte of a request body is budgeted before it is held.

    - A body over ``limit`` is refused with 413 from its ``Content-Length``, or as soon as
      a chunked body passes it.
    - Bodies in flight across all requests stay within ``budget``, and one tenant's within
      ``tenant_share`` of it (never below ``limit``): past either, 503 with
      ``Retry-After``. A declared body counts from admission; a chunked one piece by piece
      as it arrives (it is buffered here), not once it is complete. Either counts until its
      request is answered.
    - A body must arrive within ``body_timeout_s`` in all, with no pause longer than
      ``idle_timeout_s`` (a client that declares a large body and sends nothing would hold
      its share of the budget for as long as it keeps the socket open): 408.
    - Routes that take no body (:data:`NO_BODY_METHODS`, :data:`NO_BODY_PATHS`, open
      without a token) refuse one with 400 before reading any of it.
    """

    def __init__(self, app: ASGIApp, limit: int, budget: int | None = None,
                 tenant_share: float = 0.5, body_timeout_s: float = 60.0,
                 idle_timeout_s: float = 10.0) -> None:
        self.app = app
        self.limit = limit
        share = None if budget is None else max(int(budget * tenant_share), min(limit, budget))
        self.bodies = TenantBudget("request bodies in flight", budget, share)
        """Bytes of request bodies admitted and not yet answered."""
        self.body_timeout_s = body_timeout_s
        self.idle_timeout_s = idle_timeout_s

    async def _busy(self, send: Send, why: str) -> None:
        await _send_error(send, 503, why, [(b"retry-after", b"1")])

    # ------------------------------------------------------------------ requests
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        declared = None
        if length is not None:
            try:
                declared = int(length)
                if declared < 0:
                    raise ValueError
            except ValueError:
                await _send_error(send, 400, f"invalid Content-Length {length!r}")
                return
        if (chunked or declared) and (scope.get("method") in NO_BODY_METHODS
                                      or scope.get("path") in NO_BODY_PATHS):
            await _send_error(send, 400, f"{scope.get('method')} {scope.get('path')} takes "
                              "no request body")
            return
        message = f"request body is larger than server.max_body_bytes ({self.limit} bytes)"
        ident = scope.get(IDENTITY_KEY)
        tenant = ident.tenant if ident is not None else ""
        if declared is not None:
            if declared > self.limit:
                await _send_error(send, 413, message)
                return
            why = self.bodies.try_take(tenant, declared)
            if why is not None:
                await self._busy(send, why)
                return
            # The server reads exactly Content-Length bytes: nothing to count or buffer.
            try:
                await self._run_timed(scope, receive, send, declared > 0)
            finally:
                self.bodies.give(tenant, declared)
            return
        await self._chunked(scope, receive, send, tenant, message)

    async def _chunked(self, scope: Scope, receive: Receive, send: Send, tenant: str,
                       too_large: str) -> None:
        """A chunked upload carries no length: buffered here up to the limit, each piece
        charged as it arrives, then replayed to the app."""
        body = bytearray()
        taken = 0
        clock = _BodyClock(receive, self.body_timeout_s, self.idle_timeout_s)
        try:
            more = True
            while more:
                msg = await clock.receive()
                if clock.timed_out:
                    await _send_error(send, 408, clock.why)
                    return
                if msg["type"] != "http.request":
                    await self.app(scope, _replay([msg]), send)
                    return
                piece = msg.get("body", b"")
                more = msg.get("more_body", False)
                if len(body) + len(piece) > self.limit:
                    await _send_error(send, 413, too_large)
                    return
                why = self.bodies.try_take(tenant, len(piece))
                if why is not None:
                    await self._busy(send, why)
                    return
                taken += len(piece)
                body += piece
            replay = _replay([{"type": "http.request", "body": bytes(body)}], receive)
            await self.app(scope, replay, send)
        finally:
            self.bodies.give(tenant, taken)

    async def _run_timed(self, scope: Scope, receive: Receive, send: Send, has_body: bool
                         ) -> None:
        """The app, its body under the time limits: a body that stalls is answered 408
        here (the app sees the client go away; whatever it sends after is dropped)."""
        if not has_body:
            await self.app(scope, receive, send)
            return
        clock = _BodyClock(receive, self.body_timeout_s, self.idle_timeout_s)
        started = False

        async def guarded_send(msg: Message) -> None:
            nonlocal started
            if clock.timed_out and not started:
                return  # answered 408 below
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, clock.receive, guarded_send)
        except Exception:
            if not clock.timed_out or started:
                raise
        if clock.timed_out and not started:
            await _send_error(send, 408, clock.why)


class _BodyClock:
    """``receive`` with a body's time limits (``total_s`` in all, ``idle_s`` between
    messages), until the body is complete; after it a route may wait for the client's
    disconnect as long as it likes. A limit passed reads as the client going away, with
    ``timed_out`` set (raising here would reach the app wrapped, as a 500)."""

    def __init__(self, receive: Receive, total_s: float, idle_s: float) -> None:
        self._receive = receive
        self.total_s, self.idle_s = total_s, idle_s
        self._deadline = asyncio.get_running_loop().time() + total_s
        self._done = False
        self.timed_out = False
        self.why = (f"the request body did not arrive in time (server.body_timeout_s "
                    f"{total_s:g} s in all, server.body_idle_timeout_s {idle_s:g} s without "
                    "a byte)")

    async def receive(self) -> Message:
        if self._done:
            return await self._receive()
        if self.timed_out:
            return {"type": "http.disconnect"}
        left = min(self.idle_s, self._deadline - asyncio.get_running_loop().time())
        try:
            msg = await asyncio.wait_for(self._receive(), max(left, 0.001))
        except asyncio.TimeoutError:
            self.timed_out = True
            return {"type": "http.disconnect"}
        if msg["type"] != "http.request" or not msg.get("more_body", False):
            self._done = True
        return msg


def _replay(messages: list[Message], then: Receive | None = None) -> Receive:
    queue = list(messages)

    async def receive() -> Message:
        if queue:
            return queue.pop(0)
        if then is not None:
            return await then()  # after the body: wait for the client's disconnect
        return {"type": "http.disconnect"}

    return receive


class RequestCounter:
    """Counts each HTTP request once it is answered: ``count(method, route, status)``, the
    route's template (``unmatched`` where none matched); a request whose route raised
    without an answer counts as 500."""

    def __init__(self, app: ASGIApp, count: Callable[[str, str, str], None]) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def answered(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, answered)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.count(scope["method"], route, str(status))


class ConnectionGate:
    """With several tenants, one tenant's connections hold at most its share of the
    connection cap: a request of a tenant past it, on a connection not yet its own, is
    answered 503 with ``Retry-After`` and ``Connection: close`` (its connection goes, so
    the tenant's count stays within its share). Connections are those of the server's
    :class:`~kvtier.server.connection_limits.ConnectionTable`, found by the request's
    client address."""

    def __init__(self, app: ASGIApp, table: ConnectionTable) -> None:
        self.app = app
        self.table = table

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ident = scope.get(IDENTITY_KEY)
        if scope["type"] != "http" or ident is None or self.table.limits.per_tenant is None:
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        if self.table.attribute(tuple(client) if client else None, ident.tenant):
            await self.app(scope, receive, send)
            return
        self.table.count_close(CloseReason.TENANT_CAP)
        await _send_error(
            send, 503,
            f"tenant {ident.tenant!r} holds {self.table.tenant_count(ident.tenant)} "
            f"connections, its share of server.max_connections "
            f"({self.table.limits.per_tenant}): reuse kept-alive connections, or retry",
            [(b"retry-after", b"1"), (b"connection", b"close")], "too_many_connections")
