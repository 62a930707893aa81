"""CPU time a benchmark's servers spent, split into who spent it: vLLM's own threads,
kvtier's threads inside vLLM's processes, and kvtier's sidecar.

On a host whose cores vLLM's compute keeps busy, a connector's cost shows first as CPU it
takes from vLLM; as latency it hides in the noise between server starts (docs/vllm.md,
sessions 40-41). CPU seconds are counted by the kernel for each thread, and kvtier's
threads carry kernel names that start with ``kvtier`` (:mod:`kvtier.thread_start`), so the
split needs no instrumentation of either side. A thread that ended is folded by the kernel
into its process's time and counts as vLLM's (kvtier's pools keep their threads). The
connector's scheduler side runs on vLLM's scheduler thread and counts as vLLM's too (the
bench reports its time apart: ``connector_schedule_s``). Linux only (``/proc``); elsewhere
:func:`sample` returns None.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

PROC = Path("/proc")
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
KVTIER_THREAD_PREFIX = "kvtier"
SIDECAR_ARGS = ("kvtier.cli", "serve")
"""A process whose command line holds these is a kvtier sidecar (the bench's or a
connector's private one)."""


@dataclass(frozen=True)
class CpuSplit:
    """CPU seconds (user + system) by who spent them."""

    vllm_s: float = 0.0
    """vLLM's processes, less kvtier's threads in them."""
    kvtier_threads_s: float = 0.0
    """kvtier's named threads inside vLLM's processes (the connector's saves, loads...)."""
    sidecar_s: float = 0.0
    """kvtier sidecar processes, every thread."""

    def __add__(self, other: CpuSplit) -> CpuSplit:
        return CpuSplit(self.vllm_s + other.vllm_s, self.kvtier_threads_s + other.kvtier_threads_s,
                        self.sidecar_s + other.sidecar_s)

    def __sub__(self, other: CpuSplit) -> CpuSplit:
        return CpuSplit(self.vllm_s - other.vllm_s, self.kvtier_threads_s - other.kvtier_threads_s,
                        self.sidecar_s - other.sidecar_s)

    @property
    def kvtier_s(self) -> float:
        return self.kvtier_threads_s + self.sidecar_s

    def as_dict(self) -> dict[str, float]:
        return {**{k: round(v, 3) for k, v in asdict(self).items()}, "kvtier_s": round(self.kvtier_s, 3)}


def _stat_fields(path: Path) -> tuple[str, list[str]] | None:
    """A ``stat`` file's name (``comm``) and the fields after it; None where it is gone."""
    try:
        text = path.read_text()
    except OSError:
        return None
    head, _, rest = text.rpartition(")")  # the name may hold spaces and parentheses
    return head.partition("(")[2], rest.split()


def _cpu_s(fields: list[str]) -> float:
    # after the name: state(0) ppid(1) ... utime(11) stime(12), in clock ticks
    return (int(fields[11]) + int(fields[12])) * TICK_S


def descendants(roots: Iterable[int]) -> set[int]:
    """``roots`` and every process below them, now."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        got = _stat_fields(entry / "stat")
        if got is not None:
            children.setdefault(int(got[1][1]), []).append(int(entry.name))
    found: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def _is_sidecar(pid: int) -> bool:
    try:
        args = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    words = [a.decode(errors="replace") for a in args]
    return all(w in words for w in SIDECAR_ARGS)


def _process(pid: int) -> CpuSplit:
    got = _stat_fields(PROC / str(pid) / "stat")
    if got is None:
        return CpuSplit()
    total = _cpu_s(got[1])  # the whole process, threads that ended included
    if _is_sidecar(pid):
        return CpuSplit(sidecar_s=total)
    ours = 0.0
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        tasks = []
    for task in tasks:
        t = _stat_fields(task / "stat")
        if t is not None and t[0].startswith(KVTIER_THREAD_PREFIX):
            ours += _cpu_s(t[1])
    return CpuSplit(vllm_s=total - ours, kvtier_threads_s=ours)


def sample(roots: Iterable[int]) -> CpuSplit | None:
    """CPU seconds so far of ``roots`` and their descendants, split (None off Linux)."""
    if not (PROC / "self" / "task").is_dir():
        return None
    return sum((_process(pid) for pid in descendants(roots)), CpuSplit())
