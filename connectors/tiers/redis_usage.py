"""What one Redis tier instance stored there, kept as counters: bytes and chunks (for
gauges and capacity, never a SCAN) and each tenant's chunks (quotas, per-tenant gauges).

Redis may expire or evict a value, and other writers share the server: the counters are
this instance's view, corrected as reads miss what it stored (bookkeeping apart from the
bytes, which move in :mod:`.redis_tier`).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping, Sequence

from kvtier.connectors.tiers.namespace_usage import NamespaceUsage


class RedisUsage:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = 0
        self._chunks = 0
        self._namespaces = NamespaceUsage()

    def stored(self, sizes: Mapping[str, int], charges: Mapping[str, int]) -> None:
        """Chunks this instance wrote (key -> bytes; key -> what a quota is charged)."""
        with self._lock:
            self._bytes += sum(sizes.values())
            self._chunks += len(sizes)
            for key, charge in charges.items():
                self._namespaces.add(key, charge)

    def removed(self, nbytes: int, chunks: int, keys: Sequence[str] = ()) -> None:
        """Chunks deleted (or found corrupt): their bytes and count, and ``keys`` out of
        the tenants' accounts."""
        with self._lock:
            self._bytes = max(0, self._bytes - nbytes)
            self._chunks = max(0, self._chunks - chunks)
            for key in keys:
                self._namespaces.remove(key)

    def read(self, keys: Sequence[str], sizes: Sequence[int | None]) -> None:
        """After a read: a miss leaves the tenant's account (expired, evicted by Redis, or
        corrupt), a hit is recent."""
        with self._lock:
            for key, n in zip(keys, sizes, strict=True):
                if n is None:
                    self._namespaces.remove(key)
                else:
                    self._namespaces.touch(key)

    def held(self, namespace: str, keys: Sequence[str] = ()) -> tuple[int, set[str]]:
        with self._lock:
            return self._namespaces.held(namespace, keys)

    def by_namespace(self) -> dict[str, int]:
        with self._lock:
            return self._namespaces.snapshot()

    def coldest(self, namespace: str, need: int, exclude: Collection[str]) -> list[str]:
        with self._lock:
            return self._namespaces.coldest(namespace, need, exclude)

    def gauges(self) -> tuple[int, int]:
        """(chunks, bytes) this instance stored minus those it deleted."""
        with self._lock:
            return self._chunks, self._bytes
