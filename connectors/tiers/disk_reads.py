"""Reading chunk files into staging buffers, for the disk tier's lease.

No bytes object is made: a file's bytes land in a reused, page-aligned staging buffer
(with ``O_DIRECT`` straight from the device). A whole chunk is the file as written; a layer
range gets a header of its own framed around its payload (read at the same offset within a
page as on disk, so ``O_DIRECT`` can land it in place). A background read lends a chunk once
its head is read (header and first layer), the rest of the file read on the tier's pool.
Every read opens only a regular file (checked without blocking, :func:`.disk_io.open_read`)
and reads its header before it takes a buffer, sized by the header: a file whose size
disagrees with it, or whose header cannot be read, is corrupt at the cost of a header
read (a file grown sparse to gigabytes never sizes a buffer); it is never lent (a torn file
is never handed out).
"""

from __future__ import annotations

import enum
import logging
import os
import struct
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvtier.chunk_format import (
    PAYLOAD_ALIGN,
    ChunkHeader,
    header_room,
    layer_span,
    parse_header,
    range_header,
    write_header,
)
from kvtier.connectors.tiers import disk_io
from kvtier.connectors.tiers.host_buffers import StagingPool, round_up
from kvtier.connectors.tiers.lent_chunk import ReadingBuffer
from kvtier.errors import ChunkFormatError, InvalidArgumentError

log = logging.getLogger(__name__)

_PREFIX = struct.Struct("<4sI")


class ReadFailure(enum.Enum):
    """Why a chunk file gave no chunk (its key is a miss)."""

    CORRUPT = "corrupt"
    """Not a whole chunk (truncated, grown, unreadable header, a failed read): deleted."""
    FOREIGN = "foreign"
    """Not a regular file (a FIFO, a directory, a symlink, ...): never read, moved aside."""
    UNREADABLE = "unreadable"
    """Could not be opened (no permission, an I/O error): left as it is."""
    NO_DESCRIPTORS = "no_descriptors"
    """Could not be opened for want of descriptors: left as it is, and the whole lease
    fails (:class:`~kvtier.errors.DescriptorsExhaustedError`): whether the key is stored
    is unknown, not a miss."""


@dataclass
class FileRead:
    """A chunk read whole into ``buf[:length]`` (a staging buffer)."""

    buf: torch.Tensor
    length: int


ReadResult = FileRead | ReadingBuffer | ReadFailure | None
"""What reading one chunk file gave: the chunk, one still being read, why not, or None
when the file is gone."""


