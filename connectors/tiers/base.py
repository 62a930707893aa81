"""The one interface every storage tier implements (CPU arena, NVMe directory, Redis).

Tiers store opaque chunk blobs (see ``kvtier.chunk_format``) under hex keys. Every batch
call is one round trip where the medium allows it. A ``put`` either stores each chunk or
says, per key, why it did not — nothing is dropped silently. A ``get`` returns ``None`` for
a miss; a chunk found corrupt is deleted and reported as a miss (the caller recomputes).
Tiers are thread-safe: the transfer engine calls them from worker threads.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Blob = bytes | bytearray | memoryview
EvictionListener = Callable[[str, "Blob | None"], None]
"""Called with (key, blob or None) for each chunk a tier evicts, so a manager can demote it.
The blob may be a view of the tier's memory (the CPU arena's slot), valid only during the
call: a listener that keeps the bytes copies them."""


CHUNK_OVERHEAD_BYTES = 512
"""What a stored chunk costs beyond its bytes in any tier: its index entry, its eviction
policy's node and its key (Python objects of a few hundred bytes), charged to quotas."""


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
    errors: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

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
                "errors": dict(self.errors),
            }


class Tier(ABC):
    """A key -> chunk-blob store with batch operations."""

    name: str = "tier"

    def __init__(self) -> None:
        self.stats = TierStats()
        self._eviction_listeners: list[EvictionListener] = []

    # --- data -----------------------------------------------------------------------
    @abstractmethod
    def put(self, chunks: Mapping[str, Blob], info: Mapping[str, Any] | None = None) -> PutResult:
        """Store every chunk, or report per key why not. Existing keys are not rewritten.
        ``info`` (a :class:`~kvtier.policies.eviction.ChunkInfo` per key: its session and
        position) feeds the tier's eviction policy where the tier evicts by itself."""

    def share(self, keys: Sequence[str], session: Hashable) -> None:  # noqa: B027 - optional hook
        """``session``'s chain uses these stored chunks too (they were not written again);
        a tier that evicts by session keeps them for both. Default: nothing to do."""

    @abstractmethod
    def get(self, keys: Sequence[str], layers: tuple[int, int] | None = None) -> list[bytes | None]:
        """Blobs in key order (``None`` = miss). With ``layers=(start, end)`` each blob is a
        valid chunk holding only those layers (read as a byte range where the tier can)."""

    @abstractmethod
    def contains_prefix(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are stored (one round trip)."""

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
        self, result: PutResult, written: int, evicted: Sequence[tuple[str, Blob | None]]
    ) -> PutResult:
        """Count a finished put (stored bytes, failures by kind) and tell the eviction
        listeners what it displaced; call after the tier's lock is released."""
        with self.stats.lock:
            self.stats.puts += len(result.stored)
            self.stats.bytes_written += written
        for reason in result.failed.values():
            self.stats.count_error(reason.split(":")[0])
        for key, blob in evicted:
            self._notify_evicted(key, blob)
        return result

    def _notify_evicted(self, key: str, blob: Blob | None) -> None:
        with self.stats.lock:
            self.stats.evictions += 1
        for listener in self._eviction_listeners:
            listener(key, blob)

    def close(self) -> None:  # noqa: B027 - optional hook; most tiers hold nothing to release
        """Release resources (threads, connections, pinned memory)."""

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
