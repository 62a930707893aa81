"""File primitives of the disk tier: durable temp-file writes and positional reads, buffered
or through O_DIRECT.

O_DIRECT bypasses the page cache (the KV working set would otherwise evict everything else
from it) but needs buffers, offsets and lengths aligned to the device block; aligned buffers
come from anonymous ``mmap`` (page-aligned). Files are written padded to the alignment and
truncated back to their length. A filesystem that refuses O_DIRECT (ramfs, some FUSE or
network mounts) raises EINVAL; the caller then falls back to buffered I/O.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
from typing import NamedTuple

import numpy as np

from kvtier.policies.eviction import ChunkInfo

log = logging.getLogger(__name__)

ALIGN = 4096
HEAD_READ = 4096
"""Bytes read first for a layer-range read: enough for the header of a chunk of
hundreds of layers; longer headers take a second read."""


NO_DESCRIPTORS = "descriptors_exhausted"
"""The ``PutResult.failed`` reason of a write that could not open its file for want of
descriptors (the service answers 503, not 507: nothing is full)."""


def out_of_descriptors(exc: OSError) -> bool:
    """The process (EMFILE) or the system (ENFILE) has no descriptor left."""
    return exc.errno in (errno.EMFILE, errno.ENFILE)


def failure_reason(exc: OSError) -> str:
    """The ``PutResult.failed`` reason for a write error."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "disk_full"
    if out_of_descriptors(exc):
        return f"{NO_DESCRIPTORS}: {exc.strerror or exc}"
    return f"io_error: {exc.strerror or exc}"


class Doomed(NamedTuple):
    """An evicted chunk's file, renamed aside under the tier's lock (a re-put of its key
    is unaffected), to be read for the tier below or removed after it; ``info``: what its
    writer said of it, handed down with it."""

    key: str
    path: str
    info: ChunkInfo | None


def unlink_if_present(path: str | os.PathLike[str]) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def fsync_dir(path: str) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DirectIOUnsupported(OSError):
    """The filesystem refused O_DIRECT."""


