"""The read budget: bytes the server holds to read chunks for its clients, budgeted as
request bodies are (server/middleware.py), in a budget of their own.

A client that asks for chunks holds the server's memory from the moment a tier lends them
(a staging buffer a disk file or a Redis value was read into, or the CPU arena's slot,
pinned against eviction) until the bytes are let go: a reply until its last byte is
written, a read into a shared-memory region or a prefetch until the copy is made, a derive
until its new chunk is stored. Every one of those reads is charged here, before it is
made, from the sizes the tiers know without reading (:meth:`TierManager.sizes`: the CPU
and disk indexes, Redis's ``STRLEN``; a chunk whose size is unknown is charged
:attr:`ReplyBudget.ceiling` bytes, the largest chunk a client can store, until it is
read), and held while its bytes are:

- what all requests hold stays within ``server.max_inflight_bytes``, and one tenant's
  within its share where there are several tenants: past either, 503 with
  ``Retry-After`` before anything is read; a reply that alone could never fit is a 413
  before anything is read (ask in smaller batches);
- one request reads at most :attr:`ReplyBudget.group_bytes` more at a time (a run of a
  batch GET, a prefetch, a read into a region), so a long prefetch or region read does not
  hold the budget whole, and chunks of unknown size are charged a few at a time;
- every write of a reply must complete within ``server.reply_write_timeout_s``: a client
  that stops reading is cut off, and its leases and budget are released.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from kvtier.server.errors import RouteError
from kvtier.server.tenant_budget import TenantBudget


@dataclass
class Reservation:
    """Bytes one request's reads hold against the budget: grown before each read, settled
    to what the reads kept, released once (when its reply is written, or the request
    ends without one)."""

    budget: TenantBudget
    tenant: str
    nbytes: int = 0
    released: bool = False

    def grow_to(self, nbytes: int) -> None:
        """Hold ``nbytes`` in all before reading more: a 503 where the budget has no room
        (what is held stays held, for the caller to release)."""
        more = nbytes - self.nbytes
        if more > 0:
            why = self.budget.try_take(self.tenant, more)
            if why is not None:
                raise RouteError(503, why)
            self.nbytes = nbytes
        elif more < 0:
            self.settle(nbytes)

    def settle(self, nbytes: int) -> None:
        """Hold exactly ``nbytes``: what the reads kept (charged whether or not it fits:
        it is in memory already; it can only pass the charge where a size was unknown)."""
        if self.released:
            return
        if nbytes > self.nbytes:
            self.budget.take(self.tenant, nbytes - self.nbytes)
        else:
            self.budget.give(self.tenant, self.nbytes - nbytes)
        self.nbytes = nbytes

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.budget.give(self.tenant, self.nbytes)


class ReplyBudget:
    def __init__(self, budget: int, tenant_share: float = 1.0, write_timeout_s: float = 30.0,
                 ceiling: int | None = None) -> None:
        """``budget``: bytes all reads may hold at once; ``tenant_share``: the part of it one
        tenant's may hold; ``ceiling``: what a chunk of unknown size is charged (default:
        the whole budget)."""
        self.budget = budget
        self.write_timeout_s = write_timeout_s
        self._held = TenantBudget("chunks read for clients", budget,
                                  max(int(budget * tenant_share), 1))
        self.ceiling = budget if ceiling is None else min(ceiling, budget)
        """Bytes a chunk is charged whose size no index knows (the largest chunk a client
        can store: ``server.max_body_bytes``)."""
        self.group_bytes = max(int(budget * tenant_share) // 4, 1)
        """Bytes one request reads at a time where it reads piecewise (a quarter of one
        tenant's share: several requests proceed side by side)."""

    @property
    def held(self) -> int:
        """Bytes all requests hold now."""
        return self._held.held

    def charge(self, size: int | None) -> int:
        """What a read of a chunk of ``size`` bytes (None: unknown) is charged before it is
        made: never more than :attr:`ceiling`, so an index entry grown past any chunk (a
        file grown while the server was down, a Redis value appended to) cannot make a
        request 413 or 503 for good; the read, which checks the header first, finds it
        not a chunk, and what a read really keeps is settled after it."""
        return self.ceiling if size is None else min(size, self.ceiling)

    def reserve(self, tenant: str, nbytes: int = 0) -> Reservation:
        """Room for ``nbytes`` of ``tenant``'s reads, or a 503 with ``Retry-After``."""
        held = Reservation(self._held, tenant)
        held.grow_to(nbytes)
        return held

    def check_fits(self, nbytes: int, what: str) -> None:
        """A 413 where ``nbytes`` (one reply, known before any read) can never fit."""
        if nbytes > self.budget:
            raise RouteError(413, f"{what} would carry {nbytes} bytes, over "
                             f"server.max_inflight_bytes ({self.budget}): ask in smaller "
                             "batches")

    @contextlib.contextmanager
    def holding(self, tenant: str, nbytes: int) -> Iterator[Reservation]:
        """``nbytes`` held for the block (a 503 before it where there is no room)."""
        held = self.reserve(tenant, nbytes)
        try:
            yield held
        finally:
            held.release()
