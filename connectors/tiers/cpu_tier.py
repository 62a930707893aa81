"""The CPU tier: one preallocated host arena cut into fixed-size chunk slots.

A slot holds one chunk blob (full chunks fill it, tails take a whole slot), so the arena
never fragments and the hot path allocates nothing: a put copies the blob into a free slot,
an index maps key -> (slot, length). The arena is pinned (page-locked, registered with CUDA)
when CUDA is present so GPU copies from it are DMA transfers; ``close`` unregisters it, so
no pin outlives the tier. The arena is page-aligned (see ``host_buffers``), so a slot of a
page-multiple size can be written to disk with ``O_DIRECT`` as it is. When the arena is full
the least recently used chunk is evicted and handed to the eviction listeners as a view of
its slot, before the slot is written again, so a manager demotes it with no copy.

The data path uses the arena in place: :meth:`CPUTier.store_in_place` lets the caller
write a chunk straight into a free slot (the key is visible only once it is whole), and
:meth:`CPUTier.lease` hands out views of stored chunks whose slots are neither evicted nor
reused until the lease ends, so a restore reads and scatters from the arena with no copy
in between.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Collection, Hashable, Iterator, Sequence

import torch

from kvtier.connectors.tiers.base import (
    CHUNK_OVERHEAD_BYTES,
    ChunkWrite,
    PutOutcome,
    PutResult,
    Tier,
)
from kvtier.connectors.tiers.chunk_index import ChunkIndex, Evicted
from kvtier.connectors.tiers.chunk_workers import map_store
from kvtier.connectors.tiers.host_buffers import HostBuffer
from kvtier.connectors.tiers.slot_reserve import SlotReserve
from kvtier.errors import InvalidArgumentError, TierError
from kvtier.policies.eviction import ChunkInfo, EvictionPolicy, eviction_policy

log = logging.getLogger(__name__)


class CPUTier(Tier):
    """Chunk blobs in slots of one host arena of ``capacity_bytes // slot_bytes`` slots."""

    name = "cpu"

    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int,
        pin: bool | None = None,
        eviction: str | EvictionPolicy = "lru",
        reserve_slots: int = 0,
    ) -> None:
        """``reserve_slots``: slots kept free by handing the coldest chunks down in the
        background (:mod:`.slot_reserve`), where a lower tier listens; 0: a store into a
        full arena hands its victim down itself."""
        super().__init__()
        self._eviction = eviction
        if slot_bytes < 1:
            raise InvalidArgumentError(f"slot_bytes must be >= 1, got {slot_bytes}")
        num_slots = capacity_bytes // slot_bytes
        if num_slots < 1:
            raise InvalidArgumentError(
                f"the CPU tier's capacity ({capacity_bytes} bytes) holds no slot of "
                f"{slot_bytes} bytes; raise the capacity to at least one chunk"
            )
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._buffer: HostBuffer | None = HostBuffer(num_slots * slot_bytes, pin)
        self._arena: torch.Tensor | None = self._buffer.tensor[: num_slots * slot_bytes]
        self._view: memoryview | None = memoryview(self._arena.numpy()).cast("B")
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._index: ChunkIndex[int] = ChunkIndex(eviction_policy(eviction))
        self._lock = threading.Lock()
        self._leased: Counter[int] = Counter()
        """Slot -> leases on it: such a slot is never a victim and never reused."""
        self._leased_keys: Counter[str] = Counter()
        self._doomed: set[int] = set()
        self._departing: dict[str, tuple[int, int]] = {}
        """Victims being handed to the eviction listeners (key -> slot, length): out of the
        index but still readable, so a chunk on its way down is never in no tier at all."""
        """Leased slots whose chunk was deleted: freed when their last lease ends."""
        self.reserve_slots = max(0, min(reserve_slots, num_slots - 1))
        self._reserve: SlotReserve | None = None

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
            self._free = []
            self._doomed.clear()  # views handed out keep the arena's memory alive

    def _arena_view(self) -> memoryview:
        if self._view is None:
            raise TierError("the CPU tier is closed; create a new one")
        return self._view

    # --- data ------------------------------------------------------------------------
    lends_memory = True

    def store_in_place(self, writes: Sequence[ChunkWrite]) -> PutResult:
        """Write each chunk straight into a free slot (evicting the policy's victims, handed
        down first): ``write.fill(slot)`` gets a uint8 view of the slot and writes the chunk
        (e.g. :func:`~kvtier.chunk_format.encode_into`); given bytes are copied in (one copy:
        the tier's own memory is the destination). Fills run two at a time (a gather and
        its checksums release the GIL). A key becomes visible only once its chunk is whole,
        never half-written; one stored by this batch is never evicted by a later one of it.
        An error in a fill frees its slot and propagates."""
        result = PutResult()
        batch: set[str] = set()
        """Keys this batch stored (added under the lock, read by ``_take_slot`` under it)."""

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
        """(slot, length) of a held chunk, one on its way down included (under the lock)."""
        entry = self._index.get(key)
        return self._departing.get(key) if entry is None else entry

    def _take_slot(self, exclude: set[str], victims: list[Evicted[int]]) -> int | None:
        """A free slot, else the slot of the policy's victim (never a leased chunk, nor
        one in ``exclude``). The victim is out of the index and its slot is the caller's,
        unchanged until the caller has handed its bytes to the eviction listeners (after
        the lock: a demotion writes them to a lower tier straight from the arena)."""
        if self._free:
            return self._free.pop()
        if self._leased_keys:
            exclude = exclude | self._leased_keys.keys()
        for gone in self._index.evict_while(lambda: not victims, exclude):
            victims.append(gone)
            self._departing[str(gone.key)] = (gone.value, gone.size)
        return victims[0].value if victims else None

    def _keep_reserve(self) -> None:
        """Wake the reserve (started with the first store that finds a lower tier)."""
        if not self.reserve_slots or not self._eviction_listeners:
            return
        if self._reserve is None:
            with self._lock:
                if self._reserve is None and self._arena is not None:
                    self._reserve = SlotReserve(self._replenish)
        if self._reserve is not None and len(self._free) < self.reserve_slots:
            self._reserve.wake()

    def _replenish(self) -> bool:
        """Hand the policy's next victim down and free its slot, while fewer than
        ``reserve_slots`` are free; whether one was freed."""
        victims: list[Evicted[int]] = []
        with self._lock:
            arena = self._arena
            if arena is None or len(self._free) >= self.reserve_slots:
                return False
            for gone in self._index.evict_while(lambda: not victims, set(self._leased_keys)):
                victims.append(gone)
                self._departing[str(gone.key)] = (gone.value, gone.size)
            if not victims:
                return False
        self._hand_down(victims, arena)
        with self._lock:
            if self._landed(victims, victims[0].value) and self._arena is arena:
                self._free.append(victims[0].value)
        return True

    def _landed(self, victims: list[Evicted[int]], slot: int | None) -> bool:
        """The victims are handed down: they leave for good. False when a reader leased
        the slot meanwhile: it is freed when the reader lets go, and the caller takes
        another (under the lock)."""
        for gone in victims:
            self._departing.pop(str(gone.key), None)
        if slot is not None and victims and self._leased[slot]:
            self._doomed.add(slot)
            return False
        return True

    def _hand_down(self, victims: list[Evicted[int]], arena: torch.Tensor) -> None:
        """Tell the eviction listeners of each victim with a view of its bytes (valid
        during the call: the slot is not reused before it returns)."""
        view = memoryview(arena.numpy()).cast("B")
        for gone in victims:
            start = gone.value * self.slot_bytes
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
        if entry is None:  # on its way down, the slot is the writer's: it only leaves
            return self._departing.pop(key, None) is not None
        if self._leased[entry[0]]:
            self._doomed.add(entry[0])  # a reader still holds it: freed when it lets go
        else:
            self._leased.pop(entry[0], None)
            self._free.append(entry[0])
        return True

    # --- in place --------------------------------------------------------------------
    def _store_one(self, write: ChunkWrite, exclude: set[str]) -> PutOutcome:
        key, nbytes, info = write.key, write.nbytes, write.info
        while True:
            victims: list[Evicted[int]] = []
            with self._lock:
                self._arena_view()
                arena = self._arena
                assert arena is not None
                if key in self._index:
                    self._index.get(key)
                    if info is not None:
                        self._index.share(key, info.session)
                    return PutOutcome.PRESENT
                slot = None if nbytes > self.slot_bytes else self._take_slot(exclude, victims)
            self._hand_down(victims, arena)  # before the victim's slot is overwritten
            with self._lock:
                if self._landed(victims, slot):
                    break
        if slot is None:
            reason = PutOutcome.TOO_LARGE if nbytes > self.slot_bytes else PutOutcome.FULL
            self._account_put(PutResult(failed={key: reason.value}), 0, [])
            return reason
        start = slot * self.slot_bytes
        try:
            length = write.write_into(arena[start : start + self.slot_bytes])
        except BaseException:
            with self._lock:
                self._free.append(slot)
            raise
        with self._lock:
            if self._arena is not arena:
                raise TierError("the CPU tier was closed during a store; create a new one")
            raced = key in self._index  # a racing writer stored it meanwhile
            if raced:
                self._free.append(slot)
            else:
                self._index.add(key, slot, length, info, charge=self.occupancy(length))
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
        whatever ``layers`` asks: a view costs nothing; None for a miss), unverified: check them with :func:`~kvtier.chunk_format.chunk_view`.
        Until the block ends their slots are neither evicted nor reused: a delete takes
        the key out at once (new readers miss it) and frees the slot when the last lease
        on it ends, so an old reader never sees another chunk's bytes."""
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
                slot, length = entry
                self._leased[slot] += 1
                self._leased_keys[key] += 1
                held.append((slot, key))
                start = slot * self.slot_bytes
                views.append(arena[start : start + length])
        try:
            yield views
        finally:
            with self._lock:
                for slot, key in held:
                    self._leased[slot] -= 1
                    self._leased_keys[key] -= 1
                    if not self._leased_keys[key]:
                        del self._leased_keys[key]
                    if not self._leased[slot]:
                        del self._leased[slot]
                        if slot in self._doomed:
                            self._doomed.discard(slot)
                            self._free.append(slot)
            self._count_reads(len(keys), [v.numel() for v in views if v is not None])

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
        """As the arena evicts when full (handed down from the slot, leased chunks kept),
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
            for gone in victims:
                self._departing.pop(str(gone.key), None)
                if self._leased[gone.value]:
                    self._doomed.add(gone.value)  # leased while on its way down: freed on release
                else:
                    self._leased.pop(gone.value, None)
                    self._free.append(gone.value)
        return sum(self.occupancy(gone.size) for gone in victims)

    def occupancy(self, nbytes: int) -> int:
        """A chunk takes a whole slot, whatever its length."""
        return self.slot_bytes + CHUNK_OVERHEAD_BYTES

    # --- capacity --------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the chunks held (a tail counts its length, not its whole slot)."""
        with self._lock:
            return self._index.used_bytes

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def gauges(self) -> tuple[int, int]:
        """Read without the tier's lock: two ints, possibly a moment apart."""
        return len(self._index), self._index.used_bytes
