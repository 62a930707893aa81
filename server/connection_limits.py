"""Connections bounded by their clients: how many are open, which are idle, whose they are.

A socket that never sends a request would otherwise hold a descriptor for as long as its
client likes, and a thousand of them take every descriptor the tiers need to open a chunk
file. :class:`ConnectionTable` keeps the open connections of one server (all on its event
loop, so no lock), and decides:

- at the cap, a new connection closes the longest-idle one (no request in flight: it never
  sent a whole request head, or waits between requests), so idle sockets cannot lock out a
  client that has work; where every connection has a request in flight the new one is
  closed unread (there is no request yet to answer, and answering one would take the
  descriptor there is none of);
- with several tenants, one tenant's connections hold at most its share of the cap: a
  request of a tenant past it is answered 503 by :class:`kvtier.server.middleware.ConnectionGate`.

The protocol (:mod:`kvtier.server.guarded_protocol`) reports what its connection does; the
request-head deadline is its own.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol


class CloseReason(str, enum.Enum):
    """Why the server closed a connection itself (``kvtier_connections_closed_total``)."""

    HEAD_TIMEOUT = "head_timeout"
    """No complete request head within ``server.request_head_timeout_s``."""
    EVICTED_IDLE = "evicted_idle"
    """Idle while the cap was reached and a new connection came."""
    REFUSED_CAP = "refused_cap"
    """Came while the cap was reached and every connection had a request in flight."""
    TENANT_CAP = "tenant_cap"
    """Its tenant held its share of the cap already (answered 503)."""


@dataclass(frozen=True)
class ConnectionLimits:
    """``max_connections``: open at once; ``per_tenant``: one tenant's, where several
    share the server (None: no tenant bound); ``head_timeout_s``: to send a request head."""

    max_connections: int
    per_tenant: int | None
    head_timeout_s: float


class Closable(Protocol):
    """What the table needs of a connection: a way to close it."""

    def close_idle(self, reason: CloseReason) -> None: ...


class ConnectionTable:
    """The open connections of one server and the counts the metrics show."""

    def __init__(self, limits: ConnectionLimits,
                 on_close: Callable[[CloseReason], None] | None = None) -> None:
        self.limits = limits
        self._on_close = on_close
        self._open: set[Closable] = set()
        self._idle: OrderedDict[Closable, None] = OrderedDict()
        """Connections without a request in flight, longest idle first."""
        self._by_client: dict[Hashable, Closable] = {}
        self._client_of: dict[Closable, Hashable] = {}
        self._tenant_of: dict[Closable, str] = {}
        self._per_tenant: Counter[str] = Counter()
        self.closed: Counter[CloseReason] = Counter()

    @property
    def open_count(self) -> int:
        return len(self._open)

    def tenant_count(self, tenant: str) -> int:
        return self._per_tenant[tenant]

    # ----------------------------------------------------------------- connections
    def admit(self, conn: Closable, client: Hashable | None) -> bool:
        """A new connection: True if it may stay (an idle one closed to make room where
        the cap is reached); False if it must be closed unread."""
        if len(self._open) >= self.limits.max_connections:
            if not self._idle:
                self.count_close(CloseReason.REFUSED_CAP)
                return False
            victim, _ = self._idle.popitem(last=False)
            self.count_close(CloseReason.EVICTED_IDLE)
            victim.close_idle(CloseReason.EVICTED_IDLE)
            self.forget(victim)  # its connection_lost comes later; the room is now
        self._open.add(conn)
        self._idle[conn] = None
        if client is not None:
            self._by_client[client] = conn
            self._client_of[conn] = client
        return True

    def busy(self, conn: Closable) -> None:
        """A request head arrived: not idle until its reply is complete."""
        self._idle.pop(conn, None)

    def idle(self, conn: Closable) -> None:
        """The reply is complete and nothing else is queued on the connection."""
        if conn in self._open:
            self._idle.pop(conn, None)
            self._idle[conn] = None

    def forget(self, conn: Closable) -> None:
        """The connection is gone (or going)."""
        if conn not in self._open:
            return
        self._open.discard(conn)
        self._idle.pop(conn, None)
        client = self._client_of.pop(conn, None)
        if client is not None and self._by_client.get(client) is conn:
            del self._by_client[client]
        tenant = self._tenant_of.pop(conn, None)
        if tenant is not None:
            self._per_tenant[tenant] -= 1
            if not self._per_tenant[tenant]:
                del self._per_tenant[tenant]

    def count_close(self, reason: CloseReason) -> None:
        self.closed[reason] += 1
        if self._on_close is not None:
            self._on_close(reason)

    # --------------------------------------------------------------------- tenants
    def attribute(self, client: Hashable | None, tenant: str) -> bool:
        """The connection of ``client`` carries a request of ``tenant``: False where that
        tenant holds its share of the cap on other connections already."""
        conn = self._by_client.get(client) if client is not None else None
        if conn is None:
            return True  # not a connection this table holds (another server's protocol)
        if self._tenant_of.get(conn) == tenant:
            return True
        cap = self.limits.per_tenant
        if cap is not None and self._per_tenant[tenant] >= cap:
            return False
        previous = self._tenant_of.get(conn)
        if previous is not None:
            self._per_tenant[previous] -= 1
            if not self._per_tenant[previous]:
                del self._per_tenant[previous]
        self._tenant_of[conn] = tenant
        self._per_tenant[tenant] += 1
        return True
