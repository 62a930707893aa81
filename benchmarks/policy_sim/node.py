"""The simulated node's parts: a tier's contents (the live tiers' :class:`ChunkIndex` under a
capacity), a tier's I/O link, a session's state, and what a run measured."""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Hashable, Iterator
from dataclasses import dataclass, field

from kvtier.connectors.tiers.chunk_index import ChunkIndex
from kvtier.policies.cost_model import TierCost
from kvtier.policies.eviction import ChunkInfo, EvictionPolicy
from kvtier.policies.load import BusyShare

_NO_PINS: frozenset = frozenset()


class KeySet(dict):
    """A set that iterates in insertion order (a plain set of keys holding strings
    iterates in an order that changes with the process's hash seed, and with it which of
    equal candidates a policy picks: runs would not repeat)."""

    def add(self, key: Hashable) -> None:
        self[key] = None

    def discard(self, key: Hashable) -> None:
        self.pop(key, None)


class KnownChunks(dict):
    """Chunk -> what the eviction policies know of it (its session and place travel with it
    down the tiers); and, until the event being replayed is over, what was known of the
    chunks whose last copy went during it: their write-back or demotion, still to come in
    it, needs it (a copy that lost its session would rank as a prefix sessions share, kept
    last)."""

    def __init__(self) -> None:
        super().__init__()
        self.let_go: dict[Hashable, ChunkInfo] = {}

    def forget(self, key: Hashable) -> None:
        """The chunk's last copy is gone (what was known of it lasts out the event)."""
        info = self.pop(key, None)
        if info is not None:
            self.let_go[key] = info

    def of(self, key: Hashable, nbytes: int) -> ChunkInfo:
        """What is known of a chunk held anywhere or let go during this event."""
        return self.get(key) or self.let_go.get(key) or ChunkInfo(nbytes)

    def event_over(self) -> None:
        self.let_go.clear()


class Store:
    """One tier in the simulation: the live tiers' :class:`ChunkIndex` (sizes, bytes held,
    the eviction policy choosing victims) under a capacity in bytes; no data."""

    def __init__(self, name: str, capacity: float, policy: EvictionPolicy) -> None:
        self.name = name
        self.capacity = capacity
        self.index: ChunkIndex[None] = ChunkIndex(policy)
        self.peak = 0
        self.evictions = 0
        self.on_remove: Callable[[Hashable], None] | None = None

    @property
    def policy(self) -> EvictionPolicy:
        return self.index.policy

    @property
    def used(self) -> int:
        return self.index.used_bytes

    def has(self, key: Hashable) -> bool:
        return key in self.index

    def size(self, key: Hashable) -> int:
        return self.index.size(key)

    def remove(self, key: Hashable) -> None:
        if self.index.pop(key) is not None and self.on_remove is not None:
            self.on_remove(key)

    def evict_while(
        self, short_of_room: Callable[[], bool], pinned: Container[Hashable], now: float
    ) -> Iterator[tuple[Hashable, int]]:
        """The index's victims while ``short_of_room()``, each (key, bytes) once it is gone."""
        for gone in self.index.evict_while(short_of_room, pinned, now):
            self.evictions += 1
            if self.on_remove is not None:
                self.on_remove(gone.key)
            yield gone.key, gone.size

    def add(
        self, key: Hashable, nbytes: int, info: ChunkInfo, now: float, pinned: Container[Hashable]
    ) -> list[tuple[Hashable, int]] | None:
        """Insert, evicting as needed; the victims, or None if it cannot fit. When every
        other chunk is pinned it over-commits (counted by the caller)."""
        if key in self.index:
            self.index.get(key, now=now)
            return []
        if nbytes > self.capacity:
            return None
        out = list(self.evict_while(lambda: self.used + nbytes > self.capacity, pinned, now))
        self.index.add(key, None, nbytes, info, now)
        self.peak = max(self.peak, self.used)
        return out


