"""uvicorn's HTTP protocol with a deadline for request heads and a connection cap.

uvicorn arms its keep-alive timer only after a reply, and disarms it on any byte: a fresh
connection that never sends a byte, or one that sends a head a byte at a time, is held for
ever. Here every connection must send a whole request head within
``server.request_head_timeout_s`` of opening and of each reply (else it is closed, with a
408 where part of a head came), and every connection is counted in the server's
:class:`~kvtier.server.connection_limits.ConnectionTable`, which holds the cap.

The hooks are the protocol's own callbacks (``connection_made``, ``data_received``,
``on_response_complete``, ``connection_lost``); a new request head shows as a new request
cycle once its bytes are parsed, whatever parser uvicorn uses.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from kvtier.server.connection_limits import CloseReason, ConnectionTable
from kvtier.server.errors import error_body


def _timeout_reply(timeout_s: float) -> bytes:
    body = json.dumps(error_body(408, f"no complete request head within {timeout_s:g} s "
                                      "(server.request_head_timeout_s)", "request_timeout")
                      ).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
            + body)


class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """One connection; ``table`` is set on the subclass :func:`guarded_protocol` makes."""

    table: ConnectionTable

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._kv_deadline: asyncio.TimerHandle | None = None
        self._kv_partial = False
        self._kv_seen_cycle = self.cycle
        if not self.table.admit(self, self.client):
            transport.abort()  # nothing read, nothing to answer
            return
        self._kv_arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not self._kv_seen_cycle:  # a whole request head was parsed
            self._kv_seen_cycle = self.cycle
            self._kv_partial = False
            self._kv_disarm()
            self.table.busy(self)
        elif self._kv_deadline is not None:
            self._kv_partial = True

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or (cycle.response_complete and cycle is self._kv_seen_cycle):
            self.table.idle(self)
            self._kv_arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._kv_disarm()
        self.table.forget(self)
        super().connection_lost(exc)

    # ------------------------------------------------------------------ the deadline
    def close_idle(self, reason: CloseReason) -> None:
        """Close a connection with no request in flight (the table's eviction)."""
        self._kv_disarm()
        if not self.transport.is_closing():
            self.transport.close()

    def _kv_arm(self) -> None:
        self._kv_disarm()
        self._kv_deadline = self.loop.call_later(self.table.limits.head_timeout_s,
                                                 self._kv_head_timeout)

    def _kv_disarm(self) -> None:
        if getattr(self, "_kv_deadline", None) is not None:
            self._kv_deadline.cancel()
            self._kv_deadline = None

    def _kv_head_timeout(self) -> None:
        self._kv_deadline = None
        if self.transport.is_closing():
            return
        self.table.count_close(CloseReason.HEAD_TIMEOUT)
        if self._kv_partial:
            self.transport.write(_timeout_reply(self.table.limits.head_timeout_s))
        self.transport.close()
        self.table.forget(self)


def guarded_protocol(table: ConnectionTable) -> type[GuardedHTTPProtocol]:
    """The protocol class uvicorn instantiates per connection, bound to ``table``."""
    return type("GuardedHTTPProtocol", (GuardedHTTPProtocol,), {"table": table})
