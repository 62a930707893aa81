"""What happens when vLLM adds a request, before it schedules it: the store is asked about
the request's keys in the background, and chunks it holds below its fastest tier are
raised into it (a session back from its think time finds its chunks in RAM); where nothing
was to be raised, the answer stands as the request's lookup when vLLM schedules it.

vLLM's scheduler waits for a lookup's answer with its loop stopped (for every request in
it), and through a sidecar a lookup is an HTTP round trip. vLLM schedules a request it has
room for within milliseconds of adding it, usually before the background question is
answered: the scheduling lookup then waits for that question's answer instead of asking
again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.vllm_blocks import Rank, SequenceKeys
from kvtier.connectors.vllm_lookup import Answers, PrefixProbe
from kvtier.thread_start import thread_started

if TYPE_CHECKING:
    from kvtier.connectors.chunk_store import ChunkStore

log = logging.getLogger(__name__)

ANSWER_STANDS_S = 1.0
"""How long an answer got at arrival stands as the request's lookup: a request vLLM kept
waiting longer (no room for it) is asked about again. In between, saves may land and
chunks may leave the store: an answer that old misses the first (those tokens are
computed) or names the second (the load fails and vLLM computes those blocks); it never
loads wrong KV."""

ANSWER_WAIT_S = 5.0
"""The longest a scheduling lookup waits for the arrival's question in flight before it
asks itself (a store that slow would keep a question of its own as long)."""


@dataclass
class _Arrival:
    job: Future[int]
    answer: Future[Answers | None]
    """What the store said, where nothing was to be raised into the fastest tier (None:
    something was, or the question failed)."""
    first_in_line: bool
    """No other request's question was unfinished when this one's was queued."""


class ArrivalLookups:
    """The background questions of requests vLLM added (one thread: the store is asked in
    the order requests arrive), and their answers until vLLM schedules each."""

    def __init__(self, store: Callable[[], ChunkStore], ranks: Sequence[Rank],
                 parts: Callable[[list[str]], list[str]]) -> None:
        self._store = store
        self._ranks = list(ranks)
        self._parts = parts
        """Every rank's key of each of a request's chunk keys."""
        self._pool: ThreadPoolExecutor | None = None
        self._arrivals: dict[str, _Arrival] = {}
        self._unfinished = 0
        """Questions queued or being asked."""
        self._lock = threading.Lock()
        self.answered = 0
        """Scheduling lookups an arrival's answer stood for."""

    def arrive(self, req_id: str, seq: SequenceKeys) -> Future[int]:
        """Ask about ``seq`` in the background; the job's result is how many chunks were
        raised into the fastest tier."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-prefetch",
                                                initializer=thread_started)
            answer: Future[Answers | None] = Future()
            first = self._unfinished == 0
            self._unfinished += 1
            job = self._pool.submit(self._ask, answer, seq)
            self._arrivals[req_id] = _Arrival(job, answer, first)
        return job

    def _ask(self, answer: Future[Answers | None], seq: SequenceKeys) -> int:
        try:
            store = self._store()
            answers = Answers()
            found = PrefixProbe(self._ranks).probe(store, seq, record=answers)
            if all(s.tier == CPUTier.name for s in found):
                answer.set_result(answers)
                return 0
            # tiers change as the chunks are raised: the scheduling lookup asks again, at
            # once (told before the raise, which reads slower tiers, so as not to wait it)
            answer.set_result(None)
            return store.prefetch(self._parts([s.key for s in found]))
        except Exception as exc:  # noqa: BLE001 - a failed prefetch only costs speed
            log.info("kvtier prefetch failed: %s", exc)
            return 0
        finally:
            if not answer.done():
                answer.set_result(None)
            with self._lock:
                self._unfinished -= 1

    def answer(self, req_id: str) -> Answers | None:
        """The request's arrival answer, once: waited for where its question is being
        asked (not where it queues behind other requests'), None where there is none to
        use."""
        with self._lock:
            arrival = self._arrivals.pop(req_id, None)
        if arrival is None:
            return None
        job = arrival.job
        if not (arrival.first_in_line or job.running() or job.done()):
            return None
        try:
            got = arrival.answer.result(timeout=ANSWER_WAIT_S)
        except FutureTimeout:
            return None
        if got is None or time.monotonic() - got.at > ANSWER_STANDS_S:
            return None
        self.answered += 1
        return got

    def forget(self, req_id: str) -> None:
        """vLLM finished the request (or aborted it) before it was scheduled."""
        with self._lock:
            self._arrivals.pop(req_id, None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
