"""What every eviction policy shares: ``ChunkInfo``, the ``EvictionPolicy`` interface, and
the pinned-key filter. The policies themselves are in ``eviction`` (LRU),
``eviction_classic`` (SLRU, LFU, ARC) and ``eviction_session`` (cost-aware,
session-aware); import them from ``kvtier.policies.eviction``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

Key = Hashable


@dataclass(frozen=True)
class ChunkInfo:
    """What a policy may know of a chunk."""

    nbytes: int
    session: Hashable | None = None
    index: int = 0
    """Position in its session's chunk chain (0 = first)."""
    recompute_s: float = 0.0
    """Prefill time its KV saves when it is reused."""
    next_use_s: float | None = None
    """Predicted seconds until its session's next turn (None: unknown)."""


class EvictionPolicy(ABC):
    name = "base"

    @abstractmethod
    def insert(self, key: Key, info: ChunkInfo, now: float) -> None: ...

    @abstractmethod
    def access(self, key: Key, now: float) -> None: ...

    @abstractmethod
    def remove(self, key: Key) -> None: ...

    @abstractmethod
    def victim(self, now: float, pinned: Iterable[Key] = ()) -> Key | None: ...

    def update(self, key: Key, info: ChunkInfo) -> None:
        """New knowledge of a chunk (e.g. its session's predicted return); default: ignored."""
        return None

    def share(self, key: Key, session: Hashable) -> None:
        """``session``'s chain uses this chunk too (a shared prefix); default: ignored."""
        return None

    @abstractmethod
    def __contains__(self, key: Key) -> bool: ...


def first_unpinned(keys: Iterable[Key], pinned: Iterable[Key]) -> Key | None:
    pin = pinned if isinstance(pinned, (set, frozenset, dict)) else set(pinned)
    for k in keys:
        if k not in pin:
            return k
    return None
