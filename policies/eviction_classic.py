"""Classic eviction policies: segmented LRU, LFU and ARC (LRU itself is in ``eviction``).

Registered as ``slru``, ``lfu`` and ``arc`` on import; ``kvtier.policies.eviction``
imports this module and re-exports its policies.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from kvtier.errors import InvalidArgumentError
from kvtier.policies.eviction_base import EvictionPolicy, Key
from kvtier.policies.eviction_base import first_unpinned as _first_unpinned
from kvtier.policies.registry import register


@register("eviction", "slru")
class SLRU(EvictionPolicy):
    """Segmented LRU: new keys enter probation; a second access promotes them to a protected
    segment (``protected_fraction`` of the keys); victims come from probation first, so one
    scan of cold chunks cannot flush the chunks that are reused."""

    name = "slru"

    def __init__(self, protected_fraction: float = 0.8) -> None:
        if not 0 < protected_fraction < 1:
            raise InvalidArgumentError("SLRU protected_fraction must be in (0, 1)")
        self.protected_fraction = protected_fraction
        self._probation: OrderedDict[Key, None] = OrderedDict()
        self._protected: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key, info, now):
        self._protected.pop(key, None)
        self._probation[key] = None
        self._probation.move_to_end(key)

    def access(self, key, now):
        if key in self._protected:
            self._protected.move_to_end(key)
            return
        if key not in self._probation:
            return
        del self._probation[key]
        self._protected[key] = None
        limit = max(1, int(self.protected_fraction * (len(self._probation) + len(self._protected))))
        while len(self._protected) > limit:
            demoted, _ = self._protected.popitem(last=False)
            self._probation[demoted] = None

    def remove(self, key):
        self._probation.pop(key, None)
        self._protected.pop(key, None)

    def victim(self, now, pinned=()):
        k = _first_unpinned(self._probation, pinned)
        return k if k is not None else _first_unpinned(self._protected, pinned)

    def __contains__(self, key):
        return key in self._probation or key in self._protected


@register("eviction", "lfu")
class LFU(EvictionPolicy):
    """Least frequently used; ties go to the least recently used (a heap with lazy
    deletion: O(log n) per call)."""

    name = "lfu"

    def __init__(self) -> None:
        self._rank: dict[Key, tuple[int, int]] = {}
        self._heap: list[tuple[int, int, int, Key]] = []
        self._seq = 0

    def _push(self, key, count):
        self._seq += 1
        self._rank[key] = (count, self._seq)
        heapq.heappush(self._heap, (count, self._seq, id(key), key))

    def insert(self, key, info, now):
        self._push(key, 1)

    def access(self, key, now):
        if key in self._rank:
            self._push(key, self._rank[key][0] + 1)

    def remove(self, key):
        self._rank.pop(key, None)

    def victim(self, now, pinned=()):
        pin = set(pinned)
        skipped = []
        found = None
        while self._heap:
            count, seq, _, key = self._heap[0]
            if self._rank.get(key) != (count, seq):
                heapq.heappop(self._heap)  # stale entry
                continue
            if key in pin:
                skipped.append(heapq.heappop(self._heap))
                continue
            found = key
            break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return found

    def __contains__(self, key):
        return key in self._rank


@register("eviction", "arc")
class ARC(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha), by key count: T1 holds keys seen once,
    T2 keys seen again; ghost lists B1/B2 remember recent victims and move the target size
    ``p`` of T1 toward whichever list the misses say was too small."""

    name = "arc"

    def __init__(self, capacity_keys: int = 1024) -> None:
        if capacity_keys < 1:
            raise InvalidArgumentError("ARC capacity_keys must be >= 1")
        self.c = capacity_keys
        self.p = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key, info, now):
        if key in self.b1:  # a recent T1 victim came back: T1 was too small
            self.p = min(self.c, self.p + max(len(self.b2) / max(len(self.b1), 1), 1))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:  # a recent T2 victim came back: T2 was too small
            self.p = max(0.0, self.p - max(len(self.b1) / max(len(self.b2), 1), 1))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.c:
                ghost.popitem(last=False)

    def access(self, key, now):
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key):
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None

    def victim(self, now, pinned=()):
        first, second = (self.t1, self.t2) if len(self.t1) > self.p else (self.t2, self.t1)
        k = _first_unpinned(first, pinned)
        return k if k is not None else _first_unpinned(second, pinned)

    def __contains__(self, key):
        return key in self.t1 or key in self.t2
