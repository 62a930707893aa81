"""Free room kept ready in the CPU arena: its coldest chunks handed down ahead of need.

A store into a full arena first hands its victims down (a write to disk, with fsync, or a
Redis SET) and only then fills their units: whoever waits for the store waits for the
demotion too. For the vLLM connector that is vLLM itself, which holds a finished request's
blocks until its saves land; a block held is one a waiting request cannot take. The
reserve keeps ``reserve_units`` of the arena's units free on a background thread: after
each store it hands the policy's victims down until that many are free, so a store finds
room and pays only its own copy. The victims are the ones the arena would give up a
moment later. (The module keeps the name it had when the arena was cut into slots.)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvtier.io_priority import background_io
from kvtier.thread_start import thread_started

log = logging.getLogger(__name__)


class SlotReserve:
    """``replenish()`` frees one victim's units (handed down) and says whether it did;
    :meth:`wake` asks the thread to run it until it says no."""

    def __init__(self, replenish: Callable[[], bool], name: str = "kvtier-cpu-reserve") -> None:
        self._replenish = replenish
        self._wanted = threading.Event()
        self._stopped = False
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._idle.clear()
        self._wanted.set()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the reserve has nothing left to do (tests, shutdown)."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        self._stopped = True
        self._wanted.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        thread_started()
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._stopped:
                self._idle.set()
                return
            try:
                with background_io():  # nobody waits for these hand-downs
                    while not self._stopped and self._replenish():
                        pass
            except Exception:  # noqa: BLE001 - a failed hand-down: stores evict inline
                log.exception("the CPU tier's free-room reserve failed to hand a chunk down")
            if not self._wanted.is_set():
                self._idle.set()