def _round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def _open_direct(path: str, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise DirectIOUnsupported(exc.errno, f"O_DIRECT refused: {exc.strerror}") from None
        raise


def write_file(path: str, blob: bytes | bytearray | memoryview, sync: bool, direct: bool) -> None:
    """Create ``path`` (which must not exist) holding ``blob``; with ``sync`` its data and
    length are on the device before this returns."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    fd = _open_direct(path, flags) if direct else os.open(path, flags, 0o644)
    try:
        if direct:
            _write_direct(fd, blob)
        else:
            _write_all(fd, memoryview(blob).cast("B"))
        if sync:
            os.fdatasync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview, offset: int = 0) -> None:
    while offset < len(data):
        offset += os.pwrite(fd, data[offset:], offset)


def address(view: memoryview) -> int:
    """The address of a buffer's first byte (to check O_DIRECT's alignment)."""
    if not len(view):
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _write_direct(fd: int, blob: bytes | bytearray | memoryview) -> None:
    """Write ``blob`` with O_DIRECT: its whole pages straight from its memory where it is
    page-aligned (a slot of the CPU arena or of a staging buffer), the rest through a
    page-sized bounce buffer; the file is padded to a page and truncated back."""
    data = memoryview(blob).cast("B")
    n = len(data)
    head = n - n % ALIGN if address(data) % ALIGN == 0 else 0
    try:
        if head:
            _write_all(fd, data[:head])
        rest = n - head
        if rest or not n:
            buf = mmap.mmap(-1, max(_round_up(rest), ALIGN))
            try:
                buf[:rest] = data[head:]
                view = memoryview(buf)
                done = 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], head + done)
                view.release()
            finally:
                buf.close()
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise DirectIOUnsupported(exc.errno, f"O_DIRECT write refused: {exc.strerror}") from None
        raise
    os.ftruncate(fd, n)


class NotAChunkFile(OSError):
    """Something other than a regular file where a chunk file belongs (a FIFO, a
    directory, a symlink, a socket, a device): never read from; the tier moves it aside."""


_NOT_A_FILE_ERRNOS = frozenset({errno.ELOOP, errno.ENXIO, errno.EISDIR})
"""What opening a non-file for reading may fail with: a symlink under ``O_NOFOLLOW``, a
socket, a directory."""


def open_read(path: str, direct: bool) -> int:
    """A descriptor to read the regular file ``path``, checked without ever blocking:
    opened with ``O_NONBLOCK`` (a FIFO does not wait for a writer) and ``O_NOFOLLOW``, then
    refused (:class:`NotAChunkFile`) unless ``fstat`` says it is a regular file; only then
    are ``O_NONBLOCK`` cleared and, with ``direct``, ``O_DIRECT`` set (a filesystem that
    refuses it raises :class:`DirectIOUnsupported`)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in _NOT_A_FILE_ERRNOS:
            raise NotAChunkFile(exc.errno, f"not a regular file: {exc.strerror}", path) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotAChunkFile(errno.EINVAL, f"not a regular file (mode {mode:o})", path)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | (os.O_DIRECT if direct else 0))
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                raise DirectIOUnsupported(exc.errno, f"O_DIRECT refused: {exc.strerror}") from None
            raise
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_range(fd: int, offset: int, length: int, direct: bool) -> bytes:
    """Up to ``length`` bytes at ``offset`` (fewer at end of file)."""
    if length <= 0:
        return b""
    if not direct:
        parts = []
        got = 0
        while got < length:
            part = os.pread(fd, length - got, offset + got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        return b"".join(parts)
    start = offset - offset % ALIGN
    size = _round_up(offset + length) - start
    buf = mmap.mmap(-1, size)
    try:
        view = memoryview(buf)
        got = 0
        while got < size:
            want = size - got
            n = os.preadv(fd, [view[got:]], start + got)
            got += max(n, 0)
            if n < want:  # end of file (a short O_DIRECT read is never resumed unaligned)
                break
        end = min(got, offset - start + length)
        data = bytes(view[offset - start : max(end, offset - start)])
        view.release()
        return data
    finally:
        buf.close()


def read_into(fd: int, offset: int, length: int, buf: memoryview, at: int, direct: bool) -> bool:
    """Read ``length`` bytes at file ``offset`` into ``buf[at : at + length]``, with no
    intermediate copy; False when the file ends first (a truncated file). With ``direct``
    the read is widened to whole pages, so ``buf`` must be page-aligned at
    ``at - offset % ALIGN`` and have room for the widened read (see
    :func:`direct_read_room`); the bytes around the asked range are overwritten."""
    if length <= 0:
        return True
    if not direct:
        got = 0
        while got < length:
            n = os.preadv(fd, [buf[at + got : at + length]], offset + got)
            if n <= 0:
                return False
            got += n
        return True
    delta = offset % ALIGN
    lo, size = at - delta, _round_up(delta + length)
    if lo < 0 or lo + size > len(buf) or address(buf[lo:]) % ALIGN:
        raise ValueError("O_DIRECT read into a buffer that is not page-aligned or too short")
    got = 0
    while got < delta + length:
        n = os.preadv(fd, [buf[lo + got : lo + size]], offset - delta + got)
        if n <= 0:
            return False
        got += n
        if got % ALIGN:  # end of file: a short O_DIRECT read is never resumed unaligned
            break
    return got >= delta + length


def direct_read_room(offset: int, length: int) -> int:
    """Bytes past ``at - offset % ALIGN`` an O_DIRECT :func:`read_into` may write."""
    return _round_up(offset % ALIGN + length)


class ChunkFiles:
    """Opens and writes one directory's chunk files through O_DIRECT while its filesystem
    takes it, buffered from the first refusal on (warned once); ``fsync``: writes are
    synced."""

    def __init__(self, label: str, direct: bool, fsync: bool) -> None:
        self.label = label
        self.direct = direct
        """Whether I/O bypasses the page cache now (False after a fallback)."""
        self.fsync = fsync

    def _refused(self, exc: OSError) -> None:
        if self.direct:
            self.direct = False
            log.warning("disk tier %s: the filesystem refuses O_DIRECT (%s); using buffered I/O",
                        self.label, exc.strerror)

    def open_read(self, path: str) -> tuple[int, bool]:
        """A file descriptor to read the regular file ``path`` from, and whether it is
        O_DIRECT (:func:`open_read`: anything else raises :class:`NotAChunkFile`)."""
        direct = self.direct
        try:
            return open_read(path, direct), direct
        except DirectIOUnsupported as exc:
            self._refused(exc)
            return open_read(path, False), False

    def write(self, path: str, data: memoryview) -> None:
        """Write ``path`` whole (see :func:`write_file`)."""
        try:
            write_file(path, data, self.fsync, self.direct)
        except DirectIOUnsupported as exc:
            unlink_if_present(path)
            self._refused(exc)
            write_file(path, data, self.fsync, False)
