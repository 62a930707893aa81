"""Lookups asked when vLLM adds a request, not when it schedules it.

vLLM's scheduler loop stops while the connector answers ``get_num_new_matched_tokens``,
and the worker waits for the step it is building: through a sidecar on a busy host the
round trip took 7 ms a request (1 ms idle), most of it the sidecar waiting for a core.
A request usually waits in vLLM's queue a while after it is added, so the question is
asked then, on a thread of its own, and the scheduler reads the answer when it schedules
the request. Two things make an early answer stale, and both are handled:

- this instance stored chunks since (a save that landed): those keys are counted as
  stored (:data:`~kvtier.connectors.vllm_lookup.LANDED`), from a log of recent landings;
- the request's own prefetch raised its chunks into a faster tier: the answer's tiers
  would mislead the restore policy, so the question is asked again.

A chunk evicted from every tier since is the one staleness left: its load fails and
vLLM recomputes it (as for any failed load). A question still queued behind others when
the scheduler wants it is cancelled and asked at once, as before.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kvtier.connectors.chunk_store import ChunkStore
from kvtier.connectors.vllm_lookup import LANDED, Asked, PrefixProbe

log = logging.getLogger(__name__)

MAX_LANDED = 1 << 16
"""Landed keys remembered: those of the saves that land while a request waits in vLLM's
queue (a few thousand chunks at most); a key forgotten only costs a load it could have
made."""


@dataclass
class _Pending:
    asked: Future[Asked]
    landed_seq: int
    """The landing log's count when the question was put: later landings are newer."""
    promoted: Future[int] | None = None
    """The request's prefetch (its count of chunks raised into a faster tier)."""


class EarlyLookups:
    """Questions put at arrival (``ask``) and read at scheduling (``take``)."""

    def __init__(self, probe: PrefixProbe, store: Callable[[], ChunkStore]) -> None:
        self._probe = probe
        self._store = store
        self._pending: dict[str, _Pending] = {}
        self._landed: OrderedDict[str, int] = OrderedDict()
        self._seq = 0
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def ask(self, req_id: str, prompt: Sequence[int], full: Sequence[str],
            promoted: Future[int] | None = None) -> Future[Asked]:
        """Put the question about ``prompt`` (its full chunk keys ``full``) now, in the
        background; ``promoted``: the request's prefetch, if one runs."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-lookup")
        asked = self._pool.submit(self._probe.ask, self._store(), list(prompt), list(full))
        with self._lock:
            self._pending[req_id] = _Pending(asked, self._seq, promoted)
        return asked

    def take(self, req_id: str) -> tuple[Asked, dict[str, str]] | None:
        """The early answer for ``req_id`` and the keys landed since it was asked (key ->
        :data:`LANDED`); None where there is none to use (never asked, still queued,
        failed, or its tiers changed by its prefetch): ask now."""
        with self._lock:
            pending = self._pending.pop(req_id, None)
        if pending is None or pending.asked.cancel():
            return None
        if _raised(pending.promoted):
            return None  # its chunks moved up since: their tiers are not the answer's
        try:
            asked = pending.asked.result()
        except Exception as exc:  # noqa: BLE001 - an early question that failed is asked again
            log.info("kvtier early lookup failed, asking again: %s", exc)
            return None
        landed: dict[str, str] = {}
        with self._lock:
            for key, seq in reversed(self._landed.items()):  # newest first
                if seq <= pending.landed_seq:
                    break
                landed[key] = LANDED
        return asked, landed

    def landed(self, keys: Iterable[str]) -> None:
        """This instance's saves of ``keys`` landed (the store holds them now)."""
        with self._lock:
            for key in keys:
                self._seq += 1
                self._landed[key] = self._seq
                self._landed.move_to_end(key)
            while len(self._landed) > MAX_LANDED:
                self._landed.popitem(last=False)

    def forget(self, req_id: str) -> None:
        """The request is gone: its question, if still queued, is not asked."""
        with self._lock:
            pending = self._pending.pop(req_id, None)
        if pending is not None:
            pending.asked.cancel()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _raised(prefetch: Future[int] | None) -> bool:
    """A prefetch that has raised chunks into a faster tier by now."""
    if prefetch is None or not prefetch.done() or prefetch.cancelled():
        return False
    return prefetch.exception() is None and prefetch.result() > 0
