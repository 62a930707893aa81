"""Replies are budgeted as bodies are: bytes a reply holds (a tier's lent memory, or a copy
read for it) count from the moment the route has them until the last byte is written.

A client that asks for chunks and never reads them would otherwise hold their memory (and
the CPU tier's slots under its leases) for as long as its socket stays open. So:

- replies in flight stay within a budget (``server.max_inflight_bytes``, as bodies do, each
  direction its own) and one tenant's within its share where there are several tenants:
  past either, 503 with ``Retry-After`` before anything is leased for good;
- every write of a reply must complete within ``server.reply_write_timeout_s``: a client
  that stops reading is cut off, and its leases and budget are released.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvtier.server.errors import RouteError


@dataclass
class Reservation:
    """Bytes one reply holds against the budget (released once, when it is written)."""

    budget: ReplyBudget
    tenant: str
    nbytes: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.budget._give(self.tenant, self.nbytes)  # noqa: SLF001 - its own budget


class ReplyBudget:
    def __init__(self, budget: int, tenant_share: float = 1.0, write_timeout_s: float = 30.0
                 ) -> None:
        self.budget = budget
        self.tenant_budget = max(int(budget * tenant_share), 1)
        self.write_timeout_s = write_timeout_s
        self.held = 0
        self.by_tenant: dict[str, int] = {}
        self._lock = threading.Lock()

    def reserve(self, tenant: str, nbytes: int) -> Reservation:
        """Room for a reply of ``nbytes``, or a 503 with ``Retry-After`` (a reply larger
        than the whole budget is let through alone, so it is never refused for good)."""
        with self._lock:
            held = self.by_tenant.get(tenant, 0)
            alone = self.held == 0
            if not alone and self.held + nbytes > self.budget:
                raise RouteError(503, f"the server holds {self.held} bytes of replies not yet "
                                 f"read by their clients; {nbytes} more would pass "
                                 f"server.max_inflight_bytes ({self.budget}): retry")
            if held and held + nbytes > self.tenant_budget:
                raise RouteError(503, f"tenant {tenant!r} holds {held} bytes of replies not "
                                 f"yet read; {nbytes} more would pass its share "
                                 f"({self.tenant_budget}): retry")
            self.held += nbytes
            self.by_tenant[tenant] = held + nbytes
        return Reservation(self, tenant, nbytes)

    def _give(self, tenant: str, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes
            left = self.by_tenant.get(tenant, 0) - nbytes
            if left > 0:
                self.by_tenant[tenant] = left
            else:
                self.by_tenant.pop(tenant, None)