@dataclass
class ChunkFileReader:
    """Reads chunk files of one directory. ``open(key)`` gives (fd, whether ``O_DIRECT``);
    ``submit`` runs a background read on the tier's pool; ``on_error(key, exc)`` logs and
    counts a failed read."""

    staging: StagingPool
    head_bytes: int
    open: Callable[[str], tuple[int, bool]]
    submit: Callable[..., Future[bool]]
    on_error: Callable[[str, OSError], None]

    def _opened(self, key: str) -> tuple[int, bool] | ReadFailure | None:
        """``key``'s file open for reading (a regular file only), or why not."""
        try:
            return self.open(key)
        except (FileNotFoundError, NotADirectoryError):
            return None  # gone (or its shard is no directory: no file there either)
        except disk_io.NotAChunkFile:
            return ReadFailure.FOREIGN
        except OSError as exc:  # not the file's fault (descriptors, permissions): kept
            self.on_error(key, exc)
            return (ReadFailure.NO_DESCRIPTORS if disk_io.out_of_descriptors(exc)
                    else ReadFailure.UNREADABLE)

    def read(self, key: str, layers: tuple[int, int] | None) -> ReadResult:
        """The whole chunk, or layers ``layers`` of it framed as a chunk."""
        opened = self._opened(key)
        if not isinstance(opened, tuple):
            return opened
        fd, direct = opened
        buf: torch.Tensor | None = None
        try:
            size = os.fstat(fd).st_size
            header, offset = read_header(fd, direct)
            if header is None or size != offset + header.payload_nbytes:
                return ReadFailure.CORRUPT
            if layers is None:  # the whole file as written: the chunk's own bytes
                buf = self.staging.acquire(disk_io.direct_read_room(0, size))
                if not disk_io.read_into(fd, 0, size, memoryview(buf.numpy()), 0, direct):
                    return self._failed(buf)
                return FileRead(buf, size)
            try:
                lo, length = layer_span(header, layers)
            except ChunkFormatError as exc:
                raise InvalidArgumentError(f"chunk {key}: {exc}") from None
            part = range_header(header, layers)
            at = round_up(header_room(part), PAYLOAD_ALIGN)
            if direct:  # the payload lands at the same offset within a page as on disk
                at += (offset + lo - at) % disk_io.ALIGN
            buf = self.staging.acquire(at + disk_io.direct_read_room(offset + lo, length))
            if not disk_io.read_into(fd, offset + lo, length, memoryview(buf.numpy()), at, direct):
                return self._failed(buf)
            return FileRead(buf, write_header(buf, part, at))
        except OSError as exc:
            return self._failed(buf, key, exc)
        finally:
            os.close(fd)

    def read_head(self, key: str) -> ReadResult:
        """The whole chunk: its header first (sizing the buffer: a file whose size
        disagrees is corrupt before any buffer is taken), then its first ``head_bytes``
        (the header and, for the chunks of common models, the first layer) in one read
        now, the rest on the pool (a :class:`ReadingBuffer`); a small chunk, or an older
        one with an unaligned payload, is read whole."""
        opened = self._opened(key)
        if not isinstance(opened, tuple):
            return opened
        fd, direct = opened
        buf: torch.Tensor | None = None
        handed_over = False
        try:
            size = os.fstat(fd).st_size
            header, offset = read_header(fd, direct)
            if header is None or size != offset + header.payload_nbytes:
                return ReadFailure.CORRUPT
            buf = self.staging.acquire(disk_io.direct_read_room(0, size))
            view = memoryview(buf.numpy())
            head = min(size, self.head_bytes)
            if head == size or offset > head or offset % 8:  # small, or read whole
                if not disk_io.read_into(fd, 0, size, view, 0, direct):
                    return self._failed(buf)
                return FileRead(buf, size)
            if not disk_io.read_into(fd, 0, head, view, 0, direct):
                return self._failed(buf)
            done = self.submit(self._read_rest, key, fd, head, size, view, direct)
            handed_over = True
            return ReadingBuffer(buf[:size], head, done)
        except OSError as exc:
            return self._failed(buf, key, exc)
        finally:
            if not handed_over:
                os.close(fd)

    def _read_rest(self, key: str, fd: int, start: int, size: int, view: memoryview,
                   direct: bool) -> bool:
        """Bytes ``[start, size)`` of an open chunk file into ``view`` at the same offset,
        then close it; False if the file ended first."""
        try:
            return disk_io.read_into(fd, start, size - start, view, start, direct)
        except OSError as exc:
            self.on_error(key, exc)
            raise
        finally:
            os.close(fd)

    def _failed(self, buf: torch.Tensor | None, key: str = "", exc: OSError | None = None
                ) -> ReadFailure:
        """A read that failed: its buffer back, an I/O error logged and counted."""
        if buf is not None:
            self.staging.release(buf)
        if exc is not None:
            self.on_error(key, exc)
        return ReadFailure.CORRUPT


def _parsed(data: memoryview) -> tuple[ChunkHeader | None, int]:
    try:
        return parse_header(data)
    except ChunkFormatError:
        return None, 0


def read_header(fd: int, direct: bool) -> tuple[ChunkHeader | None, int]:
    """The header of an open chunk file and its payload's offset; (None, 0) if unreadable."""
    head = disk_io.read_range(fd, 0, disk_io.HEAD_READ, direct)
    if len(head) >= _PREFIX.size:
        need = _PREFIX.size + _PREFIX.unpack_from(head)[1]
        if len(head) < need <= _PREFIX.size + (1 << 16):
            head = disk_io.read_range(fd, 0, need, direct)
    return _parsed(head)


def read_evicted(path: str, open_read: Callable[[str], tuple[int, bool]]) -> bytes | None:
    """The bytes of an evicted chunk file (renamed aside) for the tier below, read as every
    read is (a regular file only, sized by its header); None where it is no whole chunk."""
    try:
        fd, direct = open_read(path)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        header, offset = read_header(fd, direct)
        if header is None or size != offset + header.payload_nbytes:
            return None
        data = disk_io.read_range(fd, 0, size, direct)
        return data if len(data) == size else None
    except OSError:
        return None
    finally:
        os.close(fd)
