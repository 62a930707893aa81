"""Loads off vLLM's forward path: vLLM's async-load protocol (``async_loads``).

The scheduler side answers a lookup with ``load_async``: vLLM allocates the request's
blocks, parks it in ``WAITING_FOR_REMOTE_KVS`` and goes on stepping the others. The worker
side hands the step's loads to one background thread, in step order; ``finished`` reports
the requests whose loads are over (loaded or failed), with the blocks that could not be
loaded, which vLLM takes in the same pass (``get_block_ids_with_load_errors``) and
recomputes; the request is scheduled at the next step with its KV in place. vLLM keeps a
parked request's blocks, even if it is aborted, until its load is reported: every load
submitted is reported, whatever happens to it.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, Protocol, TypeVar

from kvtier.thread_start import thread_started

log = logging.getLogger(__name__)


class Load(Protocol):
    """One request's planned load (the connector's ``ChunkTransfer``)."""

    @property
    def req_id(self) -> str: ...


L = TypeVar("L", bound=Load)


class LoadQueue(Generic[L]):
    """Background loads, one at a time in submission order. ``load`` scatters one
    request's planned chunks and returns the blocks it could not load; where it raises,
    ``blocks`` names every block the load planned (all of them errors)."""

    def __init__(self, load: Callable[[L], set[int]], blocks: Callable[[L], set[int]]) -> None:
        self._load = load
        self._blocks = blocks
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-load",
                                        initializer=thread_started)
        self._lock = threading.Lock()
        self._pending: Counter[str] = Counter()
        self._done: set[str] = set()
        self._missed: set[int] = set()

    def submit(self, loads: list[L], before: Callable[[], None] | None = None
               ) -> Future[None] | None:
        """Load ``loads`` after every load submitted before them; ``before`` runs first on
        the loading thread (waiting for what must land first: saves the loads read, the
        forward pass that freed the blocks)."""
        if not loads:
            return None
        with self._lock:
            self._pending.update(load.req_id for load in loads)
        return self._pool.submit(self._run, loads, before)

    def _run(self, loads: list[L], before: Callable[[], None] | None) -> None:
        try:
            if before is not None:
                before()
        except Exception:  # noqa: BLE001 - the loads still run: their checks stand
            log.exception("kvtier: waiting before a load failed")
        for load in loads:
            try:
                missed = self._load(load)
            except Exception:  # noqa: BLE001 - never lose a load: vLLM holds its blocks
                log.exception("kvtier load failed (recomputed)")
                missed = self._blocks(load)
            with self._lock:
                self._missed |= missed
                self._pending[load.req_id] -= 1
                if self._pending[load.req_id] <= 0:
                    del self._pending[load.req_id]
                    self._done.add(load.req_id)

    def finished(self) -> tuple[set[str], set[int]]:
        """The requests whose loads are all over since the last call, and the blocks that
        could not be loaded (to report in the same pass)."""
        with self._lock:
            done, self._done = self._done, set()
            missed, self._missed = self._missed, set()
        return done, missed

    def busy(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
