"""Chunk bodies over plain HTTP/1.1 with the standard library, for :class:`kvtier.client.Client`
(which sends its lookups and prefetches this way too: a vLLM scheduler waits on them).

httpx moves a 32 MiB body through h11's receive buffer in 64 KiB reads and joins the pieces
at the end; for the chunk routes that costs more than the loopback socket itself. Here a
PUT sends the caller's buffer as it is (one ``sendall``) and a GET reads the reply straight
into the caller's buffer (``readinto``) or into one ``bytes`` of the reply's length. Each
thread keeps its own keep-alive connection (``http.client`` connections are not
thread-safe); a request on a connection the server closed meanwhile is sent again once on a
fresh one (every chunk request is idempotent: chunks are content-addressed). A connection
that failed in any other way (a timeout, a reply left unread or cut short) is closed and
forgotten, never used again: ``http.client`` keeps such a connection half-way through its
last exchange, and each later request on it would fail at once. A server that cannot be
reached raises ``OSError`` (``ConnectionError``, ``TimeoutError``) where the httpx path
raises ``httpx.TransportError``; an error status is a :class:`ServiceError` on both.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Collection, Mapping
from typing import Any
from urllib.parse import urlencode, urlsplit

from kvtier.errors import InvalidArgumentError, KVTierError

_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
          http.client.CannotSendRequest)
"""Failures of a reused keep-alive connection that say only that it went stale (the server
closed it between requests): the request is sent again once, on a fresh connection."""

ACCEPT_CODECS_HEADER = "X-KVTier-Accept-Codecs"
"""The request header naming the codecs of stored KV a reader takes (comma-separated:
``none`` is exact KV): its lookups skip tiers of other codecs, its reads refuse their
chunks (see ``kvtier.server.reader_codecs``)."""


def accept_header(codecs: Collection[str]) -> str:
    """The :data:`ACCEPT_CODECS_HEADER` value for ``codecs`` (at least one)."""
    names = sorted({str(c) for c in codecs})
    if not names:
        raise InvalidArgumentError("accept_codecs names no codec: give [none] for exact KV only")
    return ",".join(names)


class ServiceError(KVTierError):
    """The service answered with an error status."""

    def __init__(self, status: int, type_: str, message: str) -> None:
        super().__init__(f"HTTP {status} {type_}: {message}")
        self.status = status
        self.type = type_
        self.message = message


def error_from(status: int, body: bytes) -> ServiceError:
    """The service's JSON error body as a :class:`ServiceError` (any other body as text)."""
    try:
        err = json.loads(body)["error"]
        return ServiceError(status, err["type"], err["message"])
    except (ValueError, KeyError, TypeError):
        return ServiceError(status, "http_error", body[:500].decode(errors="replace"))


class ChunkWire:
    """Per-thread keep-alive connections to one ``http://`` base URL."""

    def __init__(self, base_url: str, headers: Mapping[str, str], timeout: float) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise InvalidArgumentError(f"the chunk wire speaks plain http://, got {base_url!r}")
        self.host, self.port = url.hostname, url.port or 80
        self.prefix = url.path.rstrip("/")
        self.headers = dict(headers)
        self.timeout = timeout
        """Seconds any one send or receive may wait (``http.client``'s socket timeout)."""
        self._local = threading.local()
        self._all: set[http.client.HTTPConnection] = set()
        self._lock = threading.Lock()

    def _conn(self) -> http.client.HTTPConnection:
        """This thread's connection; a fresh one where its last reply was left unread
        (a read that failed or timed out part-way): that connection is out of step."""
        last = getattr(self._local, "last", None)
        if last is not None and not last.isclosed():
            self.discard()
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            self._local.conn = conn
            with self._lock:
                self._all.add(conn)
        return conn

    @property
    def open_connections(self) -> int:
        """Connections made and not closed yet, every thread's."""
        with self._lock:
            return len(self._all)

    def discard(self) -> None:
        """Close this thread's connection and forget it: the next request opens a new one."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = self._local.last = None
        if conn is not None:
            with self._lock:
                self._all.discard(conn)
            conn.close()

    def request(
        self, method: str, path: str, params: Mapping[str, Any] | None = None,
        body: Any = None, headers: Mapping[str, str] | None = None,
    ) -> http.client.HTTPResponse:
        """Send one request and return its response with the body unread (read it all
        before the next request on this thread; a reply left unread costs the connection).
        Any failure closes the connection."""
        target = self.prefix + path + ("?" + urlencode(params) if params else "")
        merged = {**self.headers, **(headers or {})}
        if body is not None:
            merged["Content-Length"] = str(memoryview(body).nbytes)
        for attempt in (0, 1):
            conn = self._conn()
            reused = conn.sock is not None
            try:
                conn.request(method, target, body=body, headers=merged)
                resp = conn.getresponse()
            except _STALE:
                self.discard()
                if attempt or not reused:
                    raise
                continue
            except BaseException:
                self.discard()
                raise
            self._local.last = resp
            return resp
        raise AssertionError("unreachable")

    def read_into(self, resp: http.client.HTTPResponse, out: memoryview) -> memoryview:
        """The reply's body read into ``out`` (which must hold it): the filled part."""
        n = int(resp.getheader("content-length") or -1)
        if n < 0:
            data = resp.read()
            n = len(data)
            if n > len(out):
                raise InvalidArgumentError(f"a {n}-byte chunk does not fit a {len(out)}-byte buffer")
            out[:n] = data
            return out[:n]
        if n > len(out):
            resp.read()  # leave the connection usable
            raise InvalidArgumentError(f"a {n}-byte chunk does not fit a {len(out)}-byte buffer")
        got = 0
        while got < n:
            m = resp.readinto(out[got:n])
            if not m:
                raise http.client.IncompleteRead(b"", n - got)
            got += m
        return out[:n]

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, set()
        for conn in conns:
            conn.close()
