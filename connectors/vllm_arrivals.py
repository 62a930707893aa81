"""What happens when vLLM adds a request, before it schedules it: the store is asked about
the request's keys in the background, and chunks it holds below its fastest tier are
raised into it (a session back from its think time finds its chunks in RAM). Where every
chunk found is in RAM already, or none is stored (a first turn), nothing more is asked.

The answer is not reused as the request's lookup when vLLM schedules it: vLLM schedules a
request milliseconds after adding it, before the background question is answered, and a
scheduling lookup that waited for it (session 42, docs/vllm.md) held vLLM's scheduler as
long as asking did where nothing was to be raised, and twice as long where something was.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.vllm_blocks import Rank, SequenceKeys
from kvtier.connectors.vllm_lookup import PrefixProbe
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

    def arrive(self, seq: SequenceKeys) -> Future[int]:
        """Ask about ``seq`` in the background; the job's result is how many chunks were
        raised into the fastest tier."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-prefetch",
                                                initializer=thread_started)
            return self._pool.submit(self._raise, seq)

    def _raise(self, seq: SequenceKeys) -> int:
        try:
            store = self._store()
            found = PrefixProbe(self._ranks).probe(store, seq)
            if all(s.tier == CPUTier.name for s in found):  # a raise would read nothing
                return 0
            self.raises += 1
            return store.prefetch(self._parts([s.key for s in found]))
        except Exception as exc:  # noqa: BLE001 - a failed prefetch only costs speed
            log.info("kvtier prefetch failed: %s", exc)
            return 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
