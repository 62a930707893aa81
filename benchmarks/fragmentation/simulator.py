"""Replays a workload through one allocation strategy and measures memory efficiency.

The serving model is iteration-level batching, as in vLLM: each step, waiting requests are
admitted first-come-first-served while the strategy can place them (head-of-line blocking),
then every running sequence grows by one token. When growth fails the most recently
admitted sequence is preempted (its memory freed, the request re-queued at the front to be
recomputed). Requests that can never fit, or wait longer than ``max_wait_steps`` before
starting, are rejected.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

from kvtier.benchmarks.fragmentation.strategies import Strategy
from kvtier.benchmarks.fragmentation.workloads import Workload


@dataclass
class ReplayResult:
    strategy: str
    workload: str
    memory_tokens: int
    utilisation: float
    """Time-averaged tokens held / token slots reserved."""
    internal_fragmentation: float
    """Reserved slots holding no token: 1 - utilisation."""
    external_fragmentation: float
    """Time-averaged free memory outside the largest free extent, as a fraction of memory."""
    memory_reserved_fraction: float
    """Time-averaged reserved slots / memory."""
    memory_held_fraction: float
    """Time-averaged tokens held / memory: how much of the memory does useful work."""
    peak_concurrency: int
    mean_concurrency: float
    completed: int
    rejected: int
    rejected_never_fit: int
    preemptions: int
    copies: int
    tokens_copied: int
    steps: int
    tokens_generated: int
    mean_wait_steps: float

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def replay(workload: Workload, strategy: Strategy, max_wait_steps: int = 4096) -> ReplayResult:
    reqs = workload.requests
    n = len(reqs)
    waiting: deque[int] = deque()
    running: dict[int, int] = {}  # rid -> tokens held, in admission order
    generated = [0] * n
    start_step: list[int | None] = [None] * n
    next_arrival = 0
    completed = rejected = never_fit = preemptions = 0
    peak = 0
    sum_running = sum_held = sum_reserved = sum_ext = 0
    tokens_generated = 0
    wait_total = 0
    step = 0
    cap = strategy.capacity

    def preempt_last() -> int:
        nonlocal preemptions
        victim = next(reversed(running))
        del running[victim]
        strategy.release(victim)
        waiting.appendleft(victim)
        preemptions += 1
        return victim

    while completed + rejected < n:
        if not running and not waiting and next_arrival < n:
            # Idle: jump to the next arrival (idle steps hold and reserve nothing).
            idle_to = max(step, reqs[next_arrival].arrival_step)
            step = idle_to
        while next_arrival < n and reqs[next_arrival].arrival_step <= step:
            waiting.append(next_arrival)
            next_arrival += 1

        # Admission: FCFS with head-of-line blocking.
        while waiting:
            rid = waiting[0]
            r = reqs[rid]
            if not strategy.can_ever_fit(r.total_len, r.max_len):
                waiting.popleft()
                rejected += 1
                never_fit += 1
                continue
            if start_step[rid] is None and step - r.arrival_step > max_wait_steps:
                waiting.popleft()
                rejected += 1
                continue
            length = r.prompt_len + generated[rid]
            if not strategy.admit(rid, length, r.max_len):
                break
            waiting.popleft()
            running[rid] = length
            if start_step[rid] is None:
                start_step[rid] = step
                wait_total += step - r.arrival_step

        # Decode: every running sequence grows by one token.
        for rid in list(running):
            if rid not in running:
                continue  # preempted earlier in this step
            new_len = running[rid] + 1
            while not strategy.grow(rid, new_len):
                if preempt_last() == rid:
                    break
            if rid not in running:
                continue
            running[rid] = new_len
            generated[rid] += 1
            tokens_generated += 1
            if generated[rid] >= reqs[rid].output_len:
                del running[rid]
                strategy.release(rid)
                completed += 1

        held = sum(running.values())
        reserved = strategy.reserved
        free = cap - reserved
        sum_running += len(running)
        sum_held += held
        sum_reserved += reserved
        sum_ext += free - min(free, strategy.largest_free())
        peak = max(peak, len(running))
        step += 1

    util = sum_held / sum_reserved if sum_reserved else 0.0
    started = sum(1 for s in start_step if s is not None)
    return ReplayResult(
        strategy=strategy.name,
        workload=workload.name,
        memory_tokens=cap,
        utilisation=util,
        internal_fragmentation=1.0 - util if sum_reserved else 0.0,
        external_fragmentation=sum_ext / (step * cap) if step else 0.0,
        memory_reserved_fraction=sum_reserved / (step * cap) if step else 0.0,
        memory_held_fraction=sum_held / (step * cap) if step else 0.0,
        peak_concurrency=peak,
        mean_concurrency=sum_running / step if step else 0.0,
        completed=completed,
        rejected=rejected,
        rejected_never_fit=never_fit,
        preemptions=preemptions,
        copies=strategy.copies,
        tokens_copied=strategy.tokens_copied,
        steps=step,
        tokens_generated=tokens_generated,
        mean_wait_steps=wait_total / started if started else 0.0,
    )
