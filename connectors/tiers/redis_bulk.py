"""Whole-chunk GETs read straight into reused host buffers: one copy, kernel to buffer.

redis-py's parsers build every reply as a fresh ``bytes`` (hiredis reads the socket into
its own buffer, then copies the value out): two copies and a chunk-sized allocation per
chunk, which on a VM that backs fresh memory slowly costs several times the socket
itself. Here the GETs of a batch go out in one write on a connection of the tier's own
blocking pool (redis-py connects, authenticates and selects the database), and each
reply's bulk header is read, then the value's chunk header (its fixed prefix, then the
header it announces), and only a value whose length is what its header says takes a
buffer from the tier's :class:`~kvtier.connectors.tiers.host_buffers.StagingPool`; the
rest is ``recv_into`` it. A value whose header is unreadable or disagrees with its length
(one grown to hundreds of MiB) is read through a small scratch buffer and dropped: a
miss that costs no memory, reported as :attr:`BadValue.NOT_A_CHUNK` (the tier deletes it).

Only the RESP framing of a GET reply is parsed here: ``$<n>\\r\\n<n bytes>\\r\\n``, ``$-1``
(nil, or ``_`` under RESP3) and ``-ERR``. An error reply is that key's alone (a value of
another type, ``WRONGTYPE``, is :attr:`BadValue.WRONG_TYPE`): the other keys of the batch
are read on. Anything else, a short read, a timeout or a deadline passed leaves the
connection in an unknown state: it is disconnected (never reused mid-reply), every buffer
taken is given back, and the batch is all misses (:attr:`BulkReads.fault`). The read runs
in the calling thread, so no buffer is handed back while a read into it may still be
going on.
"""

from __future__ import annotations

import enum
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from redis import exceptions as rexc

from kvtier.chunk_format import MAGIC, MAX_HEADER_BYTES, parse_header
from kvtier.connectors.tiers.redis_client import FAULTS
from kvtier.errors import ChunkFormatError

MAX_HEADER = 64
"""Longest bulk header accepted (``$`` + a 64-bit length + CRLF is 23 bytes)."""
MAX_ERROR_LINE = 4096
"""Longest error reply accepted (``-WRONGTYPE Operation against a key ...`` is 70 bytes)."""
SKIP_BYTES = 256 << 10
"""The scratch a value that is not a chunk is read through."""
_PREFIX = struct.Struct("<4sI")
"""A chunk's fixed prefix: magic, header length."""


def _recv_exact_into(sock: socket.socket, view: memoryview, deadline: float) -> None:
    got = 0
    while got < len(view):
        if time.monotonic() > deadline:
            raise rexc.TimeoutError("Redis GET past its deadline")
        n = sock.recv_into(view[got:])
        if n == 0:
            raise rexc.ConnectionError("Redis closed the connection mid-reply")
        got += n


def _read_line(sock: socket.socket, deadline: float) -> bytes:
    """One CRLF-terminated line, read a byte at a time (the value that follows must
    land in its buffer, never in a read-ahead of ours)."""
    line = bytearray()
    one = bytearray(1)
    while not line.endswith(b"\r\n"):
        if len(line) > (MAX_ERROR_LINE if line.startswith(b"-") else MAX_HEADER):
            raise rexc.InvalidResponse(f"Redis reply header too long: {bytes(line[:32])!r}")
        _recv_exact_into(sock, memoryview(one), deadline)
        line += one
    return bytes(line[:-2])


class BadValue(enum.Enum):
    """Why a key's GET gave no chunk though something is stored under it."""

    NOT_A_CHUNK = "not_a_chunk"
    """A string whose chunk header is unreadable or disagrees with its length."""
    WRONG_TYPE = "wrong_type"
    """A value of another type (a list, a hash, ...): Redis answered ``WRONGTYPE``."""
    ERROR = "error"
    """Another error reply to this key's GET."""


Value = tuple[torch.Tensor, int] | BadValue | None
"""One key's reply: (buffer, length) of a value whose header matched its length, why
there is none, or None (nil: nothing stored)."""


@dataclass
class BulkReads:
    """What a batch of GETs found: each key's :data:`Value` (all None after a fault), and
    the fault that ended the batch, if any (a dropped connection: the tier counts it)."""

    values: list[Value]
    fault: BaseException | None = None

    def bad(self) -> dict[int, BadValue]:
        """The keys (by position) whose value is not a chunk or answered an error."""
        return {i: v for i, v in enumerate(self.values) if isinstance(v, BadValue)}


