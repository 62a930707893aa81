"""Whole-chunk GETs read straight into reused host buffers: one copy, kernel to buffer.

redis-py's parsers build every reply as a fresh ``bytes`` (hiredis reads the socket into
its own buffer, then copies the value out): two copies and a chunk-sized allocation per
chunk, which on a VM that backs fresh memory slowly costs several times the socket
itself. Here the GETs of a batch go out in one write on a connection of the tier's own
blocking pool (redis-py connects, authenticates and selects the database), and each
reply's bulk header is read, then its value ``recv_into`` a buffer from the tier's
:class:`~kvtier.connectors.tiers.host_buffers.StagingPool`.

Only the RESP framing of a GET reply is parsed here: ``$<n>\\r\\n<n bytes>\\r\\n``, ``$-1``
(nil, or ``_`` under RESP3) and ``-ERR``. Anything else, a short read, a timeout or a
deadline passed leaves the connection in an unknown state: it is disconnected (never
reused mid-reply), every buffer taken is given back, and the error propagates (the tier
turns it into misses). The read runs in the calling thread, so no buffer is handed back
while a read into it may still be going on.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence

import torch
from redis import exceptions as rexc

MAX_HEADER = 64
"""Longest bulk header accepted (``$`` + a 64-bit length + CRLF is 23 bytes)."""


class ReplyError(rexc.ResponseError):
    """The server answered a GET with an error."""


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
        if len(line) > MAX_HEADER:
            raise rexc.InvalidResponse(f"Redis reply header too long: {bytes(line[:32])!r}")
        _recv_exact_into(sock, memoryview(one), deadline)
        line += one
    return bytes(line[:-2])


def get_into(
    pool: object,
    keys: Sequence[str],
    acquire: Callable[[int], torch.Tensor],
    release: Callable[[torch.Tensor], None],
    timeout_s: float,
) -> list[tuple[torch.Tensor, int] | None]:
    """GET every key on one connection of ``pool`` (a redis-py blocking pool), each value
    read into a buffer from ``acquire``: (buffer, length) per key, None where it is
    missing. Bounded by ``timeout_s`` in all (and by the socket timeout per read)."""
    if not keys:
        return []
    deadline = time.monotonic() + timeout_s
    conn = pool.get_connection()  # type: ignore[attr-defined]
    out: list[tuple[torch.Tensor, int] | None] = []
    done = False
    try:
        conn.send_packed_command(conn.pack_commands([("GET", k) for k in keys]))
        sock = conn._sock  # redis-py's socket: nothing of these replies was read ahead
        if sock is None:
            raise rexc.ConnectionError("Redis connection closed before the replies")
        for _ in keys:
            out.append(_read_value(sock, acquire, release, deadline))
        done = True
        return out
    finally:
        if not done:
            conn.disconnect()  # mid-reply: never handed to another caller
            for got in out:
                if got is not None:
                    release(got[0])
        pool.release(conn)  # type: ignore[attr-defined]


def _read_value(sock: socket.socket, acquire: Callable[[int], torch.Tensor],
                release: Callable[[torch.Tensor], None], deadline: float
                ) -> tuple[torch.Tensor, int] | None:
    line = _read_line(sock, deadline)
    kind, rest = line[:1], line[1:]
    if kind == b"-":
        raise ReplyError(rest.decode("utf-8", "replace"))
    if kind == b"_" or (kind == b"$" and rest == b"-1"):
        return None
    if kind != b"$" or not rest.isdigit():
        raise rexc.InvalidResponse(f"not a bulk reply to GET: {line[:32]!r}")
    n = int(rest)
    buf = acquire(n)
    try:
        _recv_exact_into(sock, memoryview(buf.numpy())[:n], deadline)
        crlf = bytearray(2)
        _recv_exact_into(sock, memoryview(crlf), deadline)
        if crlf != b"\r\n":
            raise rexc.InvalidResponse("bulk reply not terminated by CRLF")
    except BaseException:
        release(buf)
        raise
    return buf, n
