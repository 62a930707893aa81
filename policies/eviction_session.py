"""Eviction policies that know what a chunk is worth: cost-aware (recompute time saved per
byte, aged by idleness) and session-aware (whole sessions, tail first, furthest next turn
first).

Registered as ``cost-aware`` and ``session-aware`` on import; ``kvtier.policies.eviction``
imports this module and re-exports its policies.
"""

from __future__ import annotations

import heapq
import random
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Hashable

from kvtier.policies.eviction_base import ChunkInfo, EvictionPolicy, Key
from kvtier.policies.eviction_base import first_unpinned as _first_unpinned
from kvtier.policies.registry import register


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
            # dict, not set: ties go by position, never by str hashes (which change per process)
            keys = dict.fromkeys([*self._rng.sample(keys, self.sample),
                                  *(k for k in self._pool if k in self._pos)])
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
            last = self._last.get(info.session, 0.0)
            self.remove(key)
            self.insert(key, info, last)

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
            if not chunks:  # a session with nothing here is forgotten (its last use too)
                del self._by_session[s]
                self._last.pop(s, None)

    def idle_s(self, session: Hashable, now: float) -> float:
        """Seconds since the session's chunks were last stored or read here."""
        return now - self._last.get(session, now)

    def away(self, session: Hashable, now: float) -> float:
        if self.predictor is not None:
            return self.predictor(session, now)
        return self.idle_s(session, now)

    def _rank(self, now: float, sample: bool) -> list[Hashable]:
        sessions = list(self._by_session)
        self._ranked_sample = sample and len(sessions) > self.sample_over
        if self._ranked_sample:
            sessions = self._rng.sample(sessions, self.sample_over // 4)
        ranks = {s: self.away(s, now) for s in sessions}
        if self._ranked_sample:  # a sample never gives up a kept session (rank < 0): the
            sessions = [s for s in sessions if ranks[s] >= 0]  # whole ranking decides those
        sessions.sort(key=ranks.__getitem__, reverse=True)
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
