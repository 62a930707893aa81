"""kvtier following the better of its store rules, judged on shadow replays
(:mod:`kvtier.policies.follow_the_best`).

Beside the live replay run one shadow per rule, each a replay of the same turns with that
rule fixed: ``pays`` (kvtier's: a computed chunk is stored where its copy pays for itself,
GPU victims written back where that pays) and ``through`` (every computed prompt chunk in
every tier as it is computed, LMCache's rule, on top of the rest of kvtier's policy). Each
turn the live replay uses the rule whose shadow served the recent turns fastest, each turn
judged on its own time: its TTFT less its wait behind earlier turns (that wait is the
shadow's history, which the live replay does not share: under a backlog a shadow that fell
behind early stays behind whatever its rule does now, and one ahead for that reason is no
reason to follow it). A shadow's turn counts only from when its first token would have
come: the choice for a turn sees the turns that had finished by its arrival, as a live
engine would.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from kvtier.benchmarks.policy_sim.node import TurnTime
from kvtier.benchmarks.policy_sim.systems import SystemSpec
from kvtier.benchmarks.policy_sim.workloads import Turn, Workload
from kvtier.policies.follow_the_best import DEFAULT_MIN_TURNS, DEFAULT_WINDOW, FollowTheBest

RULES = {"pays": False, "through": True}
"""Store rule -> whether every computed prompt chunk goes to every tier."""


class Replay(Protocol):
    """A simulator or a cluster, stepped turn by turn."""

    through: bool

    def step(self, index: int, t: Turn) -> TurnTime: ...
    def finish(self): ...


class AdaptiveReplay:
    def __init__(self, workload: Workload, spec: SystemSpec, make: Callable[[SystemSpec], Replay],
                 window: int = DEFAULT_WINDOW, min_turns: int = DEFAULT_MIN_TURNS) -> None:
        """``make``: a replay of a system (one node, or a cluster) on this workload."""
        self.w = workload
        self.live = make(spec)
        self.shadows = {rule: make(replace(spec, write_through=on)) for rule, on in RULES.items()}
        self.judge = FollowTheBest(list(RULES), window, min(min_turns, window))
        self._pending: list[tuple[float, int, str, float]] = []
        """(when the shadow's first token came, turn, rule, TTFT): not seen yet."""

    def run(self):
        for i, t in enumerate(self.w.turns):
            self._see_until(t.arrival_s)
            self.live.through = RULES[self.judge.choose()]
            self.live.step(i, t)
            for rule, shadow in self.shadows.items():
                time = shadow.step(i, t)
                heapq.heappush(self._pending, (t.arrival_s + time.ttft_s, i, rule, time.served_s))
        res = self.live.finish()
        merged = getattr(res, "merged", res)
        merged.decisions.update({f"follow_{rule}": n for rule, n in self.judge.turns_followed.items()})
        merged.decisions["follow_switches"] = self.judge.switches
        return res

    def _see_until(self, now: float) -> None:
        while self._pending and self._pending[0][0] <= now:
            _, _, rule, served = heapq.heappop(self._pending)
            self.judge.observe(rule, served)
