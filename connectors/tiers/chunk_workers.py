"""Process-wide worker threads for per-chunk CPU work: encoding a chunk into its slot
(gather + checksums) on the way out; verifying one read back, and scattering it into the
pool, on the way in.

Both are a copy or a checksum pass over tens of MiB with the GIL released (torch copies,
xxh3), so two chunks at once keep both cores of a small host busy: each thread hashes a
group of layers while it is still in cache from its own copy, where one thread would run
the copy and then the checksum pass back to back. Two separate pools, so that a task of
one never waits on a full pool of the other (a store may evict, and an eviction may read).
Copies on these threads are numpy's (:mod:`kvtier.gpu_pool.kernels.host_blocks`), not
torch's, which would start a team of intra-op threads per worker.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

from kvtier.thread_start import thread_started

T = TypeVar("T")
R = TypeVar("R")

WORKERS = 2
"""Threads of the store pool: beyond two, chunks contend for memory bandwidth on the hosts
measured (docs/performance.md)."""

RESTORE_WORKERS = min(8, max(WORKERS, (os.cpu_count() or 1) // 2))
"""Threads of the restore pool: two on a small host, more on a large one, where a restore to
a GPU checks chunks on the host while their copies run (one core hashes about 10 GB/s
from DRAM on a server, a fifth of a pinned copy's speed: measured on an H200's host)."""

_pools: dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()
_here = threading.local()
"""``pool``: the name of the pool the current thread belongs to (set by its initializer)."""


def _pool(name: str) -> tuple[ThreadPoolExecutor, int]:
    size = RESTORE_WORKERS if name == "restore" else WORKERS
    with _lock:
        pool = _pools.get(name)
        if pool is None:
            pool = _pools[name] = ThreadPoolExecutor(
                size, thread_name_prefix=f"kvtier-chunk-{name}",
                initializer=_mark, initargs=(name,))
        return pool, size


def _mark(name: str) -> None:
    _here.pool = name
    thread_started()  # not only the core of the thread that started the pool


def on_pool(name: str) -> bool:
    """Whether the calling thread is one of pool ``name``'s workers. Asked of the thread
    itself, not of its name: other threads (a store queue's, a restore loader's) have
    names of their own that may look alike, and must get the pool's two workers."""
    return getattr(_here, "pool", None) == name


class Mapping(Generic[R]):
    """A map started on a pool's workers; :meth:`result` waits for it."""

    def __init__(self, out: list[R | None], workers: list[Future[None]]) -> None:
        self._out = out
        self._workers = workers

    def result(self) -> list[R]:
        """The results in order, once every item ran; the first error is raised after."""
        for w in self._workers:
            w.result()
        return self._out  # type: ignore[return-value]


def _start(name: str, fn: Callable[[T], R], items: Iterable[T]) -> Mapping[R]:
    """Each worker takes the next item as it finishes one (items of unequal size keep all
    busy; one task per worker, not a future per item: a vLLM block's chunk is a few
    hundred microseconds of work). Every item runs even where one raises; the first error
    is raised by :meth:`Mapping.result`."""
    items = list(items)
    if len(items) < 2 or on_pool(name):  # one item, or on this pool already: inline
        done: Future[None] = Future()
        try:
            out: list[R | None] = [fn(item) for item in items]
            done.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - raised by result()
            out = []
            done.set_exception(exc)
        return Mapping(out, [done])
    out = [None] * len(items)
    order = iter(range(len(items)))
    taking = threading.Lock()

    def work() -> None:
        failure: BaseException | None = None
        while True:
            with taking:
                i = next(order, None)
            if i is None:
                break
            try:
                out[i] = fn(items[i])
            except BaseException as exc:  # noqa: BLE001 - raised once every item ran
                failure = failure or exc
        if failure is not None:
            raise failure

    pool, size = _pool(name)
    return Mapping(out, [pool.submit(work) for _ in range(min(size, len(items)))])


def _map(name: str, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    return _start(name, fn, items).result()


def map_store(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``[fn(item) for item in items]``, chunks encoded two at a time, results in order."""
    return _map("store", fn, items)


def map_restore(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``[fn(item) for item in items]``, chunks verified or scattered on the restore pool
    (two at a time on a small host), results in order."""
    return _map("restore", fn, items)


def start_restore(fn: Callable[[T], R], items: Iterable[T]) -> Mapping[R]:
    """:func:`map_restore` started, not waited for: the caller works meanwhile (a restore
    to a GPU issues its copies while the workers check the chunks)."""
    return _start("restore", fn, items)
