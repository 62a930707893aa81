"""kvtier's background threads run on every core of their process, not on the one core of
the thread that started them: as in vLLM's CPU worker, whose main thread (which starts the
connector's threads) and OpenMP threads are each bound to one core. Run in a fresh process,
so that the pools are started from a pinned thread as they are there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, os, threading
    from concurrent.futures import Future
    cores = sorted(os.sched_getaffinity(0))
    first, last = cores[0], cores[-1]
    # another thread of the process bound to the last core (vLLM's OpenMP thread there),
    # then the main thread to the first (vLLM binds its worker's main thread so)
    ready, stop = threading.Event(), threading.Event()
    def omp():
        os.sched_setaffinity(0, {last})
        ready.set()
        stop.wait()
    if os.environ["ANOTHER_CORE"] == "1":
        threading.Thread(target=omp, daemon=True).start()
        ready.wait()
    os.sched_setaffinity(0, {first})

    from kvtier.connectors.tiers.chunk_workers import map_restore, map_store
    from kvtier.connectors.vllm_loads import LoadQueue
    from kvtier.connectors.vllm_saves import SaveQueue

    def here(_=None):
        return sorted(os.sched_getaffinity(0))

    seen = {"main": here()}
    plain = []
    t = threading.Thread(target=lambda: plain.append(here()))
    t.start(); t.join()
    seen["plain_thread"] = plain[0]
    seen["restore"] = map_restore(here, [0, 1])
    seen["store"] = map_store(here, [0, 1])
    saved = Future()
    saves = SaveQueue(background=True)
    saves.submit(["r"], lambda: saved.set_result(here()))
    seen["save"] = saved.result(30)
    idle_saved = Future()
    idle_saves = SaveQueue(background=True, idle=True)
    idle_saves.submit(["r"], lambda: idle_saved.set_result(here()))
    seen["idle_save"] = idle_saved.result(30)

    class L:
        req_id = "r"
    loaded = []
    loads = LoadQueue(lambda load: loaded.append(here()) or set(), lambda load: set())
    loads.submit([L()]).result(30)
    seen["load"] = loaded[0]
    seen["cores"] = cores
    stop.set()
    print(json.dumps(seen))
""")


def _run(another_core: bool, mode: str = "process") -> dict:
    env = dict(os.environ, ANOTHER_CORE=str(int(another_core)), KVTIER_THREAD_CORES=mode)
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_connector_threads_started_from_a_pinned_thread_use_every_core_of_the_process():
    seen = _run(another_core=True)
    cores = seen["cores"]
    first = cores[:1]
    process = sorted({cores[0], cores[-1]})
    _check(seen, first, process)


def test_a_process_bound_to_one_core_keeps_its_threads_there():
    """A rank bound to one core (``VLLM_CPU_OMP_THREADS_BIND='0|1'``) keeps kvtier's
    threads on it: widening stops at the cores the process's threads already have."""
    seen = _run(another_core=False)
    first = seen["cores"][:1]
    _check(seen, first, first)


def test_inherit_leaves_them_on_the_core_of_the_thread_that_started_them():
    seen = _run(another_core=True, mode="inherit")
    first = seen["cores"][:1]
    _check(seen, first, first)


def _check(seen: dict, first: list[int], process: list[int]) -> None:
    assert seen["main"] == first
    assert seen["plain_thread"] == first  # what Linux gives a new thread: its creator's core
    for name in ("save", "idle_save", "load"):
        assert seen[name] == process, (name, seen)
    for name in ("restore", "store"):
        assert all(c == process for c in seen[name]), (name, seen)


def test_an_unknown_setting_is_named_in_a_warning_and_the_default_used(monkeypatch, caplog):
    from kvtier.thread_cores import ENV, mode

    monkeypatch.setenv(ENV, "everywhere")
    with caplog.at_level("WARNING", logger="kvtier.thread_cores"):
        assert mode() == "process"
    assert "everywhere" in caplog.text and "inherit" in caplog.text
    monkeypatch.setenv(ENV, " Inherit ")
    assert mode() == "inherit"
