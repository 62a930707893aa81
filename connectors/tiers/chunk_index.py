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
from dataclasses import replace
from typing import Generic, NamedTuple, TypeVar

from kvtier.connectors.tiers.namespace_usage import NamespaceUsage
from kvtier.policies.eviction import LRU, ChunkInfo, EvictionPolicy

V = TypeVar("V")


class Evicted(NamedTuple, Generic[V]):
    """A chunk the index gave up: its storage (``value``) is the caller's to free, and
    what was known of it (``info``: its session and place, None if nothing was) goes
    with it to the tier below, which ranks it as this one did."""

    key: Hashable
    value: V
    size: int
    info: ChunkInfo | None


class ChunkIndex(Generic[V]):
    """key -> (value, size), with an eviction policy over the keys."""

    def __init__(
        self,
        policy: EvictionPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._entries: dict[Hashable, tuple[V, int]] = {}
        self._infos: dict[Hashable, ChunkInfo] = {}
        """What the writer said of each chunk (session, place), where it said anything."""
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
        if info is not None:
            self._infos[key] = info
        else:
            self._infos.pop(key, None)
        self.policy.insert(key, info or ChunkInfo(size), self.clock() if now is None else now)

    def info(self, key: Hashable) -> ChunkInfo | None:
        """What the writer said of an indexed chunk (None: nothing, or not indexed)."""
        return self._infos.get(key)

    def share(self, key: Hashable, session: Hashable) -> None:
        """``session`` uses this chunk too (see :meth:`EvictionPolicy.share`)."""
        if key in self._entries and session is not None:
            self.policy.share(key, session)
            info = self._infos.get(key)
            if info is not None and info.session not in (None, session):
                self._infos[key] = replace(info, session=None)  # no one session's to lose

    def pop(self, key: Hashable) -> tuple[V, int] | None:
        entry = self._entries.pop(key, None)
        self._infos.pop(key, None)
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
    ) -> Iterator[Evicted[V]]:
        """Give up the policy's victims, one at a time, while ``short_of_room()``: each is
        removed from the index and yielded (:class:`Evicted`) for the caller to free its
        storage (a slot, a file, or nothing in the simulator). Stops early when every
        remaining key is excluded; the caller then checks ``short_of_room()`` itself."""
        while short_of_room():
            key = self.victim(exclude, now)
            if key is None:
                return
            value, size = self._entries.pop(key)
            self.used_bytes -= size
            self.policy.remove(key)
            self.namespaces.remove(key)
            yield Evicted(key, value, size, self._infos.pop(key, None))

    def evict_namespace(
        self, namespace: str, need: int, exclude: Container[Hashable] = frozenset()
    ) -> Iterator[Evicted[V]]:
        """Give up ``namespace``'s least recently used chunks (none in ``exclude``) until
        ``need`` bytes are freed: a tenant over its quota makes room from its own KV. Each
        is removed from the index and yielded as :meth:`evict_while` yields."""
        for key in self.namespaces.coldest(namespace, need, exclude):  # type: ignore[arg-type]
            info = self._infos.get(key)
            entry = self.pop(key)
            if entry is not None:
                yield Evicted(key, entry[0], entry[1], info)

    def keys(self) -> Iterator[Hashable]:
        return iter(list(self._entries))

    def values(self) -> dict[Hashable, V]:
        """key -> where each chunk lies (a copy)."""
        return {key: entry[0] for key, entry in self._entries.items()}

    def move(self, key: Hashable, value: V) -> None:
        """The chunk now lies at ``value`` (the CPU arena moved it): not an access, and
        nothing the policy or the quotas know of it changes."""
        self._entries[key] = (value, self._entries[key][1])
