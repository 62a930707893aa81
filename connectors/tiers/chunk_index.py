"""The key index of a tier that evicts by itself (CPU arena, disk): sizes, byte accounting
and an eviction policy from :mod:`kvtier.policies.eviction` choosing the victims.

Both tiers must know how many bytes they hold without walking their storage, and pick
victims by a configurable policy (LRU by default; kvtier's session-aware policy when the
engine tells them which session and position each chunk has). Not thread-safe on its own:
each tier guards it with its lock.
"""

from __future__ import annotations

import time
from collections.abc import Container, Hashable, Iterable, Iterator
from typing import Generic, TypeVar

from kvtier.policies.eviction import LRU, ChunkInfo, EvictionPolicy

V = TypeVar("V")


class ChunkIndex(Generic[V]):
    """key -> (value, size), with an eviction policy over the keys."""

    def __init__(self, policy: EvictionPolicy | None = None) -> None:
        self._entries: dict[str, tuple[V, int]] = {}
        self.policy = policy or LRU()
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def leading_present(self, keys: Iterable[str]) -> int:
        """How many leading ``keys`` are indexed (a tier's ``contains_prefix``)."""
        n = 0
        for key in keys:
            if key not in self._entries:
                break
            n += 1
        return n

    def get(self, key: str, touch: bool = True) -> tuple[V, int] | None:
        """The entry, counted as an access by the policy unless ``touch`` is False."""
        entry = self._entries.get(key)
        if entry is not None and touch:
            self.policy.access(key, time.monotonic())
        return entry

    def add(self, key: str, value: V, size: int, info: ChunkInfo | None = None) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_bytes -= old[1]
            self.policy.remove(key)
        self._entries[key] = (value, size)
        self.used_bytes += size
        self.policy.insert(key, info if info is not None else ChunkInfo(size), time.monotonic())

    def share(self, key: str, session: Hashable) -> None:
        """``session`` uses this chunk too (see :meth:`EvictionPolicy.share`)."""
        if key in self._entries and session is not None:
            self.policy.share(key, session)

    def pop(self, key: str) -> tuple[V, int] | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry[1]
            self.policy.remove(key)
        return entry

    def victim(self, exclude: Container[str] = frozenset()) -> str | None:
        """The key the policy gives up next, never one in ``exclude`` (None if none)."""
        return self.policy.victim(time.monotonic(), exclude)

    def keys(self) -> Iterator[str]:
        return iter(list(self._entries))
