"""Which chunk a full tier gives up: LRU, SLRU, LFU, ARC, cost-aware and session-aware.

Every policy tracks the keys a tier holds through the same four calls — ``insert``,
``access``, ``remove`` and ``victim`` — and knows nothing of bytes on disk or in Redis: the
tier (or the simulator) asks for a victim, evicts it and calls ``remove``. ``victim`` never
returns a key in ``pinned`` (chunks a queued request is about to read).
"""

from __future__ import annotations

import heapq
import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from kvtier.errors import InvalidArgumentError
from kvtier.policies.registry import register

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


def _first_unpinned(keys: Iterable[Key], pinned: Iterable[Key]) -> Key | None:
    pin = pinned if isinstance(pinned, (set, frozenset, dict)) else set(pinned)
    for k in keys:
        if k not in pin:
            return k
    return None


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


class _Scored(EvictionPolicy):
    """Victim = the lowest score; exact up to ``exact_up_to`` keys, else the lowest of a
    random sample plus the best candidates left from earlier calls (Redis's eviction pool):
    the score depends on the clock, so no index stays ordered, and a scan of every key per
    eviction would be quadratic."""

    exact_up_to = 64
    sample = 32
    pool_size = 16

    def __init__(self, seed: int = 0) -> None:
        self._info: dict[Key, ChunkInfo] = {}
        self._keys: list[Key] = []
        self._pos: dict[Key, int] = {}
        self._rng = random.Random(seed)
        self._pool: list[Key] = []

    def _add(self, key: Key, info: ChunkInfo) -> None:
        self._info[key] = info
        if key not in self._pos:
            self._pos[key] = len(self._keys)
            self._keys.append(key)

    def remove(self, key):
        self._info.pop(key, None)
        i = self._pos.pop(key, None)
        if i is None:
            return
        last = self._keys.pop()
        if i < len(self._keys):
            self._keys[i] = last
            self._pos[last] = i

    def update(self, key, info):
        if key in self._info:
            self._info[key] = info

    @abstractmethod
    def score(self, key: Key, now: float) -> tuple: ...

    def victim(self, now, pinned=()):
        pin = pinned if isinstance(pinned, (set, frozenset, dict)) else set(pinned)
        keys = self._keys
        sampled = len(keys) > self.exact_up_to
        if sampled:
            keys = {*self._rng.sample(keys, self.sample), *(k for k in self._pool if k in self._pos)}
        scored = [(self.score(k, now), i, k) for i, k in enumerate(keys) if k not in pin]
        if not scored:
            return _first_unpinned(self._keys, pin) if sampled else None
        best = heapq.nsmallest(self.pool_size + 1, scored) if sampled else [min(scored)]
        self._pool = [k for _, _, k in best[1:]]
        return best[0][2]

    def __contains__(self, key):
        return key in self._info

@register("eviction", "cost-aware")
class CostAware(_Scored):
    """Keeps the chunks that save the most recompute time per byte, aged by idleness: a
    chunk's value is ``recompute_s / nbytes / (1 + idle_s / half_life_s)``; the lowest goes.
    (GreedyDual-style: a chunk nobody reads loses value, so stale expensive chunks leave.)"""

    name = "cost-aware"

    def __init__(self, half_life_s: float = 600.0, seed: int = 0) -> None:
        super().__init__(seed)
        self.half_life_s = half_life_s
        self._last: dict[Key, float] = {}

    def insert(self, key, info, now):
        self._add(key, info)
        self._last[key] = now

    def access(self, key, now):
        if key in self._last:
            self._last[key] = now

    def remove(self, key):
        super().remove(key)
        self._last.pop(key, None)

    def value(self, key: Key, now: float) -> float:
        info = self._info[key]
        idle = max(now - self._last[key], 0.0)
        return info.recompute_s / max(info.nbytes, 1) / (1.0 + idle / self.half_life_s)

    def score(self, key, now):
        return (self.value(key, now),)


