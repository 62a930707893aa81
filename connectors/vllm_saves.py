"""Saves off vLLM's forward path: each step's save runs on one background thread, in step
order, while vLLM goes on; a request's blocks are held (vLLM's ``request_finished`` returns
True) until every save of it has landed, which ``finished`` reports.

A save reads blocks vLLM could hand to another request once they are freed: a finished
request's blocks are held by vLLM until ``finished`` names it, and when vLLM preempts a
request (its blocks go back to the pool at once) the worker drains the queue before the
next forward pass may write them. On CUDA the gather waits for an event recorded after the
step's forward pass, so it reads what that pass wrote.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from kvtier.io_priority import background_io
from kvtier.thread_start import thread_started

log = logging.getLogger(__name__)


def idle_priority() -> None:
    """Run the calling thread only when a core has nothing else to run (Linux ``SCHED_IDLE``;
    elsewhere, or where refused, the lowest nice value). On a host whose cores vLLM's
    forward pass keeps busy (a CPU backend binds its OpenMP team to every core), a save at
    normal priority takes a core from that team mid-step and every thread of it waits;
    idle, it runs between steps, in the scheduler's gaps and the users' think times. A
    preemption's drain still waits for it, and the waiting forward leaves the cores free.
    Not the default: measured with real vLLM on a 2-core host it gained nothing
    (benchmarks/results/vllm-cpu-24conv-save-priority.json), and on a host whose cores
    other work keeps busy an idle thread may starve, holding finished requests' blocks."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _idle_save_thread() -> None:
    thread_started()
    idle_priority()


MAX_YIELD_S = 1.0
"""The longest yielding saves hold a finished request's blocks (a few prefill steps of a
CPU, a fraction of a user's think time): once vLLM has named a request finished whose
saves have not landed, the saves go on this long after, under a stream of prefills too."""

MAX_RUNNING_YIELD_S = 30.0
"""The longest a save of requests still running waits for prefill steps to end. Nobody
waits for it: its blocks are in vLLM's cache, where another request over the same tokens
finds them, until the request finishes (then :data:`MAX_YIELD_S` bounds the wait) or is
preempted (its drain does not wait at all). A bound all the same, so that no save waits
without one."""

STEP_GAP_S = 0.05
"""How long vLLM must have been between steps before a yielding save starts a chunk
there. vLLM schedules its next step within milliseconds of the last one's end, and a
chunk started in that gap runs beside the next step, which after a prefill is often
another prefill (requests that arrived together are prefilled in consecutive steps):
a chunk starts while a decode step runs, or once vLLM has been idle this long."""


class _Step(enum.Enum):
    """What vLLM's worker is doing, as a yielding save sees it."""

    PREFILL = "prefill"
    DECODE = "decode"
    GAP = "gap"
    """Between steps (or idle since :attr:`SaveQueue._ended_at`)."""


