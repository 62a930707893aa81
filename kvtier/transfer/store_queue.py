"""Asynchronous stores: copies leave the pool on the engine thread, the slow part (encoding,
checksums, disk and network I/O) runs on worker threads while the model keeps computing.

A cap on bytes in flight gives backpressure: when stores fall behind, the next snapshot
waits for room instead of letting host memory grow without bound. (torch releases the GIL
in its kernels and the tiers in their I/O, so on CPU the workers overlap the engine's
compute; on CUDA the gather also runs on a side stream, see ``KVTransfer.snapshot``.)
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvtier.errors import InvalidArgumentError
from kvtier.io_priority import background_io
from kvtier.thread_start import thread_started
from kvtier.transfer.kv_transfer import KVTransfer, SaveReport


class StoreQueue:
    def __init__(self, kv: KVTransfer, max_inflight_bytes: int = 256 << 20, workers: int = 2):
        if max_inflight_bytes < 1 or workers < 1:
            raise InvalidArgumentError(
                f"max_inflight_bytes and workers must be >= 1, got {max_inflight_bytes}, {workers}"
            )
        self.kv = kv
        self.max_inflight_bytes = max_inflight_bytes
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvtier-store",
                                        initializer=thread_started)
        self._cond = threading.Condition()
        self.inflight_bytes = 0
        self.peak_inflight_bytes = 0
        self.submitted = 0
        self.completed = 0
        self.prefetches = 0

    def _reserve(self, nbytes: int) -> None:
        """Wait until ``nbytes`` fit under the cap (a single larger store runs alone)."""
        with self._cond:
            self._cond.wait_for(
                lambda: self.inflight_bytes == 0
                or self.inflight_bytes + nbytes <= self.max_inflight_bytes
            )
            self.inflight_bytes += nbytes
            self.peak_inflight_bytes = max(self.peak_inflight_bytes, self.inflight_bytes)

    def _release(self, nbytes: int) -> None:
        with self._cond:
            self.inflight_bytes -= nbytes
            self.completed += 1
            self._cond.notify_all()

    def submit_save(
        self, token_ids: Sequence[int], tier: int | str = 0, owner: Hashable | None = None,
        raise_copies: bool = False, namespace: str | None = None,
    ) -> Future[SaveReport]:
        """Snapshot now (engine thread), store in the background; the future's result is
        the :class:`SaveReport` (``raise_copies``, ``namespace``: see :meth:`KVTransfer.save`)."""
        snap = self.kv.snapshot(token_ids, reserve=self._reserve,
                                raise_to=tier if raise_copies else None, namespace=namespace)
        self.submitted += 1
        copied = bool(snap.tensors)  # (store gives the snapshot's buffers back)

        def work() -> SaveReport:
            try:
                with background_io():  # nobody waits for it now: reads go first on a drive
                    return self.kv.store(snap, tier, owner)
            finally:
                self._release(snap.nbytes)

        if not copied:  # nothing to copy: complete at once
            self.completed += 1
            done: Future[SaveReport] = Future()
            done.set_result(self.kv.store(snap, tier, owner))
            return done
        try:
            return self._pool.submit(work)
        except BaseException:  # a closed queue: the snapshot's buffers go back, unstored
            self.kv.release(snap)
            self._release(snap.nbytes)
            raise

    def submit_prefetch(self, token_ids: Sequence[int], namespace: str | None = None
                        ) -> Future[int]:
        """Raise the stored chunks of ``token_ids`` (``namespace``'s) to the fastest tier in
        the background (a read that promotes); the future gives how many chunks were read."""
        keys = self.kv.keys_below_fastest(token_ids, namespace)
        if not keys:
            done: Future[int] = Future()
            done.set_result(0)
            return done
        self.prefetches += 1
        return self._pool.submit(
            lambda: self.kv.manager.prefetch(keys)
        )

    def drain(self) -> None:
        """Wait until every submitted store has finished."""
        with self._cond:
            self._cond.wait_for(lambda: self.inflight_bytes == 0)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
