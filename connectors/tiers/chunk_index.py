"""The key index of a tier that evicts by itself (CPU arena, disk): sizes, byte accounting
and an eviction policy from :mod:`kvtier.policies.eviction` choosing the victims.

Both tiers must know how many bytes they hold without walking their storage, and pick
victims by a configurable policy (LRU by default; kvtier's session-aware policy when the
engine tells them which session and position each chunk has). Not thread-safe on its own:
each tier guards it with its lock.

The policy simulator (``kvtier bench policies``) keeps its tiers in this same index, with
its virtual clock, so capacity and eviction behave in the benchmark as they do in
production: ``clock`` is injected, and every call that consults the policy takes an
optional ``now`` for a caller whose events carry their own times.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Hashable, Iterable, Iterator
from typing import Generic, TypeVar

from kvtier.connectors.tiers.namespace_usage import NamespaceUsage
from kvtier.policies.eviction import LRU, ChunkInfo, EvictionPolicy

V = TypeVar("V")


class ChunkIndex(Generic[V]):
    """key -> (value, size), with an eviction policy over the keys."""

    def __init__(
        self,
        policy: EvictionPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._entries: dict[Hashable, tuple[V, int]] = {}
        self.policy = policy or LRU()
        self.clock = clock
        self.used_bytes = 0
        self.namespaces = NamespaceUsage()
        """Bytes and recency per tenant namespace (quotas, per-tenant gauges)."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def leading_present(self, keys: Iterable[Hashable]) -> int:
        """How many leading ``keys`` are indexed (a tier's ``contains_prefix``)."""
        n = 0
        for key in keys:
            if key not in self._entries:
                break
            n += 1
        return n

    def get(self, key: Hashable, touch: bool = True, now: float | None = None) -> tuple[V, int] | None:
        """The entry, counted as an access by the policy unless ``touch`` is False."""
        entry = self._entries.get(key)
        if entry is not None and touch:
            self.policy.access(key, self.clock() if now is None else now)
            self.namespaces.touch(key)
        return entry

    def size(self, key: Hashable) -> int:
        """Bytes of an indexed chunk (KeyError if absent); not an access."""
        return self._entries[key][1]

    def add(
        self,
        key: Hashable,
        value: V,
        size: int,
        info: ChunkInfo | None = None,
        now: float | None = None,
        charge: int | None = None,
    ) -> None:
        """Index ``key`` (``size`` bytes of capacity); ``charge``: what its namespace's quota
        is charged for it (default ``size``: see :meth:`Tier.occupancy`)."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_bytes -= old[1]
            self.policy.remove(key)
        self._entries[key] = (value, size)
        self.used_bytes += size
        self.namespaces.add(key, size if charge is None else charge)
        info = info if info is not None else ChunkInfo(size)
        self.policy.insert(key, info, self.clock() if now is None else now)

    def share(self, key: Hashable, session: Hashable) -> None:
        """``session`` uses this chunk too (see :meth:`EvictionPolicy.share`)."""
        if key in self._entries and session is not None:
            self.policy.share(key, session)

    def pop(self, key: Hashable) -> tuple[V, int] | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry[1]
            self.policy.remove(key)
            self.namespaces.remove(key)
        return entry

    def victim(self, exclude: Container[Hashable] = frozenset(), now: float | None = None) -> Hashable | None:
        """The key the policy gives up next, never one in ``exclude`` (None if none)."""
        return self.policy.victim(self.clock() if now is None else now, exclude)

    def evict_while(
        self,
        short_of_room: Callable[[], bool],
        exclude: Container[Hashable] = frozenset(),
        now: float | None = None,
    ) -> Iterator[tuple[Hashable, V, int]]:
        """Give up the policy's victims, one at a time, while ``short_of_room()``: each is
        removed from the index and yielded as (key, value, size) for the caller to free
        its storage (a slot, a file, or nothing in the simulator). Stops early when every
        remaining key is excluded; the caller then checks ``short_of_room()`` itself."""
        while short_of_room():
            key = self.victim(exclude, now)
            if key is None:
                return
            value, size = self._entries.pop(key)
            self.used_bytes -= size
            self.policy.remove(key)
            self.namespaces.remove(key)
            yield key, value, size

    def evict_namespace(
        self, namespace: str, need: int, exclude: Container[Hashable] = frozenset()
    ) -> Iterator[tuple[Hashable, V, int]]:
        """Give up ``namespace``'s least recently used chunks (none in ``exclude``) until
        ``need`` bytes are freed: a tenant over its quota makes room from its own KV. Each
        is removed from the index and yielded as :meth:`evict_while` yields."""
        for key in self.namespaces.coldest(namespace, need, exclude):  # type: ignore[arg-type]
            entry = self.pop(key)
            if entry is not None:
                yield key, entry[0], entry[1]

    def keys(self) -> Iterator[Hashable]:
        return iter(list(self._entries))
