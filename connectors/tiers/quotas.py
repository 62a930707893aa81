"""Tenants' quotas over the tier stack: bytes each tenant's namespace may hold per tier.

Bookkeeping apart from the stack that moves bytes: before a write reaches a tier, what a
tenant would hold there is checked against its quota, and room is made from that tenant's
own coldest chunks (handed down like any eviction: a quota pushes a tenant's KV down, not
out), never another tenant's; after the write, a tenant that concurrent writes raced past
its quota gives up its coldest chunks again. What a chunk is charged is what it takes in
that tier, all told (:meth:`~.base.Tier.occupancy`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvtier.connectors.tiers.base import ChunkWrite, Tier
from kvtier.connectors.tiers.namespace_usage import namespace_of


@dataclass
class QuotaAdmission:
    """What of a batch may go into a tier: ``writes`` to send, ``refused`` key -> why."""

    writes: list[ChunkWrite]
    refused: dict[str, str] = field(default_factory=dict)


class TenantQuotas:
    """``limits``: tenant -> tier name -> bytes its namespace may hold there."""

    def __init__(self) -> None:
        self.limits: dict[str, dict[str, int]] = {}
        self.evicted_bytes: dict[tuple[str, str], int] = {}
        """(tenant, tier) -> bytes a tenant's quota made that tier evict (pushed down)."""
        self._lock = threading.Lock()

    def limit(self, namespace: str | None, tier: Tier) -> int | None:
        if namespace is None:
            return None
        return self.limits.get(namespace, {}).get(tier.name)

    def _by_quota(self, tier: Tier, keys: Iterable[str]) -> dict[str, tuple[int, list[str]]]:
        """The keys of each namespace that has a quota in ``tier``: ns -> (quota, keys)."""
        out: dict[str, tuple[int, list[str]]] = {}
        for key in keys:
            ns = namespace_of(key)
            quota = self.limit(ns, tier)
            if quota is not None and ns is not None:
                out.setdefault(ns, (quota, []))[1].append(key)
        return out

    def admit(self, tier: Tier, writes: Sequence[ChunkWrite]) -> QuotaAdmission:
        """What of ``writes`` may go into ``tier``, after making room from each tenant's
        own coldest chunks there; the rest is refused (``quota``: a batch bigger than the
        whole quota). A write is charged for its ``nbytes`` (at most what it stores)."""
        if not self.limits:
            return QuotaAdmission(list(writes))
        sizes = {w.key: w.nbytes for w in writes}
        refused: dict[str, str] = {}
        for ns, (quota, keys) in self._by_quota(tier, sizes).items():
            held, present = tier.namespace_held(ns, keys)
            incoming = 0
            for key in keys:
                if key in present:
                    continue
                size = tier.occupancy(sizes[key])  # what it takes there, all told
                if incoming + size > quota:
                    refused[key] = f"quota: tenant {ns} may hold {quota} bytes in {tier.name}"
                else:
                    incoming += size
            if held + incoming > quota:
                self._evict(tier, ns, held + incoming - quota, keys)
        return QuotaAdmission([w for w in writes if w.key not in refused], refused)

    def trim(self, tier: Tier, keys: Sequence[str]) -> None:
        """After a write: a tenant over its quota (concurrent writes raced past the check)
        gives up its coldest chunks, never the ones just stored."""
        if not self.limits:
            return
        for ns, (quota, ns_keys) in self._by_quota(tier, keys).items():
            held, _ = tier.namespace_held(ns)
            if held > quota:
                self._evict(tier, ns, held - quota, ns_keys)

    def _evict(self, tier: Tier, ns: str, need: int, keep: Sequence[str]) -> None:
        try:
            freed = tier.evict_namespace(ns, need, set(keep))
        except Exception as exc:  # noqa: BLE001 - the write goes on; the trim retries next time
            tier.stats.count_error(type(exc).__name__)
            return
        with self._lock:
            key = (ns, tier.name)
            self.evicted_bytes[key] = self.evicted_bytes.get(key, 0) + freed

    def tenant_bytes(self, tiers: Sequence[Tier]) -> dict[tuple[str, str], int]:
        """(tenant, tier) -> bytes held: counters, never a scan."""
        return {(ns, t.name): n for t in tiers for ns, n in t.namespace_bytes().items()}
