"""The NVMe tier: a directory of chunk files (:mod:`.disk_layout`), written atomically with
group commit (:mod:`.disk_writes`), read into staging buffers (:mod:`.disk_reads`).

This class keeps the index (key -> size, recency, rebuilt from the directory at start-up,
so chunks survive restarts), the capacity and its evictions, and runs a batch's reads and
writes in parallel on a bounded thread pool. Only regular files are chunks: anything else
in a chunk's place (a FIFO, a directory, a symlink) is never opened to read, and is moved
aside (:mod:`.disk_quarantine`), so its key is a miss and storable again. A file whose size
or header is off is deleted and a miss; the stack verifies every chunk lent (a corrupt one
is dropped). Tiers (in one or several processes) may share a directory: chunks are
content-addressed, so they agree on every file; each keeps its own index and capacity, and
a file another tier evicted is a miss. A shared ``flock`` on ``<dir>/.lock`` tells a
starting tier whether it is alone: only then does it delete temp files, which could
otherwise belong to a live tier's write in flight.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import TypeVar

import torch

from kvtier.chunk_format import (
    STORAGE_KEY_RE,
)
from kvtier.connectors.tiers import disk_io
from kvtier.connectors.tiers.base import (
    CHUNK_OVERHEAD_BYTES,
    ChunkWrite,
    PutOutcome,
    PutResult,
    Tier,
)
from kvtier.connectors.tiers.chunk_checks import is_valid
from kvtier.connectors.tiers.chunk_index import ChunkIndex
from kvtier.connectors.tiers.disk_io import Doomed
from kvtier.connectors.tiers.disk_layout import ChunkPaths
from kvtier.connectors.tiers.disk_quarantine import Quarantine, is_regular_file
from kvtier.connectors.tiers.disk_reads import ChunkFileReader, FileRead, ReadFailure, read_evicted
from kvtier.connectors.tiers.disk_writes import GroupCommit
from kvtier.connectors.tiers.host_buffers import StagingPool, round_up
from kvtier.connectors.tiers.lent_chunk import ReadingBuffer
from kvtier.errors import DescriptorsExhaustedError, InvalidArgumentError, TierError
from kvtier.io_priority import WaitedFirst
from kvtier.policies.eviction import ChunkInfo, EvictionPolicy, eviction_policy
from kvtier.thread_start import thread_started

log = logging.getLogger(__name__)

DISK_BLOCK = 4096
"""The filesystem block a chunk file's size is rounded up to when a quota is charged."""
HEAD_BYTES = 2 << 20
"""A background lease reads this much of each chunk first (header and first layer of a
Llama-3-8B chunk of 256 tokens, in one read), the rest of the file after."""
T = TypeVar("T")
R = TypeVar("R")


