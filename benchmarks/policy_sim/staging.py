"""Storing idle sessions ahead of need in the simulator, as the live engine does above the
high watermark: pre-staging into the tiers' empty space, staging ahead the GPU's next
victims, and making room from the stored ones first. The decisions are
:class:`~kvtier.policies.offload.PredictiveOffload`'s, through the simulator's
:class:`~kvtier.policies.live.LivePolicy`; the :class:`Stager` only walks the simulated
state, through the simulator's public face (:class:`StagingHost`), and keeps what is its
own: the sessions not staged yet and how long the links stay busy."""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from operator import itemgetter
from typing import Protocol

from kvtier.benchmarks.policy_sim.node import (
    KeySet,
    KnownChunks,
    Link,
    SessionState,
    SimResult,
    Store,
)
from kvtier.benchmarks.policy_sim.workloads import Workload
from kvtier.policies.cost_model import CostModel
from kvtier.policies.eviction import ChunkInfo
from kvtier.policies.live import LivePolicy
from kvtier.policies.offload import IdleSession, PredictiveOffload


class StagingHost(Protocol):
    """What the stager reads and asks of the simulator (its node's state and operations)."""

    w: Workload
    cost: CostModel
    bpt: int
    live: LivePolicy
    offload: PredictiveOffload
    gpu: Store
    tiers: list[Store]
    links: dict[str, Link]
    res: SimResult
    sessions: dict[Hashable, SessionState]
    pinned: set[Hashable]
    recent: OrderedDict[Hashable, None]
    by_session: dict[Hashable, KeySet]
    unstored: dict[Hashable, KeySet]
    infos: KnownChunks
    tiers_worth: bool

    def next_s(self, session: Hashable, now: float) -> float: ...
    def where(self, key: Hashable) -> Store | None: ...
    def count(self, d: dict, key: str, n: int = 1) -> None: ...
    def write(self, tier_index: int, key: Hashable, tokens: int, info: ChunkInfo,
              now: float) -> float: ...
    def evict_from_gpu(self, victims: list[tuple[Hashable, int]], now: float) -> float: ...


