"""Host memory for the data path: page-aligned, pinned where CUDA is present, reused.

Chunks move between the pool, the tiers and the wire through *slots*, buffers that already
exist: a store gathers KV into one, a disk write goes out of one and a disk read lands in
one, a restore scatters from one. Allocating a fresh buffer per chunk costs more than the
copy itself (page faults on first touch of tens of MiB), so buffers come from here:

- :func:`host_buffer` allocates one, from anonymous ``mmap`` (page-aligned, so a slot
  whose offset is a multiple of :data:`PAGE` can be the source or target of an
  ``O_DIRECT`` transfer) and registered with CUDA when it is present (DMA to and from the
  GPU without a bounce through the driver's staging memory);
- :class:`StagingPool` keeps released buffers for the next chunk of the same size class,
  so a data path in steady state allocates nothing (``allocations`` counts what it did
  allocate, which tests check).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
SIZE_CLASS = 1 << 20
"""Staging buffers are rounded up to a multiple of this (chunks of one model share a class)."""
POPULATE_PIECE = 16 << 20
"""Buffers larger than this are faulted in by pieces of this size (see :class:`HostBuffer`)."""


def round_up(n: int, align: int = PAGE) -> int:
    return -(-n // align) * align


class HostBuffer:
    """One page-aligned host buffer (``tensor``: uint8, 1-D); pinned when CUDA is present
    and ``pin`` is not False. ``close`` unpins and unmaps it; views taken of it must not
    be used afterwards."""

    def __init__(self, nbytes: int, pin: bool | None = None) -> None:
        self.nbytes = max(round_up(nbytes), PAGE)
        # Populated now: the first copy into a fresh buffer would otherwise pay a page
        # fault per 4 KiB, several times the copy itself. Large buffers are faulted in by
        # pieces rather than with MAP_POPULATE, which holds the process's memory-map lock
        # for the whole buffer: every other thread's mmap (a large malloc, a socket
        # buffer) waited on it, stalling the server's event loop for a second at 400 MiB.
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if self.nbytes <= POPULATE_PIECE:
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        self._map: mmap.mmap | None = mmap.mmap(-1, self.nbytes, flags=flags)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        if self.nbytes > POPULATE_PIECE:
            for start in range(0, self.nbytes, POPULATE_PIECE):
                self.tensor[start : start + POPULATE_PIECE].fill_(0)
        self.pinned = False
        if pin is not False and torch.cuda.is_available():
            self.pinned = _register(self.tensor)
        elif pin:
            log.warning("pinning asked for but CUDA is not available; host buffer is pageable")

    def close(self) -> None:
        if self._map is None:
            return
        self._unpin()
        # The mmap stays mapped while any tensor over it lives (torch holds the buffer);
        # dropping our references lets it go with the last view.
        self._map = None

    def _unpin(self) -> None:
        if getattr(self, "pinned", False):
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False

    def __del__(self) -> None:
        # A buffer dropped without close() must not leave its registration behind: the
        # mapping goes with the last view of it, and a later mapping at the same address
        # would fail to register ("already mapped"), or worse, DMA would still go to the
        # pages CUDA locked for the old one. Unpinned here, while ``tensor`` (and so the
        # mapping) is still alive.
        with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone
            self._unpin()


def _register(tensor: torch.Tensor) -> bool:
    """Pin ``tensor``'s pages for DMA; on failure the buffer stays pageable, and the CUDA
    error the failed call left behind is consumed so that the next kernel launch does not
    report it as its own."""
    rc = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0))
    if rc == 0:
        return True
    log.warning("cudaHostRegister of %d bytes failed (error %d); buffer stays pageable",
                tensor.numel(), rc)
    get_last_error = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if get_last_error is not None:
        get_last_error()
    else:  # torch raises the pending error on the next launch check, and clears it
        with contextlib.suppress(Exception):
            torch.empty(1, device="cuda").zero_()
    return False


def host_buffer(nbytes: int, pin: bool | None = None) -> HostBuffer:
    return HostBuffer(nbytes, pin)


class StagingPool:
    """Reusable host buffers for chunks that pass through the host on their way between
    the pool and a tier that lends no memory of its own (disk, Redis, the wire).

    ``acquire(n)`` returns a uint8 tensor of at least ``n`` bytes, page-aligned; ``release``
    gives it back. At most ``max_idle_bytes`` of released buffers are kept (the rest are
    freed), so a burst does not pin memory for good. A service ties that cap to the bytes
    its budgets let requests hold at once (:meth:`cap_idle`): above that working set,
    so buffers in steady use are reused, never freed and pinned again; no higher, so what
    an uncharged burst once grew is not kept."""

    def __init__(self, max_idle_bytes: int = 1 << 30, pin: bool | None = None) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._pin = pin
        self._idle: dict[int, list[HostBuffer]] = {}
        self._idle_bytes = 0
        self._out: dict[int, HostBuffer] = {}
        self._lent_bytes = 0
        self._lock = threading.Lock()
        self.allocations = 0
        """Buffers allocated so far (a steady-state data path leaves this unchanged)."""
        self.peak_lent_bytes = 0
        """The most bytes of buffers handed out at once (what the data path's budgets
        bound; tests and stats read it)."""

    def acquire(self, nbytes: int) -> torch.Tensor:
        size = round_up(max(nbytes, 1), SIZE_CLASS)
        with self._lock:
            free = self._idle.get(size)
            buf = free.pop() if free else None
            if buf is not None:
                self._idle_bytes -= buf.nbytes
            else:
                self.allocations += 1
        if buf is None:
            buf = HostBuffer(size, self._pin)
        with self._lock:
            self._out[buf.tensor.data_ptr()] = buf
            self._lent_bytes += buf.nbytes
            self.peak_lent_bytes = max(self.peak_lent_bytes, self._lent_bytes)
        return buf.tensor

    def release(self, tensor: torch.Tensor) -> None:
        with self._lock:
            buf = self._out.pop(tensor.data_ptr(), None)
            if buf is None:
                raise ValueError("release of a buffer this pool did not hand out")
            self._lent_bytes -= buf.nbytes
            if self._idle_bytes + buf.nbytes <= self.max_idle_bytes:
                self._idle.setdefault(buf.nbytes, []).append(buf)
                self._idle_bytes += buf.nbytes
                return
        buf.close()

    @contextlib.contextmanager
    def borrowed(self, nbytes: int) -> Iterator[torch.Tensor]:
        buf = self.acquire(nbytes)
        try:
            yield buf
        finally:
            self.release(buf)

    @property
    def lent(self) -> int:
        """Buffers handed out and not given back yet."""
        with self._lock:
            return len(self._out)

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return self._idle_bytes

    @property
    def lent_bytes(self) -> int:
        """Bytes of the buffers handed out and not given back yet."""
        with self._lock:
            return self._lent_bytes

    def cap_idle(self, max_idle_bytes: int) -> None:
        """Keep at most ``max_idle_bytes`` of released buffers from now on; idle buffers
        past it are freed now, largest first."""
        with self._lock:
            self.max_idle_bytes = max_idle_bytes
            freed: list[HostBuffer] = []
            for size in sorted(self._idle, reverse=True):
                bufs = self._idle[size]
                while bufs and self._idle_bytes > max_idle_bytes:
                    freed.append(bufs.pop())
                    self._idle_bytes -= size
            self._idle = {size: bufs for size, bufs in self._idle.items() if bufs}
        for buf in freed:
            buf.close()

    def close(self) -> None:
        with self._lock:
            idle = [b for bufs in self._idle.values() for b in bufs]
            self._idle.clear()
            self._idle_bytes = 0
        for buf in idle:
            buf.close()
