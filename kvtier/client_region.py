"""The client's side of a shared-memory region (``POST /v1/regions``): a same-host client
maps the file the server made and moves chunk bytes through it instead of a socket.

:class:`RegionLink` creates the region on first use, grows it (a new one) when a chunk
does not fit, and deletes it on close. A request through the region that got no answer (a
timeout, a dropped connection) costs the region: the server may still be writing into it
or reading from it, so this side never lends or fills it again (:meth:`RegionLink.abandon`). Where the server offers no regions or the client
cannot open the file (another host, another user), it says so once and the caller goes on
with HTTP bodies.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

MIN_REGION = 1 << 20

Send = Callable[[str, str, dict[str, Any] | None, Any], tuple[int, bytes]]
"""(method, path, params, json body) -> (status, response body): one HTTP request."""


class RegionUnavailable(Exception):
    """No region can be used with this server (the caller uses HTTP bodies)."""


class RegionLink:
    def __init__(self, send: Send) -> None:
        self._send = send
        self.id: str | None = None
        self._mem: mmap.mmap | None = None
        self.size = 0
        self._abandoned: list[str] = []
        """Regions given up after a request without an answer: deleted once the server
        answers again (when the next region is opened), else reclaimed by their lease."""

    def _open(self, size: int) -> None:
        self.close()
        self._delete_abandoned()
        status, body = self._send("POST", "/v1/regions", None, {"bytes": size})
        if status != 201:
            raise RegionUnavailable(f"the server offers no region ({status}: {body[:200]!r})")
        info = json.loads(body)
        self.id = info["id"]
        try:
            fd = os.open(info["path"], os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:  # another host, or another user: not ours to map
            self.close()
            raise RegionUnavailable(f"cannot open the region's file: {exc.strerror}") from None
        try:
            if os.fstat(fd).st_size != info["bytes"]:
                self.close()
                raise RegionUnavailable("the region's file is not the size the server gave")
            self._mem = mmap.mmap(fd, info["bytes"])
        finally:
            os.close(fd)
        self.size = info["bytes"]

    def room(self, nbytes: int) -> memoryview:
        """The region's first ``nbytes`` bytes (a bigger region made where needed)."""
        if self._mem is None or self.size < nbytes:
            self._open(max(nbytes, MIN_REGION, 2 * self.size))
        assert self._mem is not None
        return memoryview(self._mem)[:nbytes]

    def forget(self) -> None:
        """Drop a region the server no longer knows (the next use makes a new one)."""
        self.id = None
        self.close()

    def abandon(self) -> None:
        """Never use this region again: a request through it got no answer, and the server
        may still write the chunks it was asked for into it (over what this side would
        lend next) or read a chunk out of it (while this side fills the next). The next
        use makes a new region; this one is deleted once the server answers again."""
        if self.id is not None:
            self._abandoned.append(self.id)
            self.id = None
        self.close()

    def _delete_abandoned(self) -> None:
        while self._abandoned:
            try:
                self._send("DELETE", f"/v1/regions/{self._abandoned[0]}", None, None)
            except Exception as exc:  # noqa: BLE001 - still no answer: its lease reclaims it
                log.debug("could not delete abandoned region %s: %s", self._abandoned[0], exc)
                return
            self._abandoned.pop(0)

    def close(self) -> None:
        if self._mem is not None:
            with contextlib.suppress(BufferError):  # a view still alive: unmapped when collected
                self._mem.close()
            self._mem = None
        if self.id is not None:
            try:
                self._send("DELETE", f"/v1/regions/{self.id}", None, None)
            except Exception as exc:  # noqa: BLE001 - the server removes it when it stops
                log.debug("could not delete region %s: %s", self.id, exc)
            self.id = None
        self.size = 0
