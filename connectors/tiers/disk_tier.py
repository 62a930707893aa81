"""The NVMe tier: a directory of chunk files, written atomically with group commit.

Layout: ``<dir>/<first 2 key chars>/<key>.kvc``. A put writes every chunk of the batch to a
temp file (``.<key>.<random>.tmp``) in the chunk's own directory and syncs its data, then
renames all of them into place, then syncs each touched directory once (group commit): a
chunk becomes visible only once its bytes are durable, a crash never leaves a torn chunk
under a chunk name, and the directory sync is paid once per batch, not once per chunk. Temp
files left by a crash are deleted at start-up, when the index (key -> size, recency) is
rebuilt by scanning the directory, so chunks survive restarts. Reads go through a bounded
thread pool (a batch's files are read in parallel); a layer-range read fetches only the
header and that byte range. Every read is verified by checksum by default: a corrupt or
truncated file is deleted and reported as a miss. Tiers (in one or several processes) may
share a directory: chunks are content-addressed, so they agree on every file; each keeps
its own index and capacity, and a file another tier evicted is a miss. A shared ``flock``
on ``<dir>/.lock`` tells a starting tier whether it is alone: only then does it delete temp
files, which could otherwise belong to a live tier's write in flight.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import threading
import uuid
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path
from typing import TypeVar

import torch

from kvtier.chunk_format import (
    PAYLOAD_ALIGN,
    STORAGE_KEY_RE,
    ChunkHeader,
    header_room,
    layer_span,
    logical_key,
    parse_header,
    range_header,
    slice_chunk,
    write_header,
)
from kvtier.connectors.tiers import disk_io
from kvtier.connectors.tiers.base import CHUNK_OVERHEAD_BYTES, Blob, PutResult, Tier
from kvtier.connectors.tiers.chunk_checks import admission_error, is_valid
from kvtier.connectors.tiers.chunk_index import ChunkIndex, IndexedNamespaces
from kvtier.connectors.tiers.disk_io import failure_reason, fsync_dir, unlink_if_present
from kvtier.connectors.tiers.host_buffers import StagingPool, round_up
from kvtier.connectors.tiers.lent_chunk import ReadingBuffer
from kvtier.errors import ChunkFormatError, InvalidArgumentError, TierError
from kvtier.policies.eviction import ChunkInfo, EvictionPolicy, eviction_policy

log = logging.getLogger(__name__)

CHUNK_SUFFIX = ".kvc"
TEMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"
_PREFIX = struct.Struct("<4sI")
_CORRUPT = object()
DISK_BLOCK = 4096
"""The filesystem block a chunk file's size is rounded up to when a quota is charged."""
HEAD_BYTES = 2 << 20
"""A background lease reads this much of each chunk first (header and first layer of a
Llama-3-8B chunk of 256 tokens, in one read), the rest of the file after."""
T = TypeVar("T")
R = TypeVar("R")


