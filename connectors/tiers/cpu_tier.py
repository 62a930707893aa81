"""The CPU tier: one preallocated host arena holding chunks of any size it can hold.

The arena is cut into units of ``unit_bytes`` (a page multiple: every chunk starts
page-aligned and can be written to disk with ``O_DIRECT`` as it lies); a chunk takes a
contiguous run of as many units as it needs (:mod:`.extent_allocator`: best fit, free runs
coalesced), so no model's chunk outgrows the arena's layout: only a chunk larger than the
whole arena is refused (``too_large``). The tiers of an engine or a vLLM connector use one
of their model's chunks as the unit, so a full chunk takes exactly one unit and a freed
unit always fits the next one; a ``kvtier serve`` sidecar, which stores chunks of any
model, uses small units. When no run fits, the eviction policy's victims (never a leased
chunk) leave until one does; a store that no eviction could make room for (leased chunks
in the way) fails ``full`` at once, evicting nothing.

The arena is pinned (page-locked, registered with CUDA) when CUDA is present so GPU copies
from it are DMA transfers; ``close`` unregisters it, so no pin outlives the tier. An
evicted chunk is handed to the eviction listeners as a view of its bytes before any of
its units is written again, so a manager demotes it with no copy.

The data path uses the arena in place: :meth:`CPUTier.store_in_place` lets the caller
write a chunk straight into its run (the key is visible only once it is whole), and
:meth:`CPUTier.lease` hands out views of stored chunks whose units are neither evicted nor
reused until the lease ends, so a restore reads and scatters from the arena with no copy
in between.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections import Counter
from collections.abc import Collection, Hashable, Iterator, Sequence

import torch

from kvtier.connectors.tiers.arena_compaction import Occupied, cheapest_stretch
from kvtier.connectors.tiers.base import (
    CHUNK_OVERHEAD_BYTES,
    ChunkWrite,
    PutOutcome,
    PutResult,
    Tier,
)
from kvtier.connectors.tiers.chunk_index import ChunkIndex, Evicted
from kvtier.connectors.tiers.chunk_workers import map_store
from kvtier.connectors.tiers.extent_allocator import Extent, ExtentAllocator, largest_gap
from kvtier.connectors.tiers.host_buffers import HostBuffer
from kvtier.connectors.tiers.slot_reserve import SlotReserve
from kvtier.errors import InvalidArgumentError, TierError
from kvtier.policies.eviction import ChunkInfo, EvictionPolicy, eviction_policy

log = logging.getLogger(__name__)


class CPUTier(Tier):
    """Chunk blobs in contiguous runs of ``unit_bytes`` units of one host arena."""

    name = "cpu"

    def __init__(
        self,
        capacity_bytes: int,
        unit_bytes: int,
        pin: bool | None = None,
        eviction: str | EvictionPolicy = "lru",
        reserve_units: int = 0,
    ) -> None:
        """``unit_bytes``: the allocation unit (a page multiple for page-aligned chunks;
        one full chunk where the chunks' size is known). ``reserve_units``: units kept
        free by handing the coldest chunks down in the background (:mod:`.slot_reserve`),
        where a lower tier listens; 0: a store into a full arena hands its victims down
        itself."""
        super().__init__()
        self._eviction = eviction
        if unit_bytes < 1:
            raise InvalidArgumentError(f"unit_bytes must be >= 1, got {unit_bytes}")
        num_units = capacity_bytes // unit_bytes
        if num_units < 1:
            raise InvalidArgumentError(
                f"the CPU tier's capacity ({capacity_bytes} bytes) holds no unit of "
                f"{unit_bytes} bytes; raise the capacity to at least one chunk"
            )
        self.unit_bytes = unit_bytes
        self.num_units = num_units
        self._buffer: HostBuffer | None = HostBuffer(num_units * unit_bytes, pin)
        self._arena: torch.Tensor | None = self._buffer.tensor[: num_units * unit_bytes]
        self._view: memoryview | None = memoryview(self._arena.numpy()).cast("B")
        self._extents = ExtentAllocator(num_units)
        self._index: ChunkIndex[int] = ChunkIndex(eviction_policy(eviction))
        """key -> (first unit, length)."""
        self._lock = threading.Lock()
        self._leased: Counter[int] = Counter()
        """First unit -> leases on that chunk: it is never a victim and never reused."""
        self._leased_keys: Counter[str] = Counter()
        self._doomed: set[int] = set()
        """Extents whose chunk left (deleted, evicted) while leased: freed when their last
        lease ends."""
        self._departing: dict[str, tuple[int, int]] = {}
        """Victims being handed to the eviction listeners (key -> first unit, length): out
        of the index but still readable, so a chunk on its way down is never in no tier."""
        self._filling: set[int] = set()
        """Extents a writer is filling."""
        self.moved_bytes = 0
        """Bytes copied within the arena to join free holes into a run (compaction)."""
        self.reserve_units = max(0, min(reserve_units, num_units - 1))
        self._reserve: SlotReserve | None = None

    @property
    def slot_bytes(self) -> int:
        """The allocation unit, under the name it had when a chunk took one fixed slot."""
        return self.unit_bytes

    @property
    def pinned(self) -> bool:
        """Whether the arena is page-locked and registered with CUDA (DMA to the GPU)."""
        return self._buffer is not None and self._buffer.pinned

    def close(self) -> None:
        """Unpin and free the arena; the tier holds nothing afterwards."""
        if self._reserve is not None:
            self._reserve.close()
        with self._lock:
            if self._arena is None:
                return
            if self._buffer is not None:
                self._buffer.close()
            self._buffer = None
            if self._view is not None:
                self._view.release()
            self._view = None
            self._arena = None
            self._index = ChunkIndex(self._index.policy)
            self._extents = ExtentAllocator(0)
            self._doomed.clear()  # views handed out keep the arena's memory alive
            self._filling.clear()

    def _arena_view(self) -> memoryview:
        if self._view is None:
            raise TierError("the CPU tier is closed; create a new one")
        return self._view

    def units_for(self, nbytes: int) -> int:
        """Units a chunk of ``nbytes`` takes."""
        return max(1, -(-nbytes // self.unit_bytes))

    def _free(self, start: int) -> None:
        """Give an extent back (under the lock; nothing to give once closed)."""
        if self._arena is not None:
            self._extents.give(start)

    # --- data ------------------------------------------------------------------------
    lends_memory = True

    def store_in_place(self, writes: Sequence[ChunkWrite]) -> PutResult:
        """Write each chunk straight into a free run of the arena (evicting the policy's
        victims, handed down first): ``write.fill(run)`` gets a uint8 view of the run and
        writes the chunk (e.g. :func:`~kvtier.chunk_format.encode_into`); given bytes are
        copied in (one copy: the tier's own memory is the destination). Fills run two at a
        time (a gather and its checksums release the GIL). A key becomes visible only once
        its chunk is whole, never half-written; one stored by this batch is never evicted
        by a later one of it. An error in a fill frees its run and propagates."""
        result = PutResult()
        batch: set[str] = set()
        """Keys this batch stored (added under the lock, read by ``_evict_for`` under it)."""

        def one(write: ChunkWrite) -> PutOutcome | str:
            reason = None if write.key in self else write.admission_error()
            if reason is not None:
                self.stats.count_error(reason.split(":")[0])
                return reason
            return self._store_one(write, batch)

        parallel = len(writes) > 1 and all(w.fill is not None for w in writes)
        outcomes = map_store(one, writes) if parallel else [one(w) for w in writes]
        self._keep_reserve()
        for write, outcome in zip(writes, outcomes, strict=True):
            if outcome is PutOutcome.STORED:
                result.stored.append(write.key)
            elif outcome is PutOutcome.PRESENT:
                result.present.append(write.key)
            else:
                result.failed[write.key] = getattr(outcome, "value", outcome)
        return result

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._index or key in self._departing

    def _entry(self, key: str) -> tuple[int, int] | None:
        """(first unit, length) of a held chunk, one on its way down included (under the
        lock)."""
        entry = self._index.get(key)
        return self._departing.get(key) if entry is None else entry

    # --- room ------------------------------------------------------------------------
    def _place(self, units: int) -> int | None:
        """A run of ``units`` units for a writer: the best-fitting free run, else one made
        by moving chunks out of the way when the free units would hold it; None when
        neither does (under the lock)."""
        start = self._extents.take(units)
        if start is None and self._extents.free_units >= units:
            start = self._compact(units)
        if start is not None:
            self._filling.add(start)
        return start

    def _evict_for(self, units: int, exclude: set[str]) -> list[Evicted[int]]:
        """The policy's victims (never a leased chunk, nor one in ``exclude``) to hand
        down so that ``units`` units come free, at least one; none when no eviction could
        make a run that long (leased chunks, writes and hand-downs in the way). They are
        out of the index; their units stay theirs until handed down (under the lock)."""
        if self._leased_keys:
            exclude = exclude | self._leased_keys.keys()
        if not self._could_fit(units, exclude):
            return []
        victims: list[Evicted[int]] = []
        freed = [self._extents.free_units]

        def short() -> bool:
            return not victims or freed[0] < units

        for gone in self._index.evict_while(short, exclude):
            victims.append(gone)
            self._departing[str(gone.key)] = (gone.value, gone.size)
            freed[0] += self._extents.units_at(gone.value)
        return victims

    def _could_fit(self, units: int, exclude: Collection[str]) -> bool:
        """Whether evicting or moving every chunk it may would leave a run of ``units``:
        the extents nothing frees now (leased or excluded chunks, runs being filled, chunks
        on their way down, doomed ones) leave a gap that large. Else a store evicts
        nothing."""
        pinned = [self._extents.extent_at(s) for s in (*self._filling, *self._doomed)]
        pinned += [Extent(first, self.units_for(length))
                   for first, length in self._departing.values()]
        for key in exclude:
            entry = self._index.get(key, touch=False)
            if entry is not None:
                pinned.append(self._extents.extent_at(entry[0]))
        return largest_gap(self._extents.total_units, pinned) >= units

    def _compact(self, units: int) -> int | None:
        """Join free holes into a run of ``units`` units by sliding the chunks between them
        together (:mod:`.arena_compaction`: the stretch that copies least); None when no
        stretch free of pinned chunks holds that many free units. A chunk moves only while
        no reader holds it and its key never misses: the copy and the index's new place
        happen under the lock. Under the lock."""
        arena = self._arena
        if arena is None:
            return None
        keys = {first: key for key, first in self._index.values().items()}
        occupied = [Occupied(e, e.start in keys and not self._leased[e.start])
                    for e in self._extents.taken()]
        stretch = cheapest_stretch(self._extents.total_units, occupied, units)
        if stretch is None:
            return None
        base, cursor = arena.data_ptr(), stretch.start
        for extent in stretch.chunks:
            if extent.start > cursor:  # slide it down over the free units before it
                key = keys[extent.start]
                length = self._index.size(key)
                ctypes.memmove(base + cursor * self.unit_bytes,
                               base + extent.start * self.unit_bytes, length)
                self._extents.give(extent.start)
                self._extents.claim(Extent(cursor, extent.units))
                self._index.move(key, cursor)
                self.moved_bytes += length
            cursor += extent.units
        self._extents.claim(Extent(cursor, units))
        return cursor

    def _let_go(self, victims: list[Evicted[int]]) -> None:
        """Victims whose extents stayed theirs while handed down leave: freed, or doomed
        where a reader leased one meanwhile (under the lock)."""
        for gone in victims:
            self._departing.pop(str(gone.key), None)
            if self._leased[gone.value]:
                self._doomed.add(gone.value)
            else:
                self._free(gone.value)

    def _keep_reserve(self) -> None:
        """Wake the reserve (started with the first store that finds a lower tier)."""
        if not self.reserve_units or not self._eviction_listeners:
            return
        if self._reserve is None:
            with self._lock:
                if self._reserve is None and self._arena is not None:
                    self._reserve = SlotReserve(self._replenish)
        if self._reserve is not None and self._extents.free_units < self.reserve_units:
            self._reserve.wake()

    def _replenish(self) -> bool:
        """Hand the policy's next victim down and free its units, while fewer than
        ``reserve_units`` are free; whether one was freed."""
        victims: list[Evicted[int]] = []
        with self._lock:
            arena = self._arena
            if arena is None or self._extents.free_units >= self.reserve_units:
                return False
            for gone in self._index.evict_while(lambda: not victims, set(self._leased_keys)):
                victims.append(gone)
                self._departing[str(gone.key)] = (gone.value, gone.size)
            if not victims:
                return False
        self._hand_down(victims, arena)
        with self._lock:
            if self._arena is arena:
                self._let_go(victims)
        return True

    def _hand_down(self, victims: list[Evicted[int]], arena: torch.Tensor) -> None:
        """Tell the eviction listeners of each victim with a view of its bytes (valid
        during the call: its units are not reused before it returns)."""
        view = memoryview(arena.numpy()).cast("B")
        for gone in victims:
            start = gone.value * self.unit_bytes
            self._notify_evicted(str(gone.key), view[start : start + gone.size], gone.info)

    def share(self, keys: Sequence[str], session: Hashable) -> None:
        with self._lock:
            for key in keys:
                self._index.share(key, session)

    def _count_reads(self, asked: int, hit_sizes: list[int], corrupt: int = 0) -> None:
        with self.stats.lock:
            self.stats.gets += asked
            self.stats.hits += len(hit_sizes)
            self.stats.misses += asked - len(hit_sizes)
            self.stats.bytes_read += sum(hit_sizes)
            self.stats.corrupt += corrupt

    def _drop(self, key: str) -> bool:
        entry = self._index.pop(key)
        if entry is None:  # on its way down, its units are the evictor's: it only leaves
            return self._departing.pop(key, None) is not None
        if self._leased[entry[0]]:
            self._doomed.add(entry[0])  # a reader still holds it: freed when it lets go
        else:
            self._free(entry[0])
        return True

    # --- in place --------------------------------------------------------------------
    def _store_one(self, write: ChunkWrite, exclude: set[str]) -> PutOutcome:
        key, nbytes, info = write.key, write.nbytes, write.info
        units = self.units_for(nbytes)
        if units > self.num_units:  # larger than the whole arena: no eviction makes room
            self._account_put(PutResult(failed={key: PutOutcome.TOO_LARGE.value}), 0, [])
            return PutOutcome.TOO_LARGE
        while True:
            with self._lock:
                self._arena_view()
                arena = self._arena
                assert arena is not None
                if key in self._index:
                    self._index.get(key)
                    if info is not None:
                        self._index.share(key, info.session)
                    return PutOutcome.PRESENT
                start = self._place(units)
                victims = [] if start is not None else self._evict_for(units, exclude)
            if start is not None:
                return self._fill(write, Extent(start, units), arena, exclude)
            if not victims:
                self._account_put(PutResult(failed={key: PutOutcome.FULL.value}), 0, [])
                return PutOutcome.FULL
            self._hand_down(victims, arena)  # before any of the victims' units is reused
            with self._lock:
                if self._arena is arena:
                    self._let_go(victims)

    def _fill(self, write: ChunkWrite, run: Extent, arena: torch.Tensor,
              exclude: set[str]) -> PutOutcome:
        """Write the chunk into its run, then index it in the units it took (the rest of
        the run is free again)."""
        key = write.key
        start = run.start * self.unit_bytes
        try:
            length = write.write_into(arena[start : start + run.units * self.unit_bytes])
        except BaseException:
            with self._lock:
                self._filling.discard(run.start)
                self._free(run.start)
            raise
        with self._lock:
            self._filling.discard(run.start)
            if self._arena is not arena:
                raise TierError("the CPU tier was closed during a store; create a new one")
            raced = key in self._index  # a racing writer stored it meanwhile
            if raced:
                self._free(run.start)
            else:
                self._extents.shrink(run.start, min(run.units, self.units_for(length)))
                self._index.add(key, run.start, length, write.info,
                                charge=self.occupancy(length))
                exclude.add(key)
        if raced:
            return PutOutcome.PRESENT
        self._account_put(PutResult(stored=[key]), length, [])
        return PutOutcome.STORED

    @contextlib.contextmanager
    def lease(
        self, keys: Sequence[str], layers: tuple[int, int] | None = None, background: bool = False
    ) -> Iterator[list[torch.Tensor | None]]:
        """Views of the stored chunks in the arena (uint8, each exactly its whole chunk,
        whatever ``layers`` asks: a view costs nothing; None for a miss), unverified:
        check them with :func:`~kvtier.chunk_format.chunk_view`. Until the block ends
        their units are neither evicted nor reused: a delete takes the key out at once
        (new readers miss it) and frees the units when the last lease on them ends, so an
        old reader never sees another chunk's bytes."""
        views: list[torch.Tensor | None] = []
        held: list[tuple[int, str]] = []
        with self._lock:
            self._arena_view()
            arena = self._arena
            assert arena is not None
            # Touched last to first: a chain read head to tail leaves its head the most
            # recently used, so a recency policy gives up its tail first (what stays is
            # a prefix a restore can use), not its head.
            entries = [self._entry(key) for key in reversed(keys)][::-1]
            for key, entry in zip(keys, entries, strict=True):
                if entry is None:
                    views.append(None)
                    continue
                first, length = entry
                self._leased[first] += 1
                self._leased_keys[key] += 1
                held.append((first, key))
                start = first * self.unit_bytes
                views.append(arena[start : start + length])
        try:
            yield views
        finally:
            with self._lock:
                for first, key in held:
                    self._release_lease(first, key)
            self._count_reads(len(keys), [v.numel() for v in views if v is not None])

    def _release_lease(self, first: int, key: str) -> None:
        """One lease on a chunk ends; a doomed chunk's units are freed with its last one
        (under the lock)."""
        self._leased[first] -= 1
        self._leased_keys[key] -= 1
        if not self._leased_keys[key]:
            del self._leased_keys[key]
        if not self._leased[first]:
            del self._leased[first]
            if first in self._doomed:
                self._doomed.discard(first)
                self._free(first)

    def contains_prefix(self, keys: Sequence[str]) -> int:
        with self._lock:
            if not self._departing:
                return self._index.leading_present(keys)
            n = 0
            for key in keys:
                if key not in self._index and key not in self._departing:
                    break
                n += 1
            return n

    def stored_sizes(self, keys: Sequence[str]) -> list[int | None]:
        with self._lock:
            return [self._index.size(k) if k in self._index else None for k in keys]

    def delete(self, keys: Sequence[str]) -> int:
        with self._lock:
            return sum(self._drop(key) for key in keys)

    @property
    def eviction(self) -> EvictionPolicy:
        return self._index.policy

    def chunk_info(self, key: str) -> ChunkInfo | None:
        with self._lock:
            return self._index.info(key)

    # --- tenants ---------------------------------------------------------------------
    def namespace_held(self, namespace: str, keys: Sequence[str] = ()) -> tuple[int, set[str]]:
        with self._lock:
            return self._index.namespaces.held(namespace, keys)

    def namespace_bytes(self) -> dict[str, int]:
        return self._index.namespaces.snapshot()  # a dict copy: no lock (see Tier.gauges)

    def evict_namespace(self, namespace: str, need: int, exclude: Collection[str] = ()) -> int:
        """As the arena evicts when full (handed down from the arena, leased chunks kept),
        but only ``namespace``'s coldest chunks."""
        victims: list[Evicted[int]] = []
        with self._lock:
            self._arena_view()
            arena = self._arena
            assert arena is not None
            skip = set(exclude) | self._leased_keys.keys()
            for gone in self._index.evict_namespace(namespace, need, skip):
                victims.append(gone)
                self._departing[str(gone.key)] = (gone.value, gone.size)
        self._hand_down(victims, arena)
        with self._lock:
            self._let_go(victims)
        return sum(self.occupancy(gone.size) for gone in victims)

    def occupancy(self, nbytes: int) -> int:
        """A chunk takes whole units (and an index entry), whatever its length."""
        return self.units_for(nbytes) * self.unit_bytes + CHUNK_OVERHEAD_BYTES

    # --- capacity --------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.num_units * self.unit_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the chunks held (a chunk counts its length, not its whole units)."""
        with self._lock:
            return self._index.used_bytes

    @property
    def free_units(self) -> int:
        with self._lock:
            return self._extents.free_units

    @property
    def free_bytes(self) -> int:
        """Bytes in free units (not all of it in one run)."""
        return self.free_units * self.unit_bytes

    @property
    def largest_free_run(self) -> int:
        """Units of the largest free run: the largest chunk a store finds room for without
        evicting."""
        with self._lock:
            return self._extents.largest_run

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def gauges(self) -> tuple[int, int]:
        """Read without the tier's lock: two ints, possibly a moment apart."""
        return len(self._index), self._index.used_bytes
