"""The one interface every storage tier implements (CPU arena, NVMe directory, Redis).

A tier holds chunks (see ``kvtier.chunk_format``) under storage keys and has one read and
one write, both in memory it provides:

- :meth:`Tier.lease` lends the stored bytes of each chunk (a view of the CPU arena's slot,
  a staging buffer a file or a Redis reply was read into), valid until the block ends.
  They are *unverified*: the tier stack checks them once (:class:`~.lent_chunk.LentChunk`).
- :meth:`Tier.store_in_place` stores a batch of :class:`ChunkWrite`, each filled straight
  into the tier's memory (an arena slot) or into a staging buffer the tier writes from, or
  given as bytes that already exist. Each chunk is stored or said, per key, why not:
  nothing is dropped silently.

Every batch call is one round trip where the medium allows it. What a tier can do beyond
that is declared (``lends_memory``, ``reads_in_background``), never probed. Blob reads and
writes for callers that hold bytes are built on these two in :mod:`.blobs`. Tiers are
thread-safe: the transfer engine calls them from worker threads.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvtier.chunk_format import byte_view
from kvtier.connectors.tiers.chunk_checks import admission_error
from kvtier.kv_codecs import Codec
from kvtier.policies.eviction import ChunkInfo

if TYPE_CHECKING:
    from kvtier.connectors.tiers.host_buffers import StagingPool
    from kvtier.connectors.tiers.lent_chunk import ReadingBuffer

Blob = bytes | bytearray | memoryview
EvictionListener = Callable[[str, "Blob | None", "ChunkInfo | None"], None]
"""Called for each chunk a tier evicts, so a manager can demote it: its key, its bytes (None
where the tier cannot hand them over cheaply) and the ``ChunkInfo`` it was written with
(session, place; None if none), which the tier below ranks it by. The blob may be a view
of the tier's memory (the CPU arena's slot), valid only during the call: a listener that
keeps the bytes copies them."""


CHUNK_OVERHEAD_BYTES = 512
"""What a stored chunk costs beyond its bytes in any tier: its index entry, its eviction
policy's node and its key (Python objects of a few hundred bytes), charged to quotas."""


class PutOutcome(str, enum.Enum):
    """What storing one chunk did (a failure's reason starts with its value)."""

    STORED = "stored"
    PRESENT = "present"
    """Already stored (one version per key), not rewritten."""
    FULL = "full"
    TOO_LARGE = "too_large"
    INVALID = "invalid"


Fill = Callable[[torch.Tensor], int]
"""Writes one chunk into a 1-D uint8 host tensor and returns its length."""


@dataclass(frozen=True)
class ChunkWrite:
    """One chunk to store: its key, at most ``nbytes`` bytes, and where they come from:
    ``fill`` writes them into memory the tier provides (e.g.
    :func:`~kvtier.chunk_format.encode_into` gathering KV out of the pool), or ``data``
    holds them already (a request body, a chunk on its way down a tier). ``info`` (its
    session and position) feeds the tier's eviction policy."""

    key: str
    nbytes: int
    fill: Fill | None = None
    data: Blob | None = None
    info: ChunkInfo | None = None

    def __post_init__(self) -> None:
        if (self.fill is None) == (self.data is None):
            raise ValueError("a ChunkWrite has either fill or data")

    @classmethod
    def of_blob(cls, key: str, blob: Blob, info: ChunkInfo | None = None) -> ChunkWrite:
        return cls(key, memoryview(blob).nbytes, data=blob, info=info)

    def admission_error(self) -> str | None:
        """Why the given bytes may not be stored under the key (header, names, length:
        no checksum pass), or None; a fill is checked by its writer."""
        return None if self.data is None else admission_error(self.key, self.data)

    def write_into(self, dest: torch.Tensor) -> int:
        """Put the chunk into ``dest`` (uint8, at least ``nbytes``); returns its length."""
        if self.fill is not None:
            return self.fill(dest)
        assert self.data is not None
        dest[: self.nbytes].copy_(byte_view(self.data))  # torch's copy uses every core
        return self.nbytes

    @contextlib.contextmanager
    def bytes_from(self, staging: StagingPool) -> Iterator[memoryview]:
        """The chunk's bytes for a tier that writes from host memory (a file, a socket):
        the given bytes as they are, or a staging buffer filled, given back after."""
        if self.data is not None:
            view = memoryview(self.data)
            yield view if view.format == "B" and view.ndim == 1 else view.cast("B")
            return
        with staging.borrowed(self.nbytes) as buf:
            yield memoryview(buf[: self.write_into(buf)].numpy())