class SaveQueue:
    """Background saves, one at a time in submission order, counted per request.
    ``yield_to_prefill``: the background thread starts each chunk only while a decode step
    runs or vLLM is idle (:meth:`step_started`, :data:`STEP_GAP_S`), holding a finished
    request's blocks no longer than :data:`MAX_YIELD_S` for it (:meth:`pause`)."""

    def __init__(self, background: bool = True, idle: bool = False,
                 yield_to_prefill: bool = False, step_gap_s: float | None = None) -> None:
        self.background = background
        """False: every save runs in the caller (vLLM waits for it)."""
        self.idle = idle
        """The background thread runs at idle priority: only on a core vLLM leaves free."""
        self.yield_to_prefill = yield_to_prefill and background
        self.step_gap_s = STEP_GAP_S if step_gap_s is None else max(0.0, step_gap_s)
        """How long vLLM is idle between steps before a yielding save starts a chunk there
        (0: at once, as soon as a prefill step ends)."""
        self._step = _Step.GAP
        self._ended_at = -math.inf
        """When the last step ended (-inf: idle since a drain, an idle step, or no step
        yet)."""
        self._idle_step = False
        """The step running, or the last, computes nothing."""
        self._changed = threading.Condition()
        self._began = threading.local()
        """When the save on this thread began (``at``)."""
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="kvtier-vllm-save",
                                         initializer=_idle_save_thread if idle else thread_started)
                      if background else None)
        self._lock = threading.Lock()
        self._pending: Counter[str] = Counter()
        self._seen: set[str] = set()
        """Requests with a save submitted: the ones whose blocks vLLM holds at their end."""
        self._finishing: set[str] = set()
        """Requests vLLM finished, reported once their saves have landed."""
        self._finished_at: dict[str, float] = {}
        """When vLLM first named each of :attr:`_finishing` finished."""
        self.hold_s = 0.0
        """Time finished requests' blocks were held for their saves, summed: blocks a
        waiting request could not take meanwhile."""
        self.holds = 0
        """Finished requests whose blocks were held for their saves."""
        self._last: Future[None] | None = None

    def submit(self, req_ids: Iterable[str], save: Callable[[], None]) -> None:
        """Run ``save`` (which never raises: a failed save is a future miss) for requests
        ``req_ids``, after every save submitted before it."""
        ids = list(req_ids)
        with self._lock:
            self._seen.update(ids)
            self._pending.update(ids)
        if self._pool is None:
            self._run(ids, save)
            return
        self._last = self._pool.submit(self._run_in_background, ids, save)

    def step_started(self, prefill: bool, idle: bool = False) -> None:
        """vLLM starts a step (``prefill``: it computes prompt tokens, not only one token
        a request): with ``yield_to_prefill``, saves wait while it runs, and after it
        until a decode step starts or vLLM has been idle :attr:`step_gap_s`.

        A step that computes nothing (``idle``: vLLM polls for the saves it holds finished
        requests' blocks for, a step every millisecond or so) is vLLM idle: saves go on
        from it, and the gap after it is no step's end. Counted as a decode step instead,
        a save woken by it found the step over and the next gap begun (the worker's
        thread keeps the interpreter between polls), and held the blocks
        :data:`MAX_YIELD_S` every time (docs/vllm.md, session 44)."""
        self._idle_step = idle
        self._set(_Step.GAP if idle else _Step.PREFILL if prefill else _Step.DECODE,
                  -math.inf if idle else None)

    def step_ended(self) -> None:
        self._set(_Step.GAP, None if self._idle_step else time.monotonic())

    def _set(self, step: _Step, ended_at: float | None = None) -> None:
        with self._changed:
            self._step = step
            if ended_at is not None:
                self._ended_at = ended_at
            self._changed.notify_all()

    def pause(self) -> None:
        """Called by a save before each chunk: with ``yield_to_prefill`` it waits while a
        prefill step runs or vLLM is between steps (less than :attr:`step_gap_s` since
        the last ended), no longer than :data:`MAX_RUNNING_YIELD_S` since its save began,
        nor than :data:`MAX_YIELD_S` since vLLM named finished a request whose saves have
        not landed (its blocks are held for them: this save may be ahead of them)."""
        if not self.yield_to_prefill:
            return
        began = getattr(self._began, "at", None)
        began = time.monotonic() if began is None else began
        with self._changed:
            while self._step is not _Step.DECODE:
                now = time.monotonic()
                wait = min(began + MAX_RUNNING_YIELD_S, self._held_since() + MAX_YIELD_S) - now
                if self._step is _Step.GAP:
                    wait = min(wait, self._ended_at + self.step_gap_s - now)
                if wait <= 0:
                    return
                self._changed.wait(wait)

    def _held_since(self) -> float:
        """When vLLM named finished the first request whose blocks it still holds for
        saves (inf: none)."""
        with self._lock:
            return min(self._finished_at.values(), default=math.inf)

    def _run_in_background(self, ids: list[str], save: Callable[[], None]) -> None:
        """On the background thread a save's writes are background ones: on a drive they
        wait for the transfers someone waits for (:mod:`~kvtier.io_priority`)."""
        with background_io():
            self._run(ids, save)

    def _run(self, ids: list[str], save: Callable[[], None]) -> None:
        self._began.at = time.monotonic()
        try:
            save()
        except Exception:  # noqa: BLE001 - never lose the count: the blocks must be freed
            log.exception("kvtier save failed")
        finally:
            with self._lock:
                self._pending.subtract(ids)
                for i in ids:
                    if self._pending[i] <= 0:
                        del self._pending[i]

    def finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Of the requests vLLM finished (now or before) and that had saves, those whose
        saves have all landed: vLLM may free their blocks."""
        now = time.monotonic()
        with self._lock:
            for i in finished_req_ids:
                if i in self._seen:
                    self._finishing.add(i)
                    self._finished_at.setdefault(i, now)
            held = bool(self._finishing)
            done = {i for i in self._finishing if self._pending[i] <= 0}
            self._finishing -= done
            self._seen -= done
            for i in done:
                self.hold_s += now - self._finished_at.pop(i, now)
                self.holds += 1
        if held and self.yield_to_prefill:
            with self._changed:  # a yielding save looks at the holds again
                self._changed.notify_all()
        return done

    def drain(self) -> None:
        """Wait for every save submitted so far (a save yielding to a prefill goes on:
        whoever drains needs it now)."""
        self._set(_Step.GAP, -math.inf)
        last = self._last
        if last is not None:
            last.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