@register("eviction", "session-aware")
class SessionAware(EvictionPolicy):
    """Evicts whole sessions, tail chunks first: the session whose next turn is furthest
    away (predicted by ``predictor``; without one, its idle time so far) loses its last
    chunk, so what stays is always a usable prefix. A session about to resume keeps its
    chunks; shared chunks (no session) go last, least recently used first.

    Sessions are ranked, not chunks, and the ranking is kept for as long as the clock does
    not move and no session joins (evicting a whole session asks for many victims at one
    instant): O(resident sessions) per instant, a random sample of ``sample_over // 4``
    past ``sample_over`` sessions (as Redis samples), whole again when a sample runs dry."""

    name = "session-aware"
    sample_over = 256

    def __init__(self, seed: int = 0, predictor=None) -> None:
        self.predictor = predictor
        """``predictor(session, now) -> eviction rank`` (higher: evict sooner; e.g. the
        think-time model's seconds until the next turn)."""
        self._session_of: dict[Key, Hashable] = {}
        self._by_session: dict[Hashable, dict[Key, int]] = {}
        self._shared: OrderedDict[Key, None] = OrderedDict()
        self._last: dict[Hashable, float] = {}
        self._rng = random.Random(seed)
        self._ranked: list[Hashable] | None = None
        self._ranked_at: float | None = None
        self._ranked_sample = False

    def invalidate(self) -> None:
        """The predictor's view changed without the clock moving: rank again."""
        self._ranked = None

    def insert(self, key, info, now):
        self.remove(key)
        if info.session is None:
            self._shared[key] = None
            return
        self._session_of[key] = info.session
        chunks = self._by_session.get(info.session)
        if chunks is None:
            chunks = self._by_session[info.session] = {}
            self._ranked = None
        chunks[key] = info.index
        if self.predictor is None and self._last.get(info.session) != now:
            self._ranked = None
        self._last[info.session] = now

    def update(self, key, info):
        if key in self:
            self.remove(key)
            self.insert(key, info, self._last.get(info.session, 0.0))

    def share(self, key, session):
        """A chunk two sessions' chains use is no longer one session's to lose: it joins
        the shared chunks, which go last (evicting it with its first owner would cut the
        other's stored prefix at its start)."""
        owner = self._session_of.get(key)
        if owner is not None and owner != session:
            self.remove(key)
            self._shared[key] = None

    def access(self, key, now):
        if key in self._shared:
            self._shared.move_to_end(key)
            return
        s = self._session_of.get(key)
        if s is not None:
            if self.predictor is None and self._last.get(s) != now:
                self._ranked = None
            self._last[s] = now

    def remove(self, key):
        self._shared.pop(key, None)
        s = self._session_of.pop(key, None)
        if s is not None:
            chunks = self._by_session[s]
            chunks.pop(key, None)
            if not chunks:
                del self._by_session[s]

    def away(self, session: Hashable, now: float) -> float:
        if self.predictor is not None:
            return self.predictor(session, now)
        return now - self._last.get(session, now)

    def _rank(self, now: float, sample: bool) -> list[Hashable]:
        sessions = list(self._by_session)
        self._ranked_sample = sample and len(sessions) > self.sample_over
        if self._ranked_sample:
            sessions = self._rng.sample(sessions, self.sample_over // 4)
        sessions.sort(key=lambda s: self.away(s, now), reverse=True)
        self._ranked, self._ranked_at = sessions, now
        return sessions

    def _tail_of(self, order: list[Hashable], pin) -> Key | None:
        """The last unpinned chunk of the first session in ``order`` that has one;
        sessions left with no chunk drop off the front."""
        drop = 0
        for i, s in enumerate(order):
            chunks = self._by_session.get(s)
            if not chunks:
                drop += i == drop
                continue
            best = None
            for k, idx in chunks.items():
                if k not in pin and (best is None or idx > best[0]):
                    best = (idx, k)
            if best is not None:
                del order[:drop]
                return best[1]
        del order[:drop]
        return None

    def victim(self, now, pinned=()):
        pin = pinned if isinstance(pinned, (set, frozenset, dict)) else set(pinned)
        order = self._ranked if self._ranked_at == now else None
        if order is None:
            order = self._rank(now, sample=True)
        k = self._tail_of(order, pin)
        if k is None and self._ranked_sample:  # the sample ran dry: rank every session
            k = self._tail_of(self._rank(now, sample=False), pin)
        return k if k is not None else _first_unpinned(self._shared, pin)

    def __contains__(self, key):
        return key in self._session_of or key in self._shared


def eviction_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A policy instance from a name (or dotted path), or the instance itself."""
    return policy if isinstance(policy, EvictionPolicy) else make_eviction(policy)


def make_eviction(name: str, **kwargs) -> EvictionPolicy:
    from kvtier.policies.registry import resolve

    cls = resolve("eviction", name)
    return cls(**kwargs)
