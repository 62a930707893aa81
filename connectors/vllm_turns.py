"""Turn reports from vLLM's scheduler to the store: when a session's request arrives and
when it finishes, sent in batches on a background thread (never on vLLM's scheduling
path), so that the store's session-aware tiers rank sessions by when they are likely back
(:mod:`kvtier.connectors.tiers.session_turns`), not only by how long ago their chunks were
touched. A report is a hint: one that fails costs eviction order, never KV, and a store
that takes none (an engine-mode ``kvtier serve``) is told nothing more."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvtier.chunk_wire import ServiceError
from kvtier.client import MAX_TURNS_PER_REPORT, SessionTurn, TurnEvent
from kvtier.thread_start import thread_started

log = logging.getLogger(__name__)

MAX_PENDING = MAX_TURNS_PER_REPORT
"""Events waiting to be sent at most (one report's worth); past it the oldest are dropped:
a store that stopped answering does not grow the scheduler's memory."""


class TurnReporter:
    """``send`` delivers one report (a store's ``report_turns``)."""

    def __init__(self, send: Callable[[Sequence[SessionTurn]], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._send = send
        self.clock = clock
        self._lock = threading.Lock()
        self._pending: list[tuple[str, TurnEvent, float]] = []
        self._queued = False
        """A flush is on its way to the thread (events added meanwhile go with it)."""
        self._pool: ThreadPoolExecutor | None = None
        self.enabled = True
        self.sent = 0
        self.dropped = 0

    def started(self, session: str) -> None:
        """A request of ``session`` arrived: its turn started."""
        self._add(session, TurnEvent.STARTED)

    def ended(self, session: str) -> None:
        """A request of ``session`` finished (or was aborted): its turn ended."""
        self._add(session, TurnEvent.ENDED)

    def _add(self, session: str, event: TurnEvent) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._pending.append((session, event, self.clock()))
            if len(self._pending) > MAX_PENDING:
                del self._pending[0]
                self.dropped += 1
            if self._queued:
                return
            self._queued = True
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-turns",
                                                initializer=thread_started)
            pool = self._pool
        pool.submit(self._flush)

    def _flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
            self._queued = False
        if not batch or not self.enabled:
            return
        now = self.clock()
        turns = [SessionTurn(s, e, max(0.0, now - at)) for s, e, at in batch]
        try:
            self._send(turns)
            self.sent += len(turns)
        except ServiceError as exc:
            if exc.status in (404, 409):  # a store that ranks its own sessions, or has no tiers
                self.enabled = False
                log.info("kvtier: the store takes no turn reports (%s); none is sent", exc)
            else:
                log.info("kvtier turn report failed: %s", exc)
        except Exception as exc:  # noqa: BLE001 - a report is a hint: never fatal
            log.info("kvtier turn report failed: %s", exc)

    def drain(self) -> None:
        """Send what is pending and wait until it was (tests, shutdown)."""
        with self._lock:
            pool = self._pool
        if pool is not None:
            done: Future[None] = pool.submit(self._flush)
            done.result()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.submit(self._flush)
            pool.shutdown(wait=True)