class DiskTier(IndexedNamespaces, Tier):
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
        self._capacity = capacity_bytes
        self.fsync = fsync
        self._o_direct = o_direct
        self.read_evicted = read_evicted
        self._lock = threading.Lock()
        self._lock_fd: int | None
        self._lock_fd, sole = self._acquire_dir_lock()
        self._index: ChunkIndex[None] = ChunkIndex(eviction_policy(eviction))
        self._reserved = 0
        self.removed_temp_files = self._scan(remove_temps=sole)
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers, thread_name_prefix="kvtier-disk"
        )
        self._own_staging = staging is None
        self._staging = StagingPool() if staging is None else staging
        """Buffers reads land in (:meth:`lease`): reused, so reading allocates nothing."""

    # --- start-up --------------------------------------------------------------------
    def _acquire_dir_lock(self) -> tuple[int, bool]:
        """A shared ``flock`` on ``<dir>/.lock`` for the tier's lifetime, and whether this
        tier is the directory's only user (it got the lock exclusively first). Only the
        only user may delete temp files at start-up: another live tier may be writing them."""
        fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            sole = True
        except BlockingIOError:
            sole = False
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd, sole

    def _scan(self, remove_temps: bool) -> int:
        """Rebuild the index from the chunk files (oldest mtime = least recently used) and
        delete temp files left by a crash. Returns how many temp files were removed."""
        found: list[tuple[float, str, int]] = []
        removed = 0
        for sub in os.scandir(self.directory):
            if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                continue
            for entry in os.scandir(sub.path):
                if entry.name.endswith(TEMP_SUFFIX):
                    if remove_temps:
                        unlink_if_present(entry.path)
                        removed += 1
                elif entry.name.endswith(CHUNK_SUFFIX):
                    st = entry.stat(follow_symlinks=False)
                    found.append((st.st_mtime, entry.name[: -len(CHUNK_SUFFIX)], st.st_size))
        for _, key, size in sorted(found):
            self._index.add(key, None, size, charge=self.occupancy(size))
        if removed:
            log.info("disk tier %s: removed %d temp files of interrupted writes", self.directory, removed)
        return removed

    # --- paths -------------------------------------------------------------------------
    @staticmethod
    def _shard(key: str) -> str:
        """The subdirectory of ``key``: its chunk key's first two characters (a namespace
        would put all of a tenant's chunks in one)."""
        return logical_key(key)[:2]

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, self._shard(key), key + CHUNK_SUFFIX)

    def _temp_path(self, key: str) -> str:
        return os.path.join(self.directory, self._shard(key),
                            f".{key}.{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}")

    @property
    def o_direct(self) -> bool:
        """Whether I/O bypasses the page cache now (False after a fallback)."""
        return self._o_direct

    def _direct_refused(self, exc: OSError) -> None:
        if self._o_direct:
            self._o_direct = False
            log.warning(
                "disk tier %s: the filesystem refuses O_DIRECT (%s); using buffered I/O",
                self.directory, exc.strerror,
            )

    def _pool_or_closed(self) -> ThreadPoolExecutor:
        if self._pool is None:
            raise TierError("the disk tier is closed; create a new one")
        return self._pool

    def _map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        pool = self._pool_or_closed()
        if len(items) <= 1:
            return [fn(item) for item in items]
        return list(pool.map(fn, items))

    # --- put ---------------------------------------------------------------------------
    def put(
        self, chunks: Mapping[str, Blob], info: Mapping[str, ChunkInfo] | None = None
    ) -> PutResult:
        result = PutResult()
        todo: list[tuple[str, Blob]] = []
        evicted: list[tuple[str, str]] = []
        with self._lock:
            if self._pool is None:
                raise TierError("the disk tier is closed; create a new one")
            for key, blob in chunks.items():
                if key in self._index:
                    self._index.get(key)
                    if info and key in info:
                        self._index.share(key, info[key].session)
                    result.present.append(key)
                    continue
                if not STORAGE_KEY_RE.fullmatch(key):
                    result.failed[key] = f"invalid: key {key!r} is not a chunk key (hex digest)"
                    continue
                reason = admission_error(key, blob)
                if reason is None and self._capacity is not None:
                    if len(blob) > self._capacity:
                        reason = "too_large"
                    elif not self._make_room(len(blob), evicted):
                        reason = "full"
                if reason is not None:
                    result.failed[key] = reason
                    continue
                self._reserved += len(blob)
                todo.append((key, blob))
        evicted_blobs = self._discard_evicted(evicted)
        outcomes = self._write_batch(todo)
        full = [(k, b) for k, b in todo if outcomes[k] == "disk_full"]
        if full:  # the filesystem filled before the tier's capacity: the coldest chunks go
            freed = self._free_bytes(sum(len(b) for _, b in full))
            if freed:
                evicted_blobs += freed
                outcomes.update(self._write_batch(full))
        written = 0
        with self._lock:
            for key, blob in todo:
                self._reserved -= len(blob)
                reason = outcomes[key]
                if reason is None:
                    self._index.add(key, None, len(blob), info.get(key) if info else None,
                                    charge=self.occupancy(len(blob)))
                    result.stored.append(key)
                    written += len(blob)
                else:
                    result.failed[key] = reason
        return self._account_put(result, written, evicted_blobs)

    def _make_room(self, size: int, evicted: list[tuple[str, str]]) -> bool:
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

    def _evict_while(self, short: Callable[[], bool], evicted: list[tuple[str, str]]) -> int:
        """Give up the policy's victims while ``short()`` (under the lock): each file is
        renamed to a temp name, to be read or removed after the lock. Returns the bytes."""
        freed = 0
        for victim, _, size in self._index.evict_while(short):
            doomed = self._temp_path(victim)
            try:
                os.rename(self._path(victim), doomed)
            except FileNotFoundError:
                continue
            evicted.append((victim, doomed))
            freed += size
        return freed

    def _free_bytes(self, need: int) -> list[tuple[str, bytes | None]]:
        """Evict the policy's coldest chunks until ``need`` bytes are freed (a full
        filesystem, whatever the configured capacity): a tier that takes no more writes
        until someone deletes by hand is worse than one that forgets its coldest KV."""
        evicted: list[tuple[str, str]] = []
        with self._lock:
            target = self._index.used_bytes - need
            freed = self._evict_while(lambda: self._index.used_bytes > target, evicted)
        if evicted:
            log.warning("disk tier %s: the filesystem is full; evicted %d chunks (%d bytes)",
                        self.directory, len(evicted), freed)
        return self._discard_evicted(evicted)

    def _discard_evicted(self, evicted: list[tuple[str, str]]) -> list[tuple[str, bytes | None]]:
        out: list[tuple[str, bytes | None]] = []
        for key, path in evicted:
            data: bytes | None = None
            if self.read_evicted:
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                except OSError:
                    data = None
                if data is not None and not is_valid(key, data):
                    data = None
            unlink_if_present(path)
            out.append((key, data))
        return out

    def _write_batch(self, todo: list[tuple[str, Blob]]) -> dict[str, str | None]:
        """Group commit: write + sync every temp file, rename all, sync each directory once.
        Returns key -> None (stored) or the failure reason; nothing failed stays on disk."""
        outcomes: dict[str, str | None] = {}
        if not todo:
            return outcomes
        new_dirs = False
        for sub in {self._shard(key) for key, _ in todo}:
            path = self.directory / sub
            if not path.is_dir():
                try:
                    path.mkdir(exist_ok=True)
                    new_dirs = True
                except OSError as exc:
                    for key, _ in todo:
                        if self._shard(key) == sub:
                            outcomes[key] = failure_reason(exc)
        pending = [(k, b) for k, b in todo if k not in outcomes]
        temps = self._map(self._write_temp, pending)
        renamed: dict[str, list[str]] = {}
        for (key, _), (temp, reason) in zip(pending, temps, strict=True):
            if reason is None:
                try:
                    os.rename(temp, self._path(key))
                except OSError as exc:
                    unlink_if_present(temp)
                    reason = failure_reason(exc)
                else:
                    renamed.setdefault(self._shard(key), []).append(key)
            outcomes[key] = reason
        if self.fsync:
            dirs = [str(self.directory / sub) for sub in renamed]
            if new_dirs:
                dirs.append(str(self.directory))
            for d in dirs:
                try:
                    fsync_dir(d)
                except OSError as exc:
                    for key in renamed.get(os.path.basename(d), []):
                        unlink_if_present(self._path(key))
                        outcomes[key] = failure_reason(exc)
        return outcomes

    def _write_temp(self, item: tuple[str, Blob]) -> tuple[str, str | None]:
        key, blob = item
        temp = self._temp_path(key)
        try:
            try:
                disk_io.write_file(temp, blob, self.fsync, self._o_direct)
            except disk_io.DirectIOUnsupported as exc:
                unlink_if_present(temp)
                self._direct_refused(exc)
                disk_io.write_file(temp, blob, self.fsync, False)
        except OSError as exc:
            unlink_if_present(temp)
            log.warning("disk tier %s: writing chunk %s failed: %s", self.directory, key, exc)
            return temp, failure_reason(exc)
        return temp, None

    def share(self, keys: Sequence[str], session: Hashable) -> None:
        with self._lock:
            for key in keys:
                self._index.share(key, session)

    # --- get ---------------------------------------------------------------------------
    def get(
        self,
        keys: Sequence[str],
        layers: tuple[int, int] | None = None,
        verify: bool = True,
    ) -> list[bytes | None]:
        """Blobs (or layer-range chunks) read in parallel. With ``verify`` each is checked by
        checksum; a corrupt or truncated file is deleted and returned as a miss."""
        if layers is not None and not 0 <= layers[0] < layers[1]:
            raise InvalidArgumentError(f"layer range {layers} is empty or negative")
        with self._lock:
            present = [i for i, key in enumerate(keys) if self._index.get(key) is not None]
        reads = self._map(lambda i: self._read(keys[i], layers, verify), present)
        out: list[bytes | None] = [None] * len(keys)
        gone: list[str] = []
        corrupt: list[str] = []
        for i, data in zip(present, reads, strict=True):
            if data is _CORRUPT:
                corrupt.append(keys[i])
            elif data is None:
                gone.append(keys[i])
            else:
                out[i] = data  # type: ignore[assignment]
        self._forget(corrupt, gone)
        hits = [b for b in out if b is not None]
        with self.stats.lock:
            self.stats.gets += len(keys)
            self.stats.hits += len(hits)
            self.stats.misses += len(keys) - len(hits)
            self.stats.bytes_read += sum(len(b) for b in hits)
            self.stats.corrupt += len(corrupt)
        return out

    def _open(self, key: str) -> tuple[int, bool]:
        direct = self._o_direct
        try:
            return disk_io.open_read(self._path(key), direct), direct
        except disk_io.DirectIOUnsupported as exc:
            self._direct_refused(exc)
            return disk_io.open_read(self._path(key), False), False

    def _read(self, key: str, layers: tuple[int, int] | None, verify: bool) -> object:
        """The blob, None if the file is gone, or _CORRUPT."""
        try:
            fd, direct = self._open(key)
        except FileNotFoundError:
            return None
        try:
            if layers is None:
                data = disk_io.read_range(fd, 0, os.fstat(fd).st_size, direct)
            else:
                data = self._read_layers(key, fd, direct, layers)
                if data is None:
                    return _CORRUPT
        except OSError as exc:
            log.warning("disk tier %s: reading chunk %s failed: %s", self.directory, key, exc)
            self.stats.count_error("io_error")
            return _CORRUPT
        finally:
            os.close(fd)
        if verify and not is_valid(key, data):
            return _CORRUPT
        return data

    @staticmethod
    def _read_layers(key: str, fd: int, direct: bool, layers: tuple[int, int]) -> bytes | None:
        """Header + one byte range (two or three preads); None when the file is damaged."""
        header, offset = DiskTier._read_header(fd, direct)
        if header is None:
            return None
        try:
            start, length = layer_span(header, layers)
        except ChunkFormatError as exc:
            raise InvalidArgumentError(f"chunk {key}: {exc}") from None
        part = disk_io.read_range(fd, offset + start, length, direct)
        if len(part) != length:
            return None
        return slice_chunk(header, layers, part)

    @property
    def staging(self) -> StagingPool:
        """The reused buffers reads land in (share it with the manager's writes)."""
        return self._staging

    # --- lease -------------------------------------------------------------------------
    @contextlib.contextmanager
    def lease(
        self, keys: Sequence[str], layers: tuple[int, int] | None = None, background: bool = False
    ) -> Iterator[list[torch.Tensor | ReadingBuffer | None]]:
        """The chunks (or layers ``layers`` of them) read straight into staging buffers,
        several files at once, each a uint8 tensor holding one valid chunk (None: a miss),
        unverified: check them with :func:`~kvtier.chunk_format.chunk_view`. No bytes
        object is made: the bytes land where they are read to (with ``O_DIRECT`` from the
        device). A whole chunk is the file as written (the very bytes that were put); a
        layer range gets a header of its own framed around its payload. The buffers go
        back to the pool when the block ends. A file that is gone is a miss; one that is
        truncated or whose header is unreadable is deleted (a torn file is never handed
        out).

        ``background`` (whole chunks): each chunk is lent once its first ``head_bytes`` are
        read, the rest of its file read on the pool, chunks in order, as a
        :class:`ReadingBuffer` (the reader waits per layer, see :class:`LentChunk`), so a
        reader's work on one chunk overlaps the reads of the next. The block's end waits
        for every read in flight before the buffers are reused."""
        if layers is not None and not 0 <= layers[0] < layers[1]:
            raise InvalidArgumentError(f"layer range {layers} is empty or negative")
        with self._lock:
            present = [i for i, key in enumerate(keys) if self._index.get(key) is not None]
        if background and layers is None:
            reads = self._map(lambda i: self._read_head_into(keys[i]), present)
        else:
            reads = self._map(lambda i: self._read_into(keys[i], layers), present)
        out: list[torch.Tensor | ReadingBuffer | None] = [None] * len(keys)
        gone: list[str] = []
        corrupt: list[str] = []
        held: list[torch.Tensor] = []
        pending: list[Future[bool]] = []
        for i, got in zip(present, reads, strict=True):
            if got is _CORRUPT:
                corrupt.append(keys[i])
            elif got is None:
                gone.append(keys[i])
            elif isinstance(got, ReadingBuffer):
                held.append(got.buf)
                pending.append(got.done)
                out[i] = got
            else:
                buf, length = got  # type: ignore[misc]
                held.append(buf)
                out[i] = buf[:length]
        self._forget(corrupt, gone)
        hits = [(v.buf if isinstance(v, ReadingBuffer) else v).numel() for v in out if v is not None]
        with self.stats.lock:
            self.stats.gets += len(keys)
            self.stats.hits += len(hits)
            self.stats.misses += len(keys) - len(hits)
            self.stats.bytes_read += sum(hits)
            self.stats.corrupt += len(corrupt)
        try:
            yield out
        finally:
            futures_wait(pending)  # no read may land in a buffer handed out again
            for buf in held:
                self._staging.release(buf)

    def _read_head_into(self, key: str) -> object:
        """The whole chunk into a staging buffer: its first ``head_bytes`` (the header and,
        for the chunks of common models, the first layer) in one read now, the rest on the
        pool (a :class:`ReadingBuffer`); a small chunk, or an older one with an unaligned
        payload, is read whole, as :meth:`_read_into` does."""
        try:
            fd, direct = self._open(key)
        except FileNotFoundError:
            return None
        buf: torch.Tensor | None = None
        handed_over = False
        try:
            size = os.fstat(fd).st_size
            buf = self._staging.acquire(disk_io.direct_read_room(0, size))
            view = memoryview(buf.numpy())
            head = min(size, self.head_bytes)
            if not disk_io.read_into(fd, 0, head, view, 0, direct):
                self._staging.release(buf)
                return _CORRUPT
            try:
                header, offset = parse_header(view[:head])
            except ChunkFormatError:
                header, offset = None, 0
            whole = header is None or head == size or offset % 8
            if whole and head < size:  # a header past the head, or an unaligned payload
                if not disk_io.read_into(fd, head, size - head, view, head, direct):
                    self._staging.release(buf)
                    return _CORRUPT
                if header is None:
                    header, offset = self._parsed(view[:size])
            if header is None or size != offset + header.payload_nbytes:
                self._staging.release(buf)
                return _CORRUPT
            if whole:
                return buf, size
            done = self._pool_or_closed().submit(self._read_rest, fd, head, size, view, direct)
            handed_over = True
            return ReadingBuffer(buf[:size], head, done)
        except OSError as exc:
            return self._read_failed(key, buf, exc)
        finally:
            if not handed_over:
                os.close(fd)

    @staticmethod
    def _parsed(data: memoryview) -> tuple[ChunkHeader | None, int]:
        try:
            return parse_header(data)
        except ChunkFormatError:
            return None, 0

    def _read_failed(self, key: str, buf: torch.Tensor | None, exc: OSError) -> object:
        """A read that failed: its buffer back, the error logged and counted, _CORRUPT."""
        if buf is not None:
            self._staging.release(buf)
        log.warning("disk tier %s: reading chunk %s failed: %s", self.directory, key, exc)
        self.stats.count_error("io_error")
        return _CORRUPT

    def _read_rest(self, fd: int, start: int, size: int, view: memoryview, direct: bool) -> bool:
        """Bytes ``[start, size)`` of an open chunk file into ``view`` at the same offset,
        then close it; False if the file ended first."""
        try:
            ok = disk_io.read_into(fd, start, size - start, view, start, direct)
        except OSError as exc:
            log.warning("disk tier %s: background read failed: %s", self.directory, exc)
            self.stats.count_error("io_error")
            raise
        finally:
            os.close(fd)
        return ok

    def _read_into(self, key: str, layers: tuple[int, int] | None) -> object:
        """(staging buffer, chunk length), None if the file is gone, or _CORRUPT."""
        try:
            fd, direct = self._open(key)
        except FileNotFoundError:
            return None
        buf: torch.Tensor | None = None
        try:
            size = os.fstat(fd).st_size
            header, offset = self._read_header(fd, direct)
            if header is None or size != offset + header.payload_nbytes:
                return _CORRUPT
            if layers is None:  # the whole file as written: the chunk's own bytes
                buf = self._staging.acquire(disk_io.direct_read_room(0, size))
                if not disk_io.read_into(fd, 0, size, memoryview(buf.numpy()), 0, direct):
                    self._staging.release(buf)
                    return _CORRUPT
                return buf, size
            try:
                span = layers
                lo, length = layer_span(header, span)
            except ChunkFormatError as exc:
                raise InvalidArgumentError(f"chunk {key}: {exc}") from None
            part = range_header(header, span)
            at = round_up(header_room(part), PAYLOAD_ALIGN)
            if direct:  # the payload lands at the same offset within a page as on disk
                at += (offset + lo - at) % disk_io.ALIGN
            buf = self._staging.acquire(at + disk_io.direct_read_room(offset + lo, length))
            if not disk_io.read_into(fd, offset + lo, length, memoryview(buf.numpy()), at, direct):
                self._staging.release(buf)
                return _CORRUPT
            return buf, write_header(buf, part, at)
        except OSError as exc:
            return self._read_failed(key, buf, exc)
        finally:
            os.close(fd)

    @staticmethod
    def _read_header(fd: int, direct: bool) -> tuple[ChunkHeader | None, int]:
        head = disk_io.read_range(fd, 0, disk_io.HEAD_READ, direct)
        if len(head) >= _PREFIX.size:
            need = _PREFIX.size + _PREFIX.unpack_from(head)[1]
            if len(head) < need <= _PREFIX.size + (1 << 16):
                head = disk_io.read_range(fd, 0, need, direct)
        try:
            return parse_header(head)
        except ChunkFormatError:
            return None, 0

    def _forget(self, corrupt: Sequence[str], gone: Sequence[str]) -> None:
        """Drop corrupt files (and their index entries) and entries whose file vanished."""
        if corrupt or gone:
            with self._lock:
                for key in corrupt:
                    if self._index.pop(key) is not None:
                        unlink_if_present(self._path(key))
                for key in gone:
                    self._index.pop(key)
        for key in corrupt:
            log.warning("disk tier %s: chunk %s is corrupt or truncated; deleted", self.directory, key)

    # --- the rest ------------------------------------------------------------------------
    def contains_prefix(self, keys: Sequence[str]) -> int:
        """From the in-memory index; a file that vanished is noticed (as a miss) on get."""
        with self._lock:
            return self._index.leading_present(keys)

    def delete(self, keys: Iterable[str]) -> int:
        n = 0
        with self._lock:
            for key in keys:
                if self._index.pop(key) is not None:
                    unlink_if_present(self._path(key))
                    n += 1
        return n

    @property
    def eviction(self) -> EvictionPolicy:
        return self._index.policy

    # --- tenants (namespace_held / namespace_bytes: IndexedNamespaces) ----------------
    def evict_namespace(self, namespace: str, need: int, exclude: Collection[str] = ()) -> int:
        """As the tier evicts when full (renamed aside under the lock, handed down after
        it), but only ``namespace``'s coldest chunks."""
        evicted: list[tuple[str, str]] = []
        freed = 0
        with self._lock:
            for victim, _, size in self._index.evict_namespace(namespace, need, set(exclude)):
                doomed = self._temp_path(str(victim))
                try:
                    os.rename(self._path(str(victim)), doomed)
                except FileNotFoundError:
                    continue
                evicted.append((str(victim), doomed))
                freed += self.occupancy(size)
        for key, blob in self._discard_evicted(evicted):
            self._notify_evicted(key, blob)
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