class Stager:
    """Pre-stage, stage-ahead and stored-first room making for one simulated node."""

    def __init__(self, sim: StagingHost) -> None:
        self.sim = sim
        self.unstaged = KeySet()
        """Idle sessions with GPU chunks that have no copy below yet (what a watermark
        offload may pre-stage)."""
        self.links_busy_until = -math.inf

    def next_to_leave(self, now: float, pinned: set | frozenset, used_bytes: float) -> Iterator[tuple[Hashable, int, list]]:
        """Idle sessions in the order the GPU lets them go (id, tokens held, unpinned
        chunks), as far as making room from ``used_bytes`` down to the low watermark
        reaches (:meth:`PredictiveOffload.leaving_next`)."""
        cap_tokens = int(self.sim.gpu.capacity // self.sim.bpt)
        return self.sim.offload.leaving_next(
            self._idle_in_victim_order(now, pinned), int(used_bytes // self.sim.bpt), cap_tokens, itemgetter(1))

    def _idle_in_victim_order(self, now: float, pinned: set | frozenset) -> Iterator[tuple[Hashable, int, list]]:
        for sid in self.sim.recent:
            if self.sim.sessions[sid].busy_until > now:
                continue
            keys = [k for k in self.sim.by_session.get(sid, ()) if k not in pinned]
            if keys:
                yield sid, len(keys) * self.sim.w.chunk_tokens, keys  # the GPU holds full chunks only

    def _all_stored(self, session: Hashable, pinned: set | frozenset) -> bool:
        """Every unpinned GPU chunk of ``session`` has a copy in some tier."""
        return all(k in pinned for k in self.sim.unstored.get(session, ()))

    def drop_stored_first(self, need: int, pinned: set, now: float) -> None:
        """Making room takes the next victims that are stored below already: their
        blocks go without a write on the admission path."""
        reach = self.next_to_leave(now, pinned, self.sim.gpu.used + need)
        stored = [keys for sid, _, keys in reach if self._all_stored(sid, pinned)]
        for keys in stored:
            for key in sorted(keys, key=lambda k: -self.sim.infos[k].index if k in self.sim.infos else 0):
                if self.sim.gpu.used + need <= self.sim.gpu.capacity:
                    return
                nbytes = self.sim.gpu.size(key)
                self.sim.gpu.remove(key)
                self.sim.gpu.evictions += 1
                self.sim.evict_from_gpu([(key, nbytes)], now)  # stored: a drop

    def watermark_offload(self, now: float) -> None:
        """Above the high watermark idle sessions are stored below ahead of need, keeping
        their GPU blocks (the live engine's pre-stage and stage-ahead)."""
        cap_tokens = int(self.sim.gpu.capacity // self.sim.bpt)
        used_tokens = self.sim.gpu.used // self.sim.bpt
        if used_tokens <= self.sim.offload.watermarks.high * cap_tokens:
            self.sim.live.set_leaving(set())
            return
        reach = list(self.next_to_leave(now, self.sim.pinned, self.sim.gpu.used))
        self.sim.live.set_leaving({sid for sid, _, _ in reach})
        self._prestage_into_empty_space(now, used_tokens, cap_tokens)
        self._stage_ahead(now, used_tokens, cap_tokens, reach)

    def _prestage_into_empty_space(self, now: float, used_tokens: int, cap_tokens: int) -> None:
        """Idle sessions predicted to stay away longest are stored into the tiers' empty
        space (never displacing a copy), keeping their GPU blocks."""
        if now < self.links_busy_until:
            return
        cands = []
        for sid in list(self.unstaged):
            if sid not in self.sim.by_session:
                self.unstaged.discard(sid)  # it left the GPU
                continue
            cands.append((self.sim.sessions[sid].last_end, sid))
        if len(cands) > 512:  # the longest idle are the likely candidates
            cands = heapq.nsmallest(512, cands)
        idle = []
        for _, sid in cands:
            held = sum(1 for k in self.sim.by_session[sid] if k not in self.sim.pinned)
            if not held:
                continue
            tokens = held * self.sim.w.chunk_tokens  # the GPU holds full chunks only
            idle.append(self.sim.live.idle_session(sid, tokens, tokens, now))
        names = [t.name for t in self.sim.tiers]
        # A pre-stage is speculative: it takes empty space only, never displaces a copy.
        free = {t.name: t.capacity - t.used for t in self.sim.tiers}
        busy_until = math.inf
        weights = self.sim.live.weights(now)
        for d in self.sim.offload.decide(idle, used_tokens, cap_tokens, self.sim.cost, names, free,
                                         weights=weights):
            if d.tier is None:
                self.unstaged.discard(d.session)  # no tier pays: it will be dropped
                continue
            if self.sim.links[d.tier].write_path.idle_at > now:
                busy_until = min(busy_until, self.sim.links[d.tier].write_path.idle_at)
                continue  # never queue a pre-stage ahead of reads
            busy_until = -math.inf
            # Pre-stage: write the session down now, keep it in the GPU; when its blocks
            # are needed they leave at once instead of after a write on the admission path.
            for key in [k for k in self.sim.by_session.get(d.session, ()) if self.sim.where(k) is None]:
                nbytes = self.sim.gpu.size(key)
                info = self.sim.infos.of(key, nbytes)
                self.sim.write(names.index(d.tier), key, nbytes // self.sim.bpt, info, now)
                self.sim.count(self.sim.res.decisions, f"prestage_{d.tier}")
            self.unstaged.discard(d.session)
        if busy_until < math.inf:
            # Every pick waits for a busy link: nothing to do until the first one frees.
            self.links_busy_until = busy_until

    def _stage_ahead(self, now: float, used_tokens: int, cap_tokens: int, reach: list) -> None:
        """Store the GPU's next victims (``reach``, from :meth:`next_to_leave`) before a
        turn needs their room (the live engine's stage-ahead): a full tier makes room by
        demoting its own victims, as the write on the admission path would have, and keeps
        these copies while their sessions are next to leave; a busy link is left to its
        reads."""
        if not self.sim.tiers_worth or all(link.write_path.idle_at > now for link in self.sim.links.values()):
            return
        names = [t.name for t in self.sim.tiers]

        def order():
            for sid, tokens, _ in reach:
                stored = self._all_stored(sid, self.sim.pinned)
                if stored:  # skipped: no prediction needed
                    yield IdleSession(sid, tokens, tokens, 0.0), stored
                else:
                    yield self.sim.live.idle_session(sid, tokens, tokens, now), stored

        room = {t.name: t.capacity for t in self.sim.tiers}
        idle = {name for name, link in self.sim.links.items() if link.write_path.idle_at <= now}
        for d in self.sim.offload.stage_ahead(order(), used_tokens, cap_tokens, self.sim.cost, names, room,
                                              self.sim.live.weights(now)):
            if d.tier not in idle:
                continue
            ti = names.index(d.tier)
            for key in [k for k in self.sim.unstored.get(d.session, ()) if k not in self.sim.pinned]:
                nbytes = self.sim.gpu.size(key)
                self.sim.write(ti, key, nbytes // self.sim.bpt, self.sim.infos.of(key, nbytes), now)
                self.sim.count(self.sim.res.decisions, f"stage_ahead_{d.tier}")
