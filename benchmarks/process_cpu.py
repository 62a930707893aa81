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
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROC = Path("/proc")
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
KVTIER_THREAD_PREFIX = "kvtier"
SIDECAR_PROGRAMS = ("kvtier", "kvtier.cli", "kvtier.cli.main")
"""A process whose command line runs one of these (a console script by its file name, a
module by its name) with ``serve`` is a kvtier sidecar (the bench's, an operator's, or a
connector's private one)."""


ROLES = ("vllm", "kvtier_threads", "sidecar")
ENDED = "(threads that ended)"


@dataclass(frozen=True)
class CpuSplit:
    """CPU seconds (user + system) by who spent them: ``threads`` maps ``role/process/thread``
    (the kernel's names, a pool's thread numbers dropped) to seconds. Roles: ``vllm``
    (vLLM's threads), ``kvtier_threads`` (kvtier's named threads inside vLLM's processes:
    the connector's saves, loads...), ``sidecar`` (a kvtier sidecar process, every thread)."""

    threads: Mapping[str, float] = field(default_factory=dict)

    def __add__(self, other: CpuSplit) -> CpuSplit:
        keys = set(self.threads) | set(other.threads)
        return CpuSplit({k: self.threads.get(k, 0.0) + other.threads.get(k, 0.0) for k in keys})

    def __sub__(self, other: CpuSplit) -> CpuSplit:
        keys = set(self.threads) | set(other.threads)
        return CpuSplit({k: self.threads.get(k, 0.0) - other.threads.get(k, 0.0) for k in keys})

    def role_s(self, role: str) -> float:
        return sum(v for k, v in self.threads.items() if k.split("/", 1)[0] == role)

    @property
    def vllm_s(self) -> float:
        return self.role_s("vllm")

    @property
    def kvtier_threads_s(self) -> float:
        return self.role_s("kvtier_threads")

    @property
    def sidecar_s(self) -> float:
        return self.role_s("sidecar")

    @property
    def kvtier_s(self) -> float:
        return self.kvtier_threads_s + self.sidecar_s

    def as_dict(self) -> dict[str, Any]:
        """Totals by role, ``kvtier_s``, and ``threads``: each group's seconds, largest first
        (those under 10 ms left out)."""
        out: dict[str, Any] = {f"{r}_s": round(self.role_s(r), 3) for r in ROLES}
        out["kvtier_s"] = round(self.kvtier_s, 3)
        out["threads"] = {k: round(v, 3) for k, v in
                          sorted(self.threads.items(), key=lambda kv: -kv[1]) if v >= 0.01}
        return out


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
    words = [a.decode(errors="replace") for a in args if a]
    return "serve" in words and any(os.path.basename(w) in SIDECAR_PROGRAMS for w in words)


def thread_group(name: str) -> str:
    """A thread's kernel name without a pool's number (``kvtier-store_3`` -> ``kvtier-store``)."""
    return re.sub(r"[_-]?\d+$", "", name) or name


def _process(pid: int) -> CpuSplit:
    got = _stat_fields(PROC / str(pid) / "stat")
    if got is None:
        return CpuSplit()
    process, total = got[0], _cpu_s(got[1])  # the whole process, threads that ended included
    sidecar = _is_sidecar(pid)
    threads: dict[str, float] = {}
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        tasks = []
    for task in tasks:
        t = _stat_fields(task / "stat")
        if t is None:
            continue
        ours = t[0].startswith(KVTIER_THREAD_PREFIX)
        role = "sidecar" if sidecar else "kvtier_threads" if ours else "vllm"
        main = " (main)" if task.name == str(pid) else ""  # a process's first thread
        key = f"{role}/{process}/{thread_group(t[0])}{main}"
        threads[key] = threads.get(key, 0.0) + _cpu_s(t[1])
    ended = total - sum(threads.values())
    if ended > 0:
        key = f"{'sidecar' if sidecar else 'vllm'}/{process}/{ENDED}"
        threads[key] = ended
    return CpuSplit(threads)


def sample(roots: Iterable[int]) -> CpuSplit | None:
    """CPU seconds so far of ``roots`` and their descendants, split (None off Linux)."""
    if not (PROC / "self" / "task").is_dir():
        return None
    return sum((_process(pid) for pid in descendants(roots)), CpuSplit())
