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

from dataclasses import dataclass

from kvtier.server.errors import RouteError
from kvtier.server.tenant_budget import TenantBudget


@dataclass
class Reservation:
    """Bytes one reply holds against the budget (released once, when it is written)."""

    budget: TenantBudget
    tenant: str
    nbytes: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.budget.give(self.tenant, self.nbytes)


class ReplyBudget:
    def __init__(self, budget: int, tenant_share: float = 1.0, write_timeout_s: float = 30.0
                 ) -> None:
        self.budget = budget
        self.write_timeout_s = write_timeout_s
        self._held = TenantBudget("replies not yet read by their clients", budget,
                                  max(int(budget * tenant_share), 1))

    @property
    def held(self) -> int:
        return self._held.held

    def reserve(self, tenant: str, nbytes: int) -> Reservation:
        """Room for a reply of ``nbytes``, or a 503 with ``Retry-After``."""
        why = self._held.try_take(tenant, nbytes)
        if why is not None:
            raise RouteError(503, why)
        return Reservation(self._held, tenant, nbytes)
