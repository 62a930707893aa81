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
    state = _Replay(workload, strategy, max_wait_steps)
    while state.completed + state.rejected < state.n:
        state.arrive()
        state.admit()
        state.decode()
        state.account()
    return state.result()


class _Replay:
    """The state of one replay between steps, and the phases of a step."""

    def __init__(self, workload: Workload, strategy: Strategy, max_wait_steps: int) -> None:
        self.workload = workload
        self.strategy = strategy
        self.max_wait_steps = max_wait_steps
        self.reqs = workload.requests
        self.n = n = len(self.reqs)
        self.waiting: deque[int] = deque()
        self.running: dict[int, int] = {}  # rid -> tokens held, in admission order
        self.generated = [0] * n
        self.start_step: list[int | None] = [None] * n
        self.next_arrival = 0
        self.completed = self.rejected = self.never_fit = self.preemptions = 0
        self.peak = 0
        self.sum_running = self.sum_held = self.sum_reserved = self.sum_ext = 0
        self.tokens_generated = 0
        self.wait_total = 0
        self.step = 0
        self.cap = strategy.capacity

    def arrive(self) -> None:
        """Queue the requests that have arrived by this step."""
        reqs, n = self.reqs, self.n
        if not self.running and not self.waiting and self.next_arrival < n:
            # Idle: jump to the next arrival (idle steps hold and reserve nothing).
            self.step = max(self.step, reqs[self.next_arrival].arrival_step)
        while self.next_arrival < n and reqs[self.next_arrival].arrival_step <= self.step:
            self.waiting.append(self.next_arrival)
            self.next_arrival += 1

    def admit(self) -> None:
        """Admission: FCFS with head-of-line blocking."""
        waiting, strategy, step = self.waiting, self.strategy, self.step
        start_step = self.start_step
        while waiting:
            rid = waiting[0]
            r = self.reqs[rid]
            if not strategy.can_ever_fit(r.total_len, r.max_len):
                waiting.popleft()
                self.rejected += 1
                self.never_fit += 1
                continue
            if start_step[rid] is None and step - r.arrival_step > self.max_wait_steps:
                waiting.popleft()
                self.rejected += 1
                continue
            length = r.prompt_len + self.generated[rid]
            if not strategy.admit(rid, length, r.max_len):
                break
            waiting.popleft()
            self.running[rid] = length
            if start_step[rid] is None:
                start_step[rid] = step
                self.wait_total += step - r.arrival_step

    def decode(self) -> None:
        """Decode: every running sequence grows by one token."""
        running, strategy, generated, reqs = self.running, self.strategy, self.generated, self.reqs
        for rid in list(running):
            if rid not in running:
                continue  # preempted earlier in this step
            new_len = running[rid] + 1
            while not strategy.grow(rid, new_len):
                if self.preempt_last() == rid:
                    break
            if rid not in running:
                continue
            running[rid] = new_len
            generated[rid] += 1
            self.tokens_generated += 1
            if generated[rid] >= reqs[rid].output_len:
                del running[rid]
                strategy.release(rid)
                self.completed += 1

    def preempt_last(self) -> int:
        """Free the most recently admitted sequence and re-queue it at the front."""
        victim = next(reversed(self.running))
        del self.running[victim]
        self.strategy.release(victim)
        self.waiting.appendleft(victim)
        self.preemptions += 1
        return victim

    def account(self) -> None:
        """Add this step's memory use to the time averages and move to the next step."""
        reserved = self.strategy.reserved
        free = self.cap - reserved
        self.sum_running += len(self.running)
        self.sum_held += sum(self.running.values())
        self.sum_reserved += reserved
        self.sum_ext += free - min(free, self.strategy.largest_free())
        self.peak = max(self.peak, len(self.running))
        self.step += 1

    def result(self) -> ReplayResult:
        step, cap, sum_reserved = self.step, self.cap, self.sum_reserved
        util = self.sum_held / sum_reserved if sum_reserved else 0.0
        started = sum(1 for s in self.start_step if s is not None)
        return ReplayResult(
            strategy=self.strategy.name,
            workload=self.workload.name,
            memory_tokens=cap,
            utilisation=util,
            internal_fragmentation=1.0 - util if sum_reserved else 0.0,
            external_fragmentation=self.sum_ext / (step * cap) if step else 0.0,
            memory_reserved_fraction=sum_reserved / (step * cap) if step else 0.0,
            memory_held_fraction=self.sum_held / (step * cap) if step else 0.0,
            peak_concurrency=self.peak,
            mean_concurrency=self.sum_running / step if step else 0.0,
            completed=self.completed,
            rejected=self.rejected,
            rejected_never_fit=self.never_fit,
            preemptions=self.preemptions,
            copies=self.strategy.copies,
            tokens_copied=self.strategy.tokens_copied,
            steps=step,
            tokens_generated=self.tokens_generated,
            mean_wait_steps=self.wait_total / started if started else 0.0,
        )
