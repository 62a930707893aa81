"""Reads first on a drive: background writes hold off while a read someone waits for is in
flight.

A drive carries reads and writes on one path. A turn restoring its KV from disk waits for
its reads; nobody waits for a demotion handed down from the CPU tier, a session stored
ahead of need, or a save vLLM has already moved past. When both are queued, the read
should go first: the write is as useful a moment later, the read's delay is the user's.
The policy simulator models the drive this way (``Link.reads_first``), so the engine must
serve it this way too.

Who is background is said by the thread doing the work (:func:`background_io`, entered by
the workers that store off the request path), not by every call in between; a tier with
one path (:class:`~kvtier.connectors.tiers.disk_tier.DiskTier`) counts the reads asked for
outside it (:meth:`ReadsFirst.reading`) and makes a background write wait
(:meth:`ReadsFirst.before_write`) until none is in flight, a chunk batch at a time (a
write already going is not cut), and at most :data:`MAX_HOLD_S` a batch, so that a steady
stream of reads cannot hold stores, and the memory they pin, without bound.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextvars import ContextVar
from enum import Enum
from typing import TypeVar

T = TypeVar("T")

MAX_HOLD_S = 1.0
"""The longest one background write waits for reads (a fraction of a user's think time,
many reads of a chunk): under a stream of reads it goes anyway."""


class IOPriority(Enum):
    WAITED = "waited"
    """Someone waits for this transfer: a restore's read, a write that makes room."""
    BACKGROUND = "background"
    """Nobody waits for it now: a demotion, a store ahead of need, a prefetch."""


_priority: ContextVar[IOPriority] = ContextVar("kvtier_io_priority", default=IOPriority.WAITED)


@contextlib.contextmanager
def background_io() -> Iterator[None]:
    """The transfers this thread makes inside the block are background ones."""
    token = _priority.set(IOPriority.BACKGROUND)
    try:
        yield
    finally:
        _priority.reset(token)


def current_priority() -> IOPriority:
    return _priority.get()


def at_priority(priority: IOPriority, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` with its transfers at ``priority`` (a service storing for a client
    that said its store is a background one)."""
    token = _priority.set(priority)
    try:
        return fn(*args)
    finally:
        _priority.reset(token)


class ReadsFirst:
    """One medium's gate: the waited-for reads in flight, and background writes held off
    while there are any."""

    def __init__(self, max_hold_s: float = MAX_HOLD_S) -> None:
        self.max_hold_s = max_hold_s
        self._cond = threading.Condition()
        self._reads = 0

    @property
    def reads_in_flight(self) -> int:
        with self._cond:
            return self._reads

    def start_read(self) -> bool:
        """A read begins; whether it counts (a background one does not). Pair with
        :meth:`end_read`, or :meth:`end_read_after`."""
        if current_priority() is IOPriority.BACKGROUND:
            return False
        with self._cond:
            self._reads += 1
        return True

    def end_read(self, counted: bool) -> None:
        """A read :meth:`start_read` said ``counted`` has ended."""
        if not counted:
            return
        with self._cond:
            self._reads -= 1
            if self._reads == 0:
                self._cond.notify_all()

    def end_read_after(self, pending: Sequence[Future], counted: bool) -> None:
        """The read ends once every one of ``pending`` (its parts still in flight) is done."""
        if not counted or not pending:
            self.end_read(counted)
            return
        left = len(pending)
        lock = threading.Lock()

        def one_done(_: Future) -> None:
            nonlocal left
            with lock:
                left -= 1
                last = left == 0
            if last:
                self.end_read(True)

        for future in pending:
            future.add_done_callback(one_done)

    @contextlib.contextmanager
    def reading_until(self, landing: list[Future]) -> Iterator[None]:
        """A read in flight for the block, and after it until every future the block put
        in ``landing`` (its parts still being read) is done."""
        counted = self.start_read()
        try:
            yield
        finally:
            self.end_read_after(landing, counted)

    def before_write(self) -> float | None:
        """Called before a batch of writes: a background one waits while waited-for reads
        are in flight (at most :attr:`max_hold_s`); the seconds it waited (None: it did
        not)."""
        if current_priority() is not IOPriority.BACKGROUND:
            return None
        with self._cond:
            if self._reads == 0:
                return None
            start = time.monotonic()
            self._cond.wait_for(lambda: self._reads == 0, self.max_hold_s)
            return time.monotonic() - start
