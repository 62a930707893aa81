"""Transfers someone waits for go first: background writes hold off while one is in flight
on the same path.

A turn restoring its KV waits for its reads, and for the write-backs that make its room;
nobody waits for a demotion handed down from the CPU tier, a session stored ahead of need,
or a save vLLM has already moved past. Where both share a path, the waited-for transfer
should go first: the background write is as useful a moment later, the other's delay is
the user's. A drive carries reads and writes on one path; a network link carries each
direction on its own, so there a background write yields to waited-for writes only. The
policy simulator's links work this way (``Link.waited_first``), so the tiers must too.

Who is background is said by the thread doing the work (:func:`background_io`, entered by
the workers that store off the request path), not by every call in between. A tier counts
the waited-for transfers on a path (:meth:`WaitedFirst.begin`, :meth:`WaitedFirst.during`)
and makes a background write batch wait (:meth:`WaitedFirst.before_background_write`)
until none is in flight: a batch at a time (a write already going is not cut), and at most
:data:`MAX_HOLD_S` a batch, so that a steady stream of reads cannot hold stores, and the
memory they pin, without bound.
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


class WaitedFirst:
    """One path's gate: the transfers someone waits for in flight on it, and background
    write batches held off while there are any."""

    def __init__(self, max_hold_s: float = MAX_HOLD_S) -> None:
        self.max_hold_s = max_hold_s
        self._cond = threading.Condition()
        self._waited = 0

    @property
    def in_flight(self) -> int:
        """Waited-for transfers in flight now."""
        with self._cond:
            return self._waited

    def begin(self) -> bool:
        """A transfer begins; whether it counts (a background one does not). Pair with
        :meth:`end`, or :meth:`end_after`."""
        if current_priority() is IOPriority.BACKGROUND:
            return False
        with self._cond:
            self._waited += 1
        return True

    def end(self, counted: bool) -> None:
        """A transfer :meth:`begin` said ``counted`` has ended."""
        if not counted:
            return
        with self._cond:
            self._waited -= 1
            if self._waited == 0:
                self._cond.notify_all()

    def end_after(self, pending: Sequence[Future], counted: bool) -> None:
        """The transfer ends once every one of ``pending`` (its parts still in flight) is
        done."""
        if not counted or not pending:
            self.end(counted)
            return
        left = len(pending)
        lock = threading.Lock()

        def one_done(_: Future) -> None:
            nonlocal left
            with lock:
                left -= 1
                last = left == 0
            if last:
                self.end(True)

        for future in pending:
            future.add_done_callback(one_done)

    @contextlib.contextmanager
    def during(self, landing: list[Future]) -> Iterator[None]:
        """A transfer in flight for the block, and after it until every future the block
        put in ``landing`` (its parts still in flight) is done."""
        counted = self.begin()
        try:
            yield
        finally:
            self.end_after(landing, counted)

    def before_background_write(self) -> float | None:
        """Called before a batch of writes: a background one waits while waited-for
        transfers are in flight (at most :attr:`max_hold_s`); the seconds it waited (None:
        it did not)."""
        if current_priority() is not IOPriority.BACKGROUND:
            return None
        with self._cond:
            if self._waited == 0:
                return None
            start = time.monotonic()
            self._cond.wait_for(lambda: self._waited == 0, self.max_hold_s)
            return time.monotonic() - start
