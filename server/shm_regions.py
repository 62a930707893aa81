"""Shared-memory regions: a same-host client's chunk bytes cross no socket.

Over loopback HTTP a chunk is copied by the kernel into a socket, out of it in pieces, and
once more into a staging buffer; the sidecar's PUT runs at a fraction of the memory's speed
(docs/performance.md). A client on the same host may instead ask for a region: a file in a
memory filesystem (``server.shm_dir``, ``/dev/shm`` by default) that the server creates
with mode 0600 under a random name and maps, and that the client maps too. A PUT then names
``region``, ``offset`` and ``length`` instead of carrying a body, and a GET names a region
and offset to receive the chunk there.

What keeps the data path's promises:

- The server copies an upload out of the region into memory only it can write *before* it
  verifies it: a client that changes the region afterwards cannot change what was checked.
- The server never maps a region. A mapping of a file the client can shrink (``ftruncate``)
  faults with SIGBUS on the first touch past the new end, and a file in a memory
  filesystem with too little room faults the same way when a page cannot be allocated:
  either would take the whole service down. Bytes move with ``preadv``/``pwritev`` on the
  region's descriptor instead (one copy, as through a mapping): a short read is a 400
  ("the region shrank"), a write the filesystem cannot hold a 507. Region memory is
  reserved when the region is made (``posix_fallocate``), so a region the filesystem
  cannot hold is refused with 507 at creation, not found out at the first large GET.
- A region belongs to the tenant that created it; another tenant naming it gets a 404, as
  for a region that does not exist. The file is the server user's, mode 0600: a process
  of another user cannot open it (it uses HTTP bodies), one of the same user could anyway
  read the server's memory.
- Regions count against ``server.shm_bytes`` in total, ``server.shm_bytes_per_tenant`` and
  ``server.shm_regions_per_tenant`` each. They are removed on ``DELETE``, when the server
  stops, and when their lease runs out: a region no request used for
  ``server.shm_lease_s`` is reclaimed (a client that died holds nothing for long); a
  tenant lists its regions with ``GET /v1/regions``.
- Every server holds an exclusive ``flock`` on a lock file of its own, and its regions'
  names carry that lock file's id: at start-up a server removes every region whose server's
  lock is free (it died), whatever its PID, and the lock files with them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.server.errors import RouteError

log = logging.getLogger(__name__)

PREFIX = "kvtier-region-"
_NAME_RE = re.compile(rf"{PREFIX}([0-9a-f]{{16}})-([0-9a-f]{{32}})")
_LOCK_RE = re.compile(rf"{PREFIX}([0-9a-f]{{16}})\.lock")
_LEGACY_RE = re.compile(rf"{PREFIX}(\d+)-([0-9a-f]{{32}})")
"""Regions of servers before lock files: named by the server's pid."""
_ID_RE = re.compile(r"[0-9a-f]{32}")


