"""Chunk work runs two at a time on its pool's workers, whoever calls: a store queue's or a
restore loader's thread (whose names start like the pools' did once) gets the two workers,
and a worker that maps again runs inline (no deadlock on a full pool)."""

from __future__ import annotations

import threading

from kvtier.connectors.tiers.chunk_workers import map_restore, map_store, on_pool


def _two_at_once(mapper, caller_name: str) -> list[str]:
    """Run two items that can only both finish if they run at the same time, from a thread
    named ``caller_name``; the worker names that ran them."""
    barrier = threading.Barrier(2, timeout=10)
    seen: list[str] = []
    errors: list[BaseException] = []

    def item(_: int) -> None:
        seen.append(threading.current_thread().name)
        barrier.wait()  # a BrokenBarrierError if the items ran one after the other

    def call() -> None:
        try:
            mapper(item, [0, 1])
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    t = threading.Thread(target=call, name=caller_name)
    t.start()
    t.join(30)
    assert not errors, errors
    return seen


def test_a_store_queue_thread_gets_two_workers():
    seen = _two_at_once(map_store, "kvtier-store_0")  # StoreQueue's own thread names
    assert len(set(seen)) == 2 and all(n.startswith("kvtier-chunk-store") for n in seen)


def test_a_restore_loader_thread_gets_two_workers():
    seen = _two_at_once(map_restore, "kvtier-restore_0")  # the restore loader's thread name
    assert len(set(seen)) == 2 and all(n.startswith("kvtier-chunk-restore") for n in seen)


def test_a_worker_that_maps_again_runs_inline():
    def outer(i: int) -> tuple[bool, list[int]]:
        return on_pool("store"), map_store(lambda j: j * 10 + i, [1, 2, 3])

    results = map_store(outer, [0, 1])
    assert results == [(True, [10, 20, 30]), (True, [11, 21, 31])]
    assert not on_pool("store")