def blob_writes(chunks: Mapping[str, Blob], info: Mapping[str, ChunkInfo] | None = None
                ) -> list[ChunkWrite]:
    """A write for each blob (``info`` per key where given)."""
    return [ChunkWrite.of_blob(k, b, info.get(k) if info else None) for k, b in chunks.items()]


def known_info(tiers: Sequence[Tier], key: str) -> ChunkInfo | None:
    """What the first of ``tiers`` that kept anything says of a chunk."""
    for tier in tiers:
        info = tier.chunk_info(key)
        if info is not None:
            return info
    return None


@dataclass
class PutResult:
    stored: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    """Already stored (content-addressed: the same key is the same bytes), not rewritten."""
    failed: dict[str, str] = field(default_factory=dict)
    """key -> why it was not stored (``full``, ``too_large``, ``io_error: ...``, ``unavailable``)."""

    @property
    def ok(self) -> bool:
        return not self.failed

    def outcome(self, key: str) -> PutOutcome | str:
        """What storing ``key`` did: ``STORED``, ``PRESENT``, or why it failed."""
        if key in self.failed:
            return self.failed[key]
        return PutOutcome.STORED if key in self.stored else PutOutcome.PRESENT


@dataclass
class TierStats:
    """Counters every tier keeps (exported as Prometheus metrics by the service)."""

    puts: int = 0
    bytes_written: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    evictions: int = 0
    corrupt: int = 0
    writes_held: int = 0
    """Background write batches that waited for waited-for transfers (io_priority)."""
    write_held_s: float = 0.0
    """How long they waited, summed."""
    errors: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count_held(self, waited_s: float | None) -> None:
        """A background write batch waited ``waited_s`` (None: it did not wait)."""
        if waited_s is not None:
            with self.lock:
                self.writes_held += 1
                self.write_held_s += waited_s

    def count_error(self, kind: str) -> None:
        with self.lock:
            self.errors[kind] = self.errors.get(kind, 0) + 1

    def as_dict(self) -> dict[str, object]:
        with self.lock:
            return {
                "puts": self.puts,
                "bytes_written": self.bytes_written,
                "gets": self.gets,
                "hits": self.hits,
                "misses": self.misses,
                "bytes_read": self.bytes_read,
                "evictions": self.evictions,
                "corrupt": self.corrupt,
                "writes_held": self.writes_held,
                "write_held_s": self.write_held_s,
                "errors": dict(self.errors),
            }


