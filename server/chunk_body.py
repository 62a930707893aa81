"""Chunk bodies on the wire without chunk-sized allocations.

An upload with a ``Content-Length`` streams into a reused staging buffer (the pieces the
server receives are copied once, to where the chunk is verified and handed to the tiers);
a download streams out of the tier's own memory: a verified view held under the tier's
lease (the CPU arena's slot, the disk tier's staging buffer), released once the last byte
is sent or the client goes away. Neither joins the body into one ``bytes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import torch
from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from kvtier.connectors.tiers.host_buffers import StagingPool
from kvtier.server.errors import RouteError
from kvtier.server.reply_budget import Reservation

log = logging.getLogger(__name__)

PIECE = 1 << 20
"""Bytes per write of a download: the socket drains between pieces, so the transport
buffers at most one piece's unsent tail."""


def declared_length(request: Request) -> int | None:
    """The upload's ``Content-Length`` (None for a chunked upload)."""
    raw = request.headers.get("content-length")
    return None if raw is None else int(raw)  # the body-limit middleware checked it parses


@contextlib.asynccontextmanager
async def staged_body(request: Request, staging: StagingPool, length: int, front: int = 0
                      ) -> AsyncIterator[torch.Tensor]:
    """The upload's bytes in a staging buffer (a uint8 view of ``front`` free bytes, then
    exactly ``length`` bytes of body), given back when the block ends. A body that is
    shorter or longer than it declared is a 400 (the connection was cut, or the client
    lied). ``front``: room for a chunk's header to grow (see ``bind_namespace``)."""
    # A new buffer is mapped and pre-faulted (MAP_POPULATE): a second or more for hundreds
    # of MiB, which must not happen on the event loop.
    buf = await run_in_threadpool(staging.acquire, front + length)
    try:
        mem = memoryview(buf.numpy())[front:]
        pos = 0
        async for piece in request.stream():
            end = pos + len(piece)
            if end > length:
                raise RouteError(400, f"body is longer than its Content-Length ({length} bytes)")
            mem[pos:end] = piece
            pos = end
        if pos != length:
            raise RouteError(400, f"body ended after {pos} of its {length} bytes")
        yield buf[: front + length]
    finally:
        staging.release(buf)


class PiecewiseResponse(Response):
    """Send a body given as parts (headers and chunks' own bytes), each in pieces of at
    most :data:`PIECE` bytes: no part is joined or copied, and no write is so large that
    the transport copies hundreds of MiB of unsent tail on the event loop.

    ``reservation``: what the reply holds against the reply budget, released once it is
    written or abandoned; ``write_timeout_s``: a write the client does not take within it
    cuts the reply off (the client stopped reading)."""

    def __init__(self, parts: list[bytes | memoryview], media_type: str,
                 headers: dict[str, str] | None = None, reservation: Reservation | None = None,
                 write_timeout_s: float | None = None) -> None:
        super().__init__(None, headers=headers, media_type=media_type)
        self._parts = [memoryview(p).cast("B") for p in parts]
        self.headers["content-length"] = str(sum(len(p) for p in self._parts))
        self._reservation = reservation
        self._timeout = write_timeout_s

    async def _send(self, send: Send, message: Message) -> None:
        if self._timeout is None:
            await send(message)
        else:
            await asyncio.wait_for(send(message), self._timeout)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._send(send, {"type": "http.response.start", "status": self.status_code,
                                    "headers": self.raw_headers})
            for part in self._parts:
                for start in range(0, len(part), PIECE):
                    await self._send(send, {"type": "http.response.body",
                                            "body": part[start : start + PIECE],
                                            "more_body": True})
            await self._send(send, {"type": "http.response.body", "body": b"",
                                    "more_body": False})
        except asyncio.TimeoutError:
            log.warning("a client stopped reading its reply for %.0f s: cut off", self._timeout)
        finally:
            self._parts = []
            await self._done()

    async def _done(self) -> None:
        if self._reservation is not None:
            self._reservation.release()


class LeasedResponse(PiecewiseResponse):
    """Send ``view`` (uint8, CPU) in pieces, then close ``lease`` (on a worker thread: a
    tier's release may take its lock); the lease is closed even if the client goes away
    or stops reading."""

    def __init__(
        self, view: torch.Tensor, lease: contextlib.ExitStack, headers: dict[str, str],
        media_type: str, reservation: Reservation | None = None,
        write_timeout_s: float | None = None,
    ) -> None:
        super().__init__([memoryview(view.numpy())], media_type, headers, reservation,
                         write_timeout_s)
        self._lease = lease

    async def _done(self) -> None:
        try:
            await run_in_threadpool(self._lease.close)
        finally:
            await super()._done()