@dataclass
class Region:
    """One region: its file, held open (never mapped) by the server."""

    id: str
    tenant: str
    path: Path
    size: int
    fd: int
    users: int = 0
    deleted: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)
    """When a request last used (or renewed) it: its lease runs from here."""

    def _span(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise RouteError(400, f"bytes {offset}..{offset + length} lie outside region "
                             f"{self.id} ({self.size} bytes)")

    def read_into(self, offset: int, dst: memoryview) -> None:
        """Fill ``dst`` with the region's bytes from ``offset`` (one copy, no mapping); a
        400 when the client shrank the region under them."""
        self._span(offset, len(dst))
        done = 0
        while done < len(dst):
            n = os.preadv(self.fd, [dst[done:]], offset + done)
            if n == 0:
                raise RouteError(400, f"region {self.id} ends at byte {offset + done}: it was "
                                 f"shrunk below the {offset + len(dst)} bytes named",
                                 "region_shrunk")
            done += n

    def write_from(self, offset: int, src: memoryview) -> None:
        """Write ``src`` into the region at ``offset`` (no mapping); a 507 when the
        filesystem under the region cannot hold the bytes."""
        self._span(offset, len(src))
        done = 0
        try:
            while done < len(src):
                done += os.pwritev(self.fd, [src[done:]], offset + done)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise RouteError(507, f"region {self.id}: its filesystem cannot hold the "
                                 f"chunk ({exc.strerror})", "regions_full") from None
            raise


class RegionTable:
    """The regions one server holds (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str] | None, max_bytes: int,
                 per_tenant: int, inflight_budget: int | None = None,
                 per_tenant_bytes: int | None = None, lease_s: float = 600.0) -> None:
        self.directory = None if directory is None else Path(directory)
        self.max_bytes = max_bytes
        self.per_tenant = per_tenant
        self.per_tenant_bytes = max_bytes if per_tenant_bytes is None else per_tenant_bytes
        self.lease_s = lease_s
        self.inflight_budget = inflight_budget
        """Bytes uploads from regions may stage at once (as request bodies may)."""
        self._inflight = 0
        self._regions: dict[str, Region] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.reclaimed = 0
        """Regions reclaimed because their lease ran out."""
        self.transfers = {"put": 0, "get": 0}
        """Chunks moved through regions (instead of request and reply bodies), by way."""
        self.transfer_bytes = {"put": 0, "get": 0}
        self.server_id = secrets.token_hex(8)
        self._server_lock: int | None = None
        self.removed_stale = 0
        if self.directory is not None and self.directory.is_dir():
            self.removed_stale = self._remove_stale()
            self._server_lock = self._hold_server_lock()
        elif self.directory is not None:  # same-host clients fall back to HTTP bodies
            log.warning("server.shm_dir %s is not a directory: no shared-memory regions",
                        self.directory)

    @property
    def enabled(self) -> bool:
        return self.directory is not None and self.directory.is_dir() and self.max_bytes > 0

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def moved(self, way: str, nbytes: int) -> None:
        """Count a chunk that crossed a region (``way``: ``put`` or ``get``)."""
        with self._lock:
            self.transfers[way] += 1
            self.transfer_bytes[way] += nbytes

    def stats(self) -> dict[str, object]:
        """Whether regions are offered, those held, and what crossed them: a same-host
        client that fell back to bodies shows as none moved."""
        with self._lock:
            return {"enabled": self.enabled, "held": len(self._regions), "held_bytes": self._bytes,
                    "transfers": dict(self.transfers), "transfer_bytes": dict(self.transfer_bytes),
                    "reclaimed": self.reclaimed}

    def _lock_path(self, server_id: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{PREFIX}{server_id}.lock"

    def _hold_server_lock(self) -> int | None:
        """This server's lock file, locked for as long as the server runs."""
        try:
            fd = os.open(self._lock_path(self.server_id),
                         os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError:
            return None  # a read-only directory: no regions can be made there either
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def _remove_stale(self) -> int:
        """Delete the regions of servers that are gone: those whose server's lock file is
        not locked (or missing), whatever their PID, and the lock files; regions named by
        a pid (older servers) whose process is gone."""
        assert self.directory is not None
        dead: set[str] = set()
        live: set[str] = set()
        for path in self.directory.glob(f"{PREFIX}*.lock"):
            m = _LOCK_RE.fullmatch(path.name)
            if m is None:
                continue
            (live if _locked(path) else dead).add(m.group(1))
        n = 0
        for path in self.directory.glob(f"{PREFIX}*"):
            m, legacy = _NAME_RE.fullmatch(path.name), _LEGACY_RE.fullmatch(path.name)
            lock = _LOCK_RE.fullmatch(path.name)
            stale = ((m is not None and m.group(1) not in live)
                     or (m is None and legacy is not None and not _alive(int(legacy.group(1))))
                     or (lock is not None and lock.group(1) in dead))
            if stale:
                with contextlib.suppress(OSError):
                    path.unlink()
                    n += lock is None
        return n

    def _reclaim_expired(self) -> None:
        """Delete the regions whose lease ran out and that no request is using."""
        now = time.monotonic()
        with self._lock:
            expired = [r for r in self._regions.values()
                       if r.users == 0 and now - r.last_used > self.lease_s]
        for region in expired:
            with contextlib.suppress(RouteError):
                self.delete(region.tenant, region.id)
                self.reclaimed += 1

    def list(self, tenant: str) -> list[Region]:
        """``tenant``'s regions (after reclaiming expired ones)."""
        self._reclaim_expired()
        with self._lock:
            return [r for r in self._regions.values() if r.tenant == tenant]

    def renew(self, tenant: str, region_id: str) -> Region:
        """Start ``tenant``'s region's lease anew (a 404 when it is gone)."""
        with self.using(tenant, region_id) as region:
            return region

    def expires_in(self, region: Region) -> float:
        return max(0.0, region.last_used + self.lease_s - time.monotonic())

    def create(self, tenant: str, size: int) -> Region:
        """A new region of ``size`` bytes for ``tenant`` (zero-filled, mapped)."""
        if not self.enabled:
            raise RouteError(404, "this server offers no shared-memory regions "
                             "(server.shm_dir is unset or missing)", "no_regions")
        if size < 1:
            raise RouteError(400, f"a region needs at least 1 byte, not {size}")
        self._reclaim_expired()
        with self._lock:
            mine = [r for r in self._regions.values() if r.tenant == tenant]
            if len(mine) >= self.per_tenant:
                raise RouteError(429, f"tenant {tenant} holds {len(mine)} regions already "
                                 f"(server.shm_regions_per_tenant); delete one first")
            held = sum(r.size for r in mine)
            if held + size > self.per_tenant_bytes:
                raise RouteError(507, f"tenant {tenant}'s regions would hold {held + size} "
                                 f"bytes, over server.shm_bytes_per_tenant "
                                 f"({self.per_tenant_bytes}); delete one first", "regions_full")
            if self._bytes + size > self.max_bytes:
                raise RouteError(507, f"regions would hold {self._bytes + size} bytes, over "
                                 f"server.shm_bytes ({self.max_bytes})", "regions_full")
            self._bytes += size
        try:
            region = self._map_new(tenant, size)
        except OSError as exc:
            with self._lock:
                self._bytes -= size
            raise RouteError(507, f"could not create a region of {size} bytes: {exc.strerror}",
                             "regions_full") from None
        with self._lock:
            self._regions[region.id] = region
        return region

    def _map_new(self, tenant: str, size: int) -> Region:
        assert self.directory is not None
        rid = secrets.token_hex(16)
        path = self.directory / f"{PREFIX}{self.server_id}-{rid}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            _reserve(fd, size)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        return Region(rid, tenant, path, size, fd)

    @contextlib.contextmanager
    def using(self, tenant: str, region_id: str) -> Iterator[Region]:
        """``tenant``'s region, held open (not unmapped by a concurrent delete) until the
        block ends; a 404 when it does not exist or is another tenant's."""
        with self._lock:
            region = self._regions.get(region_id) if _ID_RE.fullmatch(region_id) else None
            if region is None or region.tenant != tenant:
                raise RouteError(404, f"no region {region_id!r}", "no_such_region")
            region.users += 1
            region.last_used = time.monotonic()
        try:
            yield region
        finally:
            with self._lock:
                region.users -= 1
                region.last_used = time.monotonic()
                done = region.deleted and region.users == 0
            if done:
                _unmap(region)

    @contextlib.contextmanager
    def staging(self, nbytes: int) -> Iterator[None]:
        """Room for an upload of ``nbytes`` copied out of a region; 503 past the budget."""
        with self._lock:
            if self.inflight_budget is not None and self._inflight + nbytes > self.inflight_budget:
                raise RouteError(503, f"{self._inflight} bytes of uploads in flight; {nbytes} "
                                 f"more would pass server.max_inflight_bytes: retry")
            self._inflight += nbytes
        try:
            yield
        finally:
            with self._lock:
                self._inflight -= nbytes

    def delete(self, tenant: str, region_id: str) -> None:
        with self._lock:
            region = self._regions.get(region_id) if _ID_RE.fullmatch(region_id) else None
            if region is None or region.tenant != tenant:
                raise RouteError(404, f"no region {region_id!r}", "no_such_region")
            del self._regions[region_id]
            self._bytes -= region.size
            region.deleted = True
            idle = region.users == 0
        with contextlib.suppress(OSError):
            region.path.unlink()
        if idle:
            _unmap(region)

    def close(self) -> None:
        with self._lock:
            regions = list(self._regions.values())
            self._regions.clear()
            self._bytes = 0
        for region in regions:
            with contextlib.suppress(OSError):
                region.path.unlink()
            region.deleted = True
            if region.users == 0:
                _unmap(region)
        if self._server_lock is not None:
            with contextlib.suppress(OSError):
                self._lock_path(self.server_id).unlink()
            os.close(self._server_lock)
            self._server_lock = None


def _reserve(fd: int, size: int) -> None:
    """Give the region's file ``size`` bytes of real memory now (zeroed), or fail with
    ENOSPC: a sparse file would run out of room at the first large write instead."""
    st = os.fstatvfs(fd)
    if size > st.f_bavail * st.f_frsize:
        raise OSError(errno.ENOSPC, f"{st.f_bavail * st.f_frsize} bytes free on its filesystem")
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # a filesystem without fallocate: checked against its free space


def _unmap(region: Region) -> None:
    """Close the region's descriptor (the last user did, or nobody used it)."""
    with contextlib.suppress(OSError):
        os.close(region.fd)


def _locked(path: Path) -> bool:
    """Whether a live server holds the lock file at ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
