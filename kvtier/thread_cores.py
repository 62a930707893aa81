"""kvtier's background threads run on every core their process's threads may use, not on
the one core of the thread that happened to start them.

Linux gives a new thread the CPU affinity of the thread that creates it. vLLM's CPU worker
binds its main thread and each of its OpenMP threads to one core of its rank
(``VLLM_CPU_OMP_THREADS_BIND``), and the connector's threads are started from that main
thread: all of them would share its one core, the restore workers that verify and
scatter parts of a load (up to 8 on a large host) taking turns on it. Widened to the union
of the process's threads' cores (the rank's cores: a rank bound to one core keeps its
threads there), they can run side by side. On a two-core host it measured no different
(docs/vllm.md, session 41): whenever vLLM computes, its OpenMP threads hold both cores and
a kvtier thread takes its time from one of them wherever it runs.

Threads call :func:`spread_this_thread` as they start (a pool's initializer). Where the
platform has no affinity calls, or the process is not pinned, it does nothing; nor where
the environment says ``KVTIER_THREAD_CORES=inherit`` (Linux's own rule: an operator who
pins a process's threads deliberately, or a benchmark measuring the difference).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

TASKS_DIR = "/proc/self/task"
ENV = "KVTIER_THREAD_CORES"
MODES = ("process", "inherit")
"""``process`` (the default): every core of the process; ``inherit``: the starting thread's."""


def mode() -> str:
    """What :data:`ENV` asks for; an unknown value is logged and the default used."""
    value = os.environ.get(ENV, "process").strip().lower() or "process"
    if value not in MODES:
        log.warning("kvtier: %s=%r is not one of %s; using 'process'", ENV, value, ", ".join(MODES))
        return "process"
    return value


def process_cores() -> frozenset[int] | None:
    """The cores any thread of this process may run on (None where unknown)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores: set[int] = set()
    try:
        tids = [int(t) for t in os.listdir(TASKS_DIR)]
    except OSError:
        return frozenset(os.sched_getaffinity(0))
    for tid in tids:
        try:
            cores |= os.sched_getaffinity(tid)
        except OSError:  # a thread that ended meanwhile
            continue
    return frozenset(cores) or None


def spread_this_thread() -> frozenset[int] | None:
    """Let the calling thread run on every core of its process (:func:`process_cores`)
    where it is confined to fewer; the cores it may use after, or None where unknown.
    Never raises: it runs as pools' initializers, and a pool whose initializer fails is
    broken for good, while a thread left on its cores only runs slower."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        mine = frozenset(os.sched_getaffinity(0))
        if mode() == "inherit":
            return mine
        wider = process_cores()
        if wider is None or wider <= mine:
            return mine
        os.sched_setaffinity(0, wider)  # 0: the calling thread, on Linux
    except OSError as exc:  # a cgroup that forbids it: the thread stays where it was
        log.debug("kvtier: could not widen a thread's cores: %s", exc)
        return None
    return wider
