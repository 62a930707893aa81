"""An asyncio face for the engine: many coroutines submit turns, one thread steps the model.

The engine is single-threaded by design (one scheduler, one pool); this wrapper gives it a
dedicated loop thread and hands results and streamed text back to the caller's event loop,
so a web server can hold thousands of open conversations while the model batches them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from kvtier.engine.engine import Engine, turn_error
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.session import TurnResult
from kvtier.thread_start import thread_started

_STOP = object()
T = TypeVar("T")
log = logging.getLogger(__name__)


class AsyncEngine:
    """Owns an :class:`Engine` and the thread that runs it."""

    def __init__(self, engine: Engine, tick_s: float = 0.25):
        """``tick_s``: how often an idle engine looks after background offloads and the
        offload policy (idle sessions leave the pool even when no request arrives)."""
        self.engine = engine
        self.tick_s = tick_s
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="kvtier-engine", daemon=True)
        self._closed = False
        self._thread.start()

    # ----------------------------------------------------------------- thread side
    def _loop(self) -> None:
        """Admit submitted work between steps; step while anything runs."""
        thread_started()
        pending: list[tuple[Callable[[], None], Callable[[], bool]]] = []
        while True:
            block = not pending and not self.engine.scheduler.has_work
            try:
                job = self._jobs.get(block=block, timeout=self.tick_s if block else 0)
            except queue.Empty:
                job = None
                if block:
                    self._guarded(self.engine.tick)
            if job is _STOP:
                return
            if job is not None:
                pending.append(job(self))
                continue  # drain every queued submission before the next step
            if self.engine.scheduler.has_work:
                self._guarded(self.engine.step)
            still = []
            for complete, is_done in pending:
                if is_done():
                    complete()
                else:
                    still.append((complete, is_done))
            pending = still

    @staticmethod
    def _guarded(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - background upkeep must never stop the loop
            log.exception("engine upkeep failed")

    def _submit(
        self, make: Callable[[AsyncEngine], tuple[Callable[[], None], Callable[[], bool]]]
    ) -> None:
        if self._closed:
            raise RuntimeError("the AsyncEngine is closed")
        self._jobs.put(make)

    # ------------------------------------------------------------------- caller side
    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the engine thread between steps (the engine is
        single-threaded: control calls such as offload or restore go through here)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def make(_: AsyncEngine):
            try:
                value = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                loop.call_soon_threadsafe(_set_result, fut, value)
            return (lambda: None), (lambda: True)

        self._submit(make)
        return await fut

    async def chat(
        self,
        session_id: str,
        message: str,
        params: SamplingParams | None = None,
        system: str | None = None,
        on_text: Callable[[str], None] | None = None,
        prepare: Callable[[Engine], None] | None = None,
    ) -> TurnResult:
        """One turn; ``on_text`` is called on the caller's event loop with each text delta.
        ``prepare(engine)`` runs on the engine thread just before the turn is queued (to
        open or reseed the session in the same step as its turn)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[TurnResult] = loop.create_future()

        def deliver(delta: str) -> None:
            if on_text is not None:
                loop.call_soon_threadsafe(on_text, delta)

        def make(_: AsyncEngine):
            eng = self.engine
            try:
                if prepare is not None:
                    prepare(eng)
                turn = eng.begin_turn(
                    session_id, message, params, system, deliver if on_text else None
                )
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_set_exception, fut, exc)
                return (lambda: None), (lambda: True)

            def complete() -> None:
                try:
                    result = eng.finish_turn(turn)
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    loop.call_soon_threadsafe(_set_exception, fut, exc)
                    return
                if result.error is not None:
                    err = turn_error(session_id, result)
                    loop.call_soon_threadsafe(_set_exception, fut, err)
                else:
                    loop.call_soon_threadsafe(_set_result, fut, result)

            return complete, turn.request_done

        self._submit(make)
        return await fut

    async def stream(
        self,
        session_id: str,
        message: str,
        params: SamplingParams | None = None,
        system: str | None = None,
        prepare: Callable[[Engine], None] | None = None,
    ) -> AsyncIterator[str | TurnResult]:
        """Yield text deltas as they are generated, then the :class:`TurnResult`. Closed
        or cancelled before the result (its reader went away), it aborts the turn at the
        engine's next step instead of generating every token for nobody."""
        q: asyncio.Queue[Any] = asyncio.Queue()
        task = asyncio.ensure_future(
            self.chat(session_id, message, params, system, q.put_nowait, prepare)
        )
        task.add_done_callback(lambda _t: q.put_nowait(_STOP))
        finished = False
        try:
            while True:
                item = await q.get()
                if item is _STOP:
                    break
                yield item
            finished = True
            yield task.result()
        finally:
            if not finished:
                self.cancel(session_id)
                # The turn's own outcome is of no one's interest now: not "never retrieved".
                task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def cancel(self, session_id: str, end_session: bool = False) -> None:
        """Abort the session's turn in flight at the next step, and with ``end_session``
        forget the session too (once its turn finished). Returns at once (a disconnect
        handler cannot wait)."""
        def make(_: AsyncEngine):
            try:
                if end_session:
                    if session_id in self.engine.sessions or session_id in self.engine.busy_sessions:
                        self.engine.end_session(session_id)
                else:
                    self.engine.abort_turn(session_id)
            except Exception:  # noqa: BLE001 - best effort: the session may be gone already
                log.debug("cancel of %s failed", session_id, exc_info=True)
            return (lambda: None), (lambda: True)

        if not self._closed:
            self._submit(make)

    def close(self) -> None:
        """Stop the loop thread (after the step in flight)."""
        if not self._closed:
            self._closed = True
            self._jobs.put(_STOP)
            self._thread.join()


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
