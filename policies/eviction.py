"""Which chunk a full tier gives up: LRU, SLRU, LFU, ARC, cost-aware and session-aware.

Every policy tracks the keys a tier holds through the same four calls — ``insert``,
``access``, ``remove`` and ``victim`` — and knows nothing of bytes on disk or in Redis: the
tier (or the simulator) asks for a victim, evicts it and calls ``remove``. ``victim`` never
returns a key in ``pinned`` (chunks a queued request is about to read).

One module per family: the interface and ``ChunkInfo`` in ``eviction_base``, LRU here,
SLRU/LFU/ARC in ``eviction_classic``, cost-aware and session-aware in ``eviction_session``.
Importing this module registers every built-in name; import the policies from here.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.policies.eviction_base import ChunkInfo, EvictionPolicy, Key
from kvtier.policies.eviction_base import first_unpinned as _first_unpinned
from kvtier.policies.eviction_classic import ARC, LFU, SLRU
from kvtier.policies.eviction_session import CostAware, SessionAware
from kvtier.policies.eviction_session import _Scored as _Scored
from kvtier.policies.registry import register

__all__ = [
    "ARC",
    "LFU",
    "LRU",
    "SLRU",
    "ChunkInfo",
    "CostAware",
    "EvictionPolicy",
    "Key",
    "SessionAware",
    "eviction_policy",
    "make_eviction",
]


@register("eviction", "lru")
class LRU(EvictionPolicy):
    """Least recently used."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key, info, now):
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key, now):
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key):
        self._order.pop(key, None)

    def victim(self, now, pinned=()):
        return _first_unpinned(self._order, pinned)

    def __contains__(self, key):
        return key in self._order


def eviction_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A policy instance from a name (or dotted path), or the instance itself."""
    return policy if isinstance(policy, EvictionPolicy) else make_eviction(policy)


def make_eviction(name: str, **kwargs) -> EvictionPolicy:
    from kvtier.policies.registry import resolve

    cls = resolve("eviction", name)
    return cls(**kwargs)
