"""What happens to a request vLLM added and did not schedule in the pass that followed (it
waits in the queue): the store is asked about its keys in the background, and chunks it
holds below its fastest tier are raised into it (a session back from its think time finds
its chunks in RAM by the time it is scheduled). Where every chunk found is in RAM already,
or none is stored (a first turn), nothing more is asked.

A request vLLM schedules in the pass after its arrival (most, where the server has room)
asks nothing here: its lookup is its question (asked with those of the others that arrived
with it, :class:`~kvtier.connectors.vllm_lookup.PassLookups`) and its load reads what it
found from whatever tier holds it. Sessions 42-43 asked every arriving request at once, in
a thread beside vLLM's: requests that arrived together (a step's finished replies are
answered in the same moment) put as many questions in the sidecar's queue as the
scheduling lookups behind them (docs/vllm.md, session 44).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.vllm_blocks import Rank, SequenceKeys
from kvtier.connectors.vllm_lookup import FINISHING, PrefixProbe, Stored
from kvtier.thread_start import thread_started

if TYPE_CHECKING:
    from kvtier.connectors.chunk_store import ChunkStore

log = logging.getLogger(__name__)


class ArrivalPrefetch:
    """The background questions of requests vLLM added (one thread: the store is asked in
    the order requests arrive)."""

    def __init__(self, store: Callable[[], ChunkStore], ranks: Sequence[Rank],
                 parts: Callable[[list[str]], list[str]]) -> None:
        self._store = store
        self._ranks = list(ranks)
        self._parts = parts
        """Every rank's key of each of a request's chunk keys."""
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.raises = 0
        """Requests whose chunks were found below the fastest tier (a raise asked for)."""

    def arrive(self, seq: SequenceKeys, found: list[Stored] | None = None) -> Future[int]:
        """Raise ``seq``'s stored chunks in the background (``found``: what a lookup found
        of it already; None: ask); the job's result is how many chunks were raised into
        the fastest tier."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-prefetch",
                                                initializer=thread_started)
            return self._pool.submit(self._raise, seq, found)

    def _raise(self, seq: SequenceKeys, found: list[Stored] | None) -> int:
        try:
            store = self._store()
            if found is None:
                found = PrefixProbe(self._ranks).probe(store, seq)
            if all(s.tier in (CPUTier.name, FINISHING) for s in found):  # nothing to read
                return 0
            self.raises += 1
            return store.prefetch(self._parts([s.key for s in found]))
        except Exception as exc:  # noqa: BLE001 - a failed prefetch only costs speed
            log.info("kvtier prefetch failed: %s", exc)
            return 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