def get_into(
    pool: object,
    keys: Sequence[str],
    acquire: Callable[[int], torch.Tensor],
    release: Callable[[torch.Tensor], None],
    timeout_s: float,
) -> BulkReads:
    """GET every key on one connection of ``pool`` (a redis-py blocking pool), each chunk
    read into a buffer from ``acquire``, sized by its header. Bounded by ``timeout_s`` in
    all (and by the socket timeout per read). A fault (connection lost, timeout, a reply
    that breaks the framing) makes every key a miss, each value found not a chunk before
    it kept as such (so the tier still deletes it)."""
    reads = BulkReads([None] * len(keys))
    if not keys:
        return reads
    deadline = time.monotonic() + timeout_s
    try:
        conn = pool.get_connection()  # type: ignore[attr-defined]
    except FAULTS as exc:
        reads.fault = exc
        return reads
    done = False
    try:
        conn.send_packed_command(conn.pack_commands([("GET", k) for k in keys]))
        sock = conn._sock  # redis-py's socket: nothing of these replies was read ahead
        if sock is None:
            raise rexc.ConnectionError("Redis connection closed before the replies")
        for i in range(len(keys)):
            reads.values[i] = _read_value(sock, acquire, release, deadline)
        done = True
    except FAULTS as exc:
        reads.fault = exc
    finally:
        if not done:
            conn.disconnect()  # mid-reply: never handed to another caller
            for i, got in enumerate(reads.values):
                if isinstance(got, tuple):
                    release(got[0])
                if not isinstance(got, BadValue):
                    reads.values[i] = None
        pool.release(conn)  # type: ignore[attr-defined]
    return reads


def _read_value(sock: socket.socket, acquire: Callable[[int], torch.Tensor],
                release: Callable[[torch.Tensor], None], deadline: float) -> Value:
    line = _read_line(sock, deadline)
    kind, rest = line[:1], line[1:]
    if kind == b"-":
        return BadValue.WRONG_TYPE if rest.startswith(b"WRONGTYPE") else BadValue.ERROR
    if kind == b"_" or (kind == b"$" and rest == b"-1"):
        return None
    if kind != b"$" or not rest.isdigit():
        raise rexc.InvalidResponse(f"not a bulk reply to GET: {line[:32]!r}")
    n = int(rest)
    head = _read_head(sock, n, deadline)
    if head.length != n:
        _skip(sock, n - len(head.data), deadline)
        return BadValue.NOT_A_CHUNK
    buf = acquire(n)
    try:
        view = memoryview(buf.numpy())
        view[: len(head.data)] = head.data
        _recv_exact_into(sock, view[len(head.data) : n], deadline)
        _end_of_value(sock, deadline)
    except BaseException:
        release(buf)
        raise
    return buf, n


@dataclass
class _Head:
    data: bytearray
    """The value's first bytes read (its chunk prefix and header, or less)."""
    length: int | None
    """The chunk length its header says (None: no readable header)."""


def _read_head(sock: socket.socket, n: int, deadline: float) -> _Head:
    """A value of ``n`` bytes' chunk prefix and header, read off the socket (at most
    ``8 + MAX_HEADER_BYTES`` bytes), and the length they say it has."""
    data = bytearray(min(n, _PREFIX.size))
    _recv_exact_into(sock, memoryview(data), deadline)
    if len(data) < _PREFIX.size:
        return _Head(data, None)
    magic, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC or hlen > MAX_HEADER_BYTES or _PREFIX.size + hlen > n:
        return _Head(data, None)
    data += bytes(hlen)
    _recv_exact_into(sock, memoryview(data)[_PREFIX.size :], deadline)
    try:
        header, offset = parse_header(data)
    except ChunkFormatError:
        return _Head(data, None)
    return _Head(data, offset + header.payload_nbytes)


def _skip(sock: socket.socket, n: int, deadline: float) -> None:
    """Read and drop the ``n`` bytes left of a value, and its CRLF, through a small
    scratch buffer: the connection stays in step, and nothing value-sized is allocated."""
    scratch = memoryview(bytearray(min(max(n, 1), SKIP_BYTES)))
    while n > 0:
        step = min(n, len(scratch))
        _recv_exact_into(sock, scratch[:step], deadline)
        n -= step
    _end_of_value(sock, deadline)


def _end_of_value(sock: socket.socket, deadline: float) -> None:
    crlf = bytearray(2)
    _recv_exact_into(sock, memoryview(crlf), deadline)
    if crlf != b"\r\n":
        raise rexc.InvalidResponse("bulk reply not terminated by CRLF")