class Tier(ABC):
    """A key -> chunk store with batch operations that lend memory (see the module)."""

    name: str = "tier"
    lends_memory: bool = False
    """``store_in_place`` fills the tier's own memory (no staging buffer in between)."""
    reads_in_background: bool = False
    """``lease(background=True)`` lends whole chunks while their later layers are read."""

    def __init__(self) -> None:
        self.codec = Codec.NONE
        """How the tier stack encodes the chunks it stores here (``tiers.<tier>_codec``;
        the tier itself holds whatever bytes it is given)."""
        self.stats = TierStats()
        self._eviction_listeners: list[EvictionListener] = []

    # --- data -----------------------------------------------------------------------
    @abstractmethod
    def store_in_place(self, writes: Sequence[ChunkWrite]) -> PutResult:
        """Store every chunk, or report per key why not (``full``, ``too_large``,
        ``invalid: ...``, ``io_error: ...``, ``unavailable``). A key stored already is
        ``present``, not rewritten (its recency refreshed, its ``info`` session added).
        An error a ``fill`` raises is the caller's: whatever it took is given back and the
        error propagates."""

    @abstractmethod
    def lease(
        self, keys: Sequence[str], layers: tuple[int, int] | None = None, background: bool = False
    ) -> contextlib.AbstractContextManager[list[torch.Tensor | ReadingBuffer | None]]:
        """Each stored chunk as a 1-D uint8 tensor of exactly one chunk (None: a miss),
        *unverified*, in memory that stays the chunk's until the block ends. With
        ``layers`` a tier may lend the whole chunk or one holding only those layers (its
        own header, the writer's checksums). ``background`` (whole chunks, where
        ``reads_in_background``): chunks may be lent as :class:`ReadingBuffer` while their
        later layers are still read."""

    def share(self, keys: Sequence[str], session: Hashable) -> None:  # noqa: B027 - optional hook
        """``session``'s chain uses these stored chunks too (they were not written again);
        a tier that evicts by session keeps them for both. Default: nothing to do."""

    def chunk_info(self, key: str) -> ChunkInfo | None:
        """What the writer of a stored chunk said of it (session, place), for a copy made
        of it elsewhere (a promotion) to be ranked as this one is. Default: nothing kept."""
        return None

    @abstractmethod
    def contains_prefix(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are stored (one round trip)."""

    def contains_each(self, keys: Sequence[str]) -> list[bool]:
        """Whether each of ``keys`` is stored, prefix or not. Tiers with a round trip per
        call answer all of them in one."""
        return [self.contains_prefix([k]) > 0 for k in keys]

    def stored_sizes(self, keys: Sequence[str]) -> list[int | None]:
        """Each stored chunk's bytes as the tier's index knows them, without reading it, so
        a reader can budget a read before it makes it (None: not stored, or a tier that
        knows no sizes)."""
        return [None] * len(keys)

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> int:
        """Remove keys; returns how many were present."""

    # --- capacity ---------------------------------------------------------------------
    @property
    @abstractmethod
    def capacity_bytes(self) -> int | None:
        """Bytes this tier may hold (None: bounded only by the medium or the server)."""

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @abstractmethod
    def __len__(self) -> int:
        """Chunks stored."""

    def gauges(self) -> tuple[int, int]:
        """(chunks, bytes) held, for metrics and stats: cheap, never a scan and never a wait
        on a lock a transfer holds (a value a moment old is fine). Tiers whose ``len`` or
        ``used_bytes`` is not cheap override it."""
        return len(self), self.used_bytes

    # --- tenants ----------------------------------------------------------------------
    def occupancy(self, nbytes: int) -> int:
        """What a chunk of ``nbytes`` takes in this tier, all told: what a tenant's quota is
        charged for it (a chunk costs more than its bytes: an index entry, an eviction
        node, its key; a fixed slot; whole disk blocks). Tiers override it."""
        return nbytes + CHUNK_OVERHEAD_BYTES

    def namespace_held(self, namespace: str, keys: Sequence[str] = ()) -> tuple[int, set[str]]:
        """Bytes ``namespace`` (a tenant) holds here, and which of ``keys`` it holds:
        counters kept as chunks come and go (see :mod:`.namespace_usage`)."""
        return 0, set()

    def namespace_bytes(self) -> dict[str, int]:
        """namespace -> bytes held here (per-tenant gauges; never a scan)."""
        return {}

    def evict_namespace(self, namespace: str, need: int, exclude: Collection[str] = ()) -> int:
        """Evict ``namespace``'s least recently used chunks (none in ``exclude``) until
        ``need`` bytes are free, handing them to the eviction listeners as the tier's own
        evictions are (a quota pushes a tenant's KV down, not out). Returns bytes freed."""
        return 0

    @property
    def eviction(self) -> Any:
        """The :class:`~kvtier.policies.eviction.EvictionPolicy` choosing this tier's
        victims, or None where the backing store evicts by itself (Redis)."""
        return None

    # --- eviction hook ----------------------------------------------------------------
    def add_eviction_listener(self, listener: EvictionListener) -> None:
        self._eviction_listeners.append(listener)

    def _account_put(
        self, result: PutResult, written: int,
        evicted: Sequence[tuple[str, Blob | None, ChunkInfo | None]],
    ) -> PutResult:
        """Count a finished put (stored bytes, failures by kind) and tell the eviction
        listeners what it displaced; call after the tier's lock is released."""
        with self.stats.lock:
            self.stats.puts += len(result.stored)
            self.stats.bytes_written += written
        for reason in result.failed.values():
            self.stats.count_error(reason.split(":")[0])
        for key, blob, info in evicted:
            self._notify_evicted(key, blob, info)
        return result

    def _notify_evicted(self, key: str, blob: Blob | None, info: ChunkInfo | None = None) -> None:
        with self.stats.lock:
            self.stats.evictions += 1
        for listener in self._eviction_listeners:
            listener(key, blob, info)

    def close(self) -> None:  # noqa: B027 - optional hook; most tiers hold nothing to release
        """Release resources (threads, connections, pinned memory)."""

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
