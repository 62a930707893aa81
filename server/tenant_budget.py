"""Bytes held at once against a budget, and by each tenant against its share of it: what
request bodies (server/middleware.py) and reads for clients (server/reply_budget.py) may
hold in memory, each direction a budget of its own."""

from __future__ import annotations

import threading


class TenantBudget:
    def __init__(self, what: str, budget: int | None, tenant_budget: int | None = None) -> None:
        """``what`` names the bytes in refusals ("request bodies in flight"); ``budget``
        None: no bound; ``tenant_budget``: one tenant's share (default: all of it)."""
        self.what = what
        self.budget = budget
        self.tenant_budget = budget if tenant_budget is None else tenant_budget
        self.held = 0
        self.by_tenant: dict[str, int] = {}
        self._lock = threading.Lock()

    def try_take(self, tenant: str, nbytes: int) -> str | None:
        """Hold ``nbytes`` for ``tenant``, or say why not (a 503 to retry). Something
        larger than the whole budget passes when nothing else is held, so it is never
        refused for good."""
        if self.budget is None or nbytes <= 0:
            return None
        with self._lock:
            mine = self.by_tenant.get(tenant, 0)
            if self.held and self.held + nbytes > self.budget:
                return (f"the server holds {self.held} bytes of {self.what}; {nbytes} more "
                        f"would pass server.max_inflight_bytes ({self.budget}): retry")
            assert self.tenant_budget is not None
            if mine and mine + nbytes > self.tenant_budget:
                return (f"tenant {tenant!r} holds {mine} bytes of {self.what}; {nbytes} more "
                        f"would pass its share of server.max_inflight_bytes "
                        f"({self.tenant_budget}): retry")
            self.held += nbytes
            self.by_tenant[tenant] = mine + nbytes
        return None

    def take(self, tenant: str, nbytes: int) -> None:
        """Hold ``nbytes`` for ``tenant`` unasked: bytes already in memory (a read of a
        chunk whose size was not known before it was read)."""
        if self.budget is None or nbytes <= 0:
            return
        with self._lock:
            self.held += nbytes
            self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + nbytes

    def give(self, tenant: str, nbytes: int) -> None:
        if self.budget is None or nbytes <= 0:
            return
        with self._lock:
            self.held -= nbytes
            left = self.by_tenant.get(tenant, 0) - nbytes
            if left > 0:
                self.by_tenant[tenant] = left
            else:
                self.by_tenant.pop(tenant, None)