@dataclass
class Link:
    """A tier's I/O path. Reads take this path; writes too, unless the medium carries both
    directions at once (:attr:`TierCost.duplex`: PCIe, a network link), where they queue on
    a path of their own (:attr:`writes`). On a path, the transfers a turn waits for (its
    reads, the write-backs that make its room) queue behind each other, and background
    writes (demotions, copies stored ahead of need) use it only when none of those waits
    (``waited_first``, as the tiers serve them: :mod:`kvtier.io_priority`): one queued
    later goes first, after the background chunk in flight, and pushes the rest back. How
    busy the path was is what the policy's load weights read."""

    free_at: float = 0.0
    """When the transfers turns wait for, queued so far, are done."""
    background_free_at: float = 0.0
    """When the background writes queued so far are done."""
    busy: BusyShare = field(default_factory=BusyShare)
    writes: Link | None = None
    """The writes' own path on a duplex medium; None: they queue with the reads."""
    waited_first: bool = True
    """Background writes yield to the transfers turns wait for (False: one queue)."""
    _piece_s: float = 0.0
    """The last background transfer's length: a transfer that goes ahead waits for the one
    in flight (a chunk is not cut), at most this long."""
    _pushes: list[tuple[float, float]] = field(default_factory=list)
    """(start, seconds) of each transfer that went ahead of queued background writes."""

    @classmethod
    def of(cls, tier: TierCost) -> Link:
        return cls(writes=cls() if tier.duplex else None)

    @property
    def write_path(self) -> Link:
        return self.writes or self

    @property
    def idle_at(self) -> float:
        """When everything queued on this path, background writes included, is done."""
        return max(self.free_at, self.background_free_at)

    def transfer(self, start: float, seconds: float, background: bool = False) -> float:
        """Queue a transfer that can begin at ``start``; returns when it is done (for a
        background one, as of now: later transfers that go ahead push it back, see
        :meth:`landed`)."""
        if background and self.waited_first:
            begin = max(start, self.idle_at)
            self.background_free_at = begin + seconds
            self._piece_s = seconds
        else:
            begin = max(start, self.free_at)
            if self.background_free_at > begin:
                if start >= self.free_at:  # nothing ahead of it: a background chunk is going
                    begin += min(self.background_free_at - begin, self._piece_s)
                self._pushes.append((begin, seconds))
                self.background_free_at += seconds
            self.free_at = begin + seconds
        self.busy.observe(begin, seconds)
        return begin + seconds

    @property
    def mark(self) -> int:
        """Where the record of transfers that went ahead stands now (see :meth:`landed`)."""
        return len(self._pushes)

    def landed(self, done: float, mark: int) -> float:
        """When a background transfer queued at ``mark``, done at ``done`` as of then, is
        done now that later ones went ahead of it."""
        for start, seconds in self._pushes[mark:]:
            if start >= done:
                break
            done += seconds
        return done

    def wait_s(self, now: float) -> float:
        """Transfers queued ahead of one a turn waits for that starts ``now``."""
        return max(self.free_at - now, 0.0)


@dataclass(frozen=True)
class Landing:
    """When a copy written ahead of need is down: ``done`` as of its writing, later for a
    background write that transfers queued since (``mark`` on ``path``) went ahead of."""

    done: float
    path: Link | None = None
    mark: int = 0

    def at(self) -> float:
        return self.done if self.path is None else self.path.landed(self.done, self.mark)


@dataclass(frozen=True)
class TurnTime:
    """One replayed turn's time to first token, and the part of it spent queued behind
    earlier turns (what the rest of the replay's history put before it)."""

    ttft_s: float
    queued_s: float

    @property
    def served_s(self) -> float:
        """The turn's own time: its wait for write-backs, its compute and its loads."""
        return self.ttft_s - self.queued_s


@dataclass
class SimResult:
    system: str
    ttft_s: list[float] = field(default_factory=list)
    hits: dict[str, int] = field(default_factory=dict)
    """Prompt chunks served from each tier (``gpu`` included) and ``miss``."""
    read_bytes: dict[str, int] = field(default_factory=dict)
    write_bytes: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    saved_tokens: int = 0
    """Prefill tokens not computed thanks to reuse."""
    peak_gpu_bytes: int = 0
    overcommits: int = 0
    timeline: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    decisions: dict[str, int] = field(default_factory=dict)
    breakdown: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("queue_s", "write_back_s", "compute_s", "load_wait_s"), 0.0))
    """Where the TTFTs went, summed over turns: waiting for the server, for GPU victims'
    write-back, computing, and for loads the compute did not hide."""

    def summary(self) -> dict:
        xs = sorted(self.ttft_s)

        def pct(p: float) -> float:
            return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else math.nan

        total = sum(self.hits.values()) or 1
        return {
            "system": self.system,
            "turns": len(xs),
            "ttft_mean_s": sum(xs) / len(xs) if xs else math.nan,
            "ttft_p50_s": pct(0.5),
            "ttft_p99_s": pct(0.99),
            "hit_rate": {k: v / total for k, v in sorted(self.hits.items())},
            "read_bytes": dict(self.read_bytes),
            "write_bytes": dict(self.write_bytes),
            "prefill_tokens_saved": self.saved_tokens,
            "prefill_tokens_saved_frac": self.saved_tokens / max(self.prompt_tokens, 1),
            "peak_gpu_kv_bytes": self.peak_gpu_bytes,
            "overcommits": self.overcommits,
            "decisions": dict(self.decisions),
            "ttft_breakdown_mean_s": {k: v / max(len(xs), 1) for k, v in self.breakdown.items()},
        }


@dataclass
class SessionState:
    busy_until: float = -math.inf
    last_end: float | None = None
    gpu_keys: list[Hashable] = field(default_factory=list)
    context_tokens: int = 0