class DiskTier(Tier):
    """Chunk files under ``directory``; ``capacity_bytes=None`` is bounded only by the disk.

    ``fsync``: sync data and directories (turn off only for scratch data).
    ``o_direct``: bypass the page cache (falls back to buffered I/O, with a warning, where
    the filesystem refuses it). ``read_evicted``: hand evicted chunks' bytes to eviction
    listeners (one extra read per eviction) instead of ``None``. ``staging``: the buffers
    :meth:`lease` reads into (default: a pool of its own).
    """

    name = "disk"
    reads_in_background = True
    """:meth:`lease` can lend whole chunks while their later layers are still read."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int | None = None,
        fsync: bool = True,
        o_direct: bool = False,
        max_workers: int = 4,
        read_evicted: bool = False,
        eviction: str | EvictionPolicy = "lru",
        staging: StagingPool | None = None,
        head_bytes: int = HEAD_BYTES,
    ) -> None:
        super().__init__()
        if head_bytes < disk_io.ALIGN or head_bytes % disk_io.ALIGN:
            raise InvalidArgumentError(f"head_bytes must be a positive multiple of {disk_io.ALIGN}")
        self.head_bytes = head_bytes
        """What a background lease reads of each chunk before lending it (see HEAD_BYTES)."""
        if capacity_bytes is not None and capacity_bytes < 1:
            raise InvalidArgumentError(f"capacity_bytes must be >= 1 or None, got {capacity_bytes}")
        if max_workers < 1:
            raise InvalidArgumentError(f"max_workers must be >= 1, got {max_workers}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._paths = ChunkPaths(self.directory)
        self._capacity = capacity_bytes
        self.fsync = fsync
        self._files = disk_io.ChunkFiles(str(self.directory), o_direct, fsync)
        self.read_evicted = read_evicted
        self._lock = threading.Lock()
        self._lock_fd: int | None
        self._lock_fd, sole = self._paths.acquire_lock()
        self._index: ChunkIndex[None] = ChunkIndex(eviction_policy(eviction))
        self._reserved = 0
        self._quarantine = Quarantine(self.directory)
        found, self.removed_temp_files = self._paths.scan(sole, self._quarantine)
        for f in found:  # chunks survive restarts; the oldest are the least recently used
            self._index.add(f.key, None, f.size, charge=self.occupancy(f.size))
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers, thread_name_prefix="kvtier-disk", initializer=thread_started
        )
        self._own_staging = staging is None
        self._staging = StagingPool() if staging is None else staging
        """Buffers reads land in (:meth:`lease`): reused, so reading allocates nothing."""
        self._reader = ChunkFileReader(self._staging, head_bytes, self._open, self._submit,
                                       self._read_error)
        self._commit = GroupCommit(self._paths, fsync, self._staging, self._files.write,
                                   self._map, self._quarantine)
        self.waited_first = WaitedFirst()
        """Background write batches wait for waited-for reads and writes (see io_priority)."""

    @property
    def quarantined(self) -> int:
        """Foreign objects (not regular files) found in chunks' places and moved aside into
        ``<dir>/.quarantine/`` since the tier started."""
        return self._quarantine.moved

    @property
    def o_direct(self) -> bool:
        """Whether I/O bypasses the page cache now (False after a fallback)."""
        return self._files.direct

    def _pool_or_closed(self) -> ThreadPoolExecutor:
        if self._pool is None:
            raise TierError("the disk tier is closed; create a new one")
        return self._pool

    def _map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        pool = self._pool_or_closed()
        if len(items) <= 1:
            return [fn(item) for item in items]
        return list(pool.map(fn, items))

    # --- store -------------------------------------------------------------------------
    def store_in_place(self, writes: Sequence[ChunkWrite]) -> PutResult:
        """Write the batch with group commit (see the module): each chunk from its given
        bytes, or filled into a staging buffer (page-aligned: an ``O_DIRECT`` write goes
        out of it as it is) and written from there; room is made for ``nbytes`` each."""
        result = PutResult()
        todo: list[ChunkWrite] = []
        evicted: list[Doomed] = []
        with self._lock:
            if self._pool is None:
                raise TierError("the disk tier is closed; create a new one")
            taken: set[str] = set()
            for write in writes:
                if write.key in taken:
                    result.present.append(write.key)  # twice in one batch: written once
                    continue
                reason = self._admit(write, evicted)
                if reason is PutOutcome.STORED:
                    self._reserved += write.nbytes
                    todo.append(write)
                    taken.add(write.key)
                elif reason is PutOutcome.PRESENT:
                    result.present.append(write.key)
                else:
                    result.failed[write.key] = reason
        evicted_blobs = self._discard_evicted(evicted)
        try:
            if todo:  # a background batch waits for waited-for transfers (io_priority)
                self.stats.count_held(self.waited_first.before_background_write())
            with self.waited_first.during([]):  # a waited-for one holds background ones off
                outcomes = self._commit.write(todo)
                full = [w for w in todo if outcomes[w.key].reason == "disk_full"]
                if full:  # the filesystem filled before the tier's capacity: the coldest go
                    freed = self._free_bytes(sum(w.nbytes for w in full))
                    if freed:
                        evicted_blobs += freed
                        outcomes.update(self._commit.write(full))
        finally:
            with self._lock:
                self._reserved -= sum(w.nbytes for w in todo)
        written = 0
        with self._lock:
            for write in todo:
                reason, length = outcomes[write.key].reason, outcomes[write.key].length
                if reason is None:
                    self._index.add(write.key, None, length, write.info,
                                    charge=self.occupancy(length))
                    result.stored.append(write.key)
                    written += length
                else:
                    result.failed[write.key] = reason
        return self._account_put(result, written, evicted_blobs)

    def _admit(self, write: ChunkWrite, evicted: list[Doomed]) -> PutOutcome | str:
        """``STORED`` when ``write`` is to be written (room made for it), ``PRESENT``, or
        why it is not (under the lock)."""
        key = write.key
        if key in self._index:
            self._index.get(key)
            if write.info is not None:
                self._index.share(key, write.info.session)
            return PutOutcome.PRESENT
        if not STORAGE_KEY_RE.fullmatch(key):
            return f"invalid: key {key!r} is not a chunk key (hex digest)"
        reason = write.admission_error()
        if reason is None and self._capacity is not None:
            if write.nbytes > self._capacity:
                reason = PutOutcome.TOO_LARGE.value
            elif not self._make_room(write.nbytes, evicted):
                reason = PutOutcome.FULL.value
        return PutOutcome.STORED if reason is None else reason

    def _make_room(self, size: int, evicted: list[Doomed]) -> bool:
        """Evict LRU chunks until ``size`` more bytes fit (under the lock). Chunks written by
        puts in flight are reserved, not indexed, so they are never victims. An evicted file
        is renamed to a temp name here (so a concurrent re-put of its key is unaffected) and
        read/removed after the lock."""
        capacity = self._capacity
        assert capacity is not None

        def short_of_room() -> bool:
            return self._index.used_bytes + self._reserved + size > capacity

        self._evict_while(short_of_room, evicted)
        return not short_of_room()

    def _evict_while(self, short: Callable[[], bool], evicted: list[Doomed]) -> int:
        """Give up the policy's victims while ``short()`` (under the lock): each file is
        renamed to a temp name, to be read or removed after the lock. Returns the bytes."""
        freed = 0
        for gone in self._index.evict_while(short):
            doomed = self._temp_path(gone.key)
            try:
                os.rename(self._path(gone.key), doomed)
            except FileNotFoundError:
                continue
            evicted.append(Doomed(gone.key, doomed, gone.info))
            freed += gone.size
        return freed

    def _free_bytes(self, need: int) -> list[tuple[str, bytes | None, ChunkInfo | None]]:
        """Evict the policy's coldest chunks until ``need`` bytes are freed (a full
        filesystem, whatever the configured capacity): a tier that takes no more writes
        until someone deletes by hand is worse than one that forgets its coldest KV."""
        evicted: list[Doomed] = []
        with self._lock:
            target = self._index.used_bytes - need
            freed = self._evict_while(lambda: self._index.used_bytes > target, evicted)
        if evicted:
            log.warning("disk tier %s: the filesystem is full; evicted %d chunks (%d bytes)",
                        self.directory, len(evicted), freed)
        return self._discard_evicted(evicted)

    def _discard_evicted(self, evicted: list[Doomed]
                         ) -> list[tuple[str, bytes | None, ChunkInfo | None]]:
        """Read (with ``read_evicted``) and remove each renamed-aside victim: what the
        eviction listeners are told of."""
        out: list[tuple[str, bytes | None, ChunkInfo | None]] = []
        for key, path, info in evicted:
            data: bytes | None = None
            if self.read_evicted:
                data = read_evicted(path, self._files.open_read)
                if data is not None and not is_valid(key, data):
                    data = None
            self._quarantine.discard(path)
            out.append((key, data, info))
        return out

    def share(self, keys: Sequence[str], session: Hashable) -> None:
        with self._lock:
            for key in keys:
                self._index.share(key, session)

    # --- lease -------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return self._paths.path(key)

    def _temp_path(self, key: str) -> str:
        return self._paths.temp_path(key)

    def _open(self, key: str) -> tuple[int, bool]:
        return self._files.open_read(self._path(key))

    def _submit(self, fn: Callable[..., bool], *args: object) -> Future[bool]:
        return self._pool_or_closed().submit(fn, *args)

    def _read_error(self, key: str, exc: OSError) -> None:
        log.warning("disk tier %s: reading chunk %s failed: %s", self.directory, key, exc)
        self.stats.count_error("io_error")

    @property
    def staging(self) -> StagingPool:
        """The reused buffers reads land in (share it with the manager's writes)."""
        return self._staging

    @contextlib.contextmanager
    def lease(
        self, keys: Sequence[str], layers: tuple[int, int] | None = None, background: bool = False
    ) -> Iterator[list[torch.Tensor | ReadingBuffer | None]]:
        """The chunks (or layers ``layers`` of them, framed as chunks) read straight into
        staging buffers, several files at once (:mod:`.disk_reads`), unverified; the
        buffers go back to the pool when the block ends. A file that is gone is a miss;
        one that is truncated or whose header is unreadable is deleted (a torn file is
        never lent), one that is not a regular file moved aside; each is a miss of its own
        (the other keys are served). A file that cannot be opened for want of
        descriptors fails the whole lease (:class:`DescriptorsExhaustedError`): whether
        it is stored is unknown, and the other opens would fail alike. ``background`` (whole chunks): each is lent once its
        head is read, as a :class:`ReadingBuffer`, the rest read on the pool while the
        reader works on the chunks before it; the block's end waits for every read in
        flight."""
        if layers is not None and not 0 <= layers[0] < layers[1]:
            raise InvalidArgumentError(f"layer range {layers} is empty or negative")
        with self._lock:
            # touched last to first: a chain's head stays the most recently used (its
            # tail goes first under a recency policy; what stays is a usable prefix)
            present = [i for i in reversed(range(len(keys))) if self._index.get(keys[i]) is not None][::-1]
        reader = self._reader
        with self.waited_first.during(landing := []):  # waited-for reads (io_priority)
            if background and layers is None:
                reads = self._map(lambda i: reader.read_head(keys[i]), present)
            else:
                reads = self._map(lambda i: reader.read(keys[i], layers), present)
            landing += [r.done for r in reads if isinstance(r, ReadingBuffer)]
        out: list[torch.Tensor | ReadingBuffer | None] = [None] * len(keys)
        gone: list[str] = []
        corrupt: list[str] = []
        foreign: list[str] = []
        starved = 0
        held: list[torch.Tensor] = []
        pending: list[Future[bool]] = []
        for i, got in zip(present, reads, strict=True):
            starved += got is ReadFailure.NO_DESCRIPTORS
            if got is ReadFailure.CORRUPT:
                corrupt.append(keys[i])
            elif got is ReadFailure.FOREIGN:
                foreign.append(keys[i])
            elif got is None:
                gone.append(keys[i])
            elif isinstance(got, ReadingBuffer):
                held.append(got.buf)
                pending.append(got.done)
                out[i] = got
            elif isinstance(got, FileRead):
                held.append(got.buf)
                out[i] = got.buf[: got.length]
        self._forget(corrupt, gone)
        self._move_aside(foreign)
        hits = [(v.buf if isinstance(v, ReadingBuffer) else v).numel() for v in out if v is not None]
        with self.stats.lock:
            self.stats.gets += len(keys)
            self.stats.hits += len(hits)
            self.stats.misses += len(keys) - len(hits)
            self.stats.bytes_read += sum(hits)
            self.stats.corrupt += len(corrupt)
        try:
            if starved:
                raise DescriptorsExhaustedError(
                    f"disk tier {self.directory}: {starved} of {len(keys)} chunk files could "
                    "not be opened: the process is out of file descriptors (raise its "
                    "limit, or close connections); retry")
            yield out
        finally:
            futures_wait(pending)  # no read may land in a buffer handed out again
            for buf in held:
                self._staging.release(buf)

    def _forget(self, corrupt: Sequence[str], gone: Sequence[str]) -> None:
        """Drop corrupt files (and their index entries) and entries whose file vanished."""
        if corrupt or gone:
            with self._lock:
                for key in corrupt:
                    if self._index.pop(key) is not None:
                        self._quarantine.discard(self._path(key))
                for key in gone:
                    self._index.pop(key)
        for key in corrupt:
            log.warning("disk tier %s: chunk %s is corrupt or truncated; deleted", self.directory, key)

    def _move_aside(self, foreign: Sequence[str]) -> None:
        """Forget keys whose place holds no regular file and move that object aside: the
        key is a miss, and a later put of it is stored."""
        if not foreign:
            return
        with self._lock:
            for key in foreign:
                path = self._path(key)
                if not is_regular_file(path):  # else a chunk was stored there meanwhile
                    self._index.pop(key)
                    self._quarantine.move_aside(path)
        for _ in foreign:
            self.stats.count_error("not_a_file")

    # --- the rest ------------------------------------------------------------------------
    def contains_prefix(self, keys: Sequence[str]) -> int:
        """From the in-memory index; a file that vanished is noticed (as a miss) on get."""
        with self._lock:
            return self._index.leading_present(keys)

    def stored_sizes(self, keys: Sequence[str]) -> list[int | None]:
        with self._lock:
            return [self._index.size(k) if k in self._index else None for k in keys]

    def delete(self, keys: Iterable[str]) -> int:
        n = 0
        with self._lock:
            for key in keys:
                if self._index.pop(key) is not None:
                    self._quarantine.discard(self._path(key))
                    n += 1
        return n

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
        """As the tier evicts when full (renamed aside under the lock, handed down after
        it), but only ``namespace``'s coldest chunks."""
        evicted: list[Doomed] = []
        freed = 0
        with self._lock:
            for gone in self._index.evict_namespace(namespace, need, set(exclude)):
                doomed = self._temp_path(str(gone.key))
                try:
                    os.rename(self._path(str(gone.key)), doomed)
                except FileNotFoundError:
                    continue
                evicted.append(Doomed(str(gone.key), doomed, gone.info))
                freed += self.occupancy(gone.size)
        for key, blob, info in self._discard_evicted(evicted):
            self._notify_evicted(key, blob, info)
        return freed

    def occupancy(self, nbytes: int) -> int:
        """A file takes whole filesystem blocks (4 KiB), plus its index entry."""
        return round_up(max(nbytes, 1), DISK_BLOCK) + CHUNK_OVERHEAD_BYTES

    @property
    def capacity_bytes(self) -> int | None:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._index.used_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def gauges(self) -> tuple[int, int]:
        """Read without the tier's lock: two ints, possibly a moment apart."""
        return len(self._index), self._index.used_bytes

    def close(self) -> None:
        """Finish in-flight I/O, stop the workers and release the directory."""
        with self._lock:
            pool, self._pool = self._pool, None
            fd, self._lock_fd = self._lock_fd, None
        if pool is not None:
            pool.shutdown(wait=True)
            if self._own_staging:
                self._staging.close()
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __del__(self) -> None:
        fd = getattr(self, "_lock_fd", None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
