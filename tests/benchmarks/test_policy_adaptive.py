"""kvtier following the better of its store rules on shadow replays (issue 34): before it
judges it is kvtier's own replay, turn for turn; it follows a shadow only on what that
shadow had finished by each arrival; and in a cluster it does the same."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from kvtier.benchmarks.policy_sim.adaptive import RULES, AdaptiveReplay
from kvtier.benchmarks.policy_sim.cluster import Cluster
from kvtier.benchmarks.policy_sim.simulator import Simulator
from kvtier.benchmarks.policy_sim.systems import SYSTEMS
from kvtier.benchmarks.policy_sim.workloads import SyntheticSpec, synthetic
from kvtier.policies.cost_model import CostModel, LinearCost, PrefillCost, TierCost

ADAPTIVE = SYSTEMS["kvtier-adaptive"]


def _cost() -> CostModel:
    """1 ms per prefilled token, 1,000 KV bytes per token; CPU, disk and redis tiers each
    much faster than recompute."""
    return CostModel("m", "test", 1000, 4, PrefillCost(0.0, 1e-3, 0.0), {
        n: TierCost(n, LinearCost(lat, bw), LinearCost(lat, bw))
        for n, lat, bw in (("cpu", 1e-5, 1e10), ("disk", 1e-4, 1e9), ("redis", 1e-3, 1e8))})


def _wl():
    return synthetic(SyntheticSpec(sessions=60, session_rate_per_s=3.0, turns_mean=2.0), seed=5)


def _make(wl, cost, nodes: int = 1):
    tiers = {"cpu": 4e6, "disk": 4e7, "redis": 1e9}

    def make(spec):
        if nodes > 1:
            return Cluster(wl, spec, cost, 2e6, tiers, nodes)
        return Simulator(wl, spec, cost, 2e6, tiers)
    return make


def test_before_it_judges_it_is_kvtiers_own_replay():
    wl, cost = _wl(), _cost()
    make = _make(wl, cost)
    alone = make(replace(SYSTEMS["kvtier"], name=ADAPTIVE.name)).run()  # the pays rule throughout
    n = len(wl.turns) + 1
    res = AdaptiveReplay(wl, ADAPTIVE, make, window=n, min_turns=n).run()
    assert res.ttft_s == pytest.approx(alone.ttft_s)
    assert res.decisions["follow_pays"] == len(wl.turns) and res.decisions["follow_switches"] == 0


@pytest.mark.parametrize("nodes", [1, 3])
def test_it_follows_the_faster_shadow_on_what_had_finished(nodes):
    wl, cost = _wl(), _cost()
    replay = AdaptiveReplay(wl, ADAPTIVE, _make(wl, cost, nodes), window=8, min_turns=4)
    seen: list[tuple[float, float]] = []  # (arrival of the choosing turn, last finish it saw)
    observe = replay.judge.observe
    finishes: dict[str, list[float]] = {rule: [] for rule in RULES}
    replay.judge.observe = lambda rule, ttft: (finishes[rule].append(ttft), observe(rule, ttft))[1]
    see = replay._see_until

    def see_until(now):
        see(now)
        seen.append((now, sum(len(f) for f in finishes.values())))
    replay._see_until = see_until
    res = replay.run()
    merged = getattr(res, "merged", res)
    assert merged.decisions["follow_pays"] + merged.decisions["follow_through"] == len(wl.turns)
    # a turn's choice saw fewer shadow turns than had been replayed before it: only those
    # whose first token had come by its arrival
    assert any(n < 2 * i for i, (_, n) in enumerate(seen))
    assert all(n <= 2 * i for i, (_, n) in enumerate(seen))
    shadows = {rule: s.finish() for rule, s in replay.shadows.items()}
    for rule, r in shadows.items():
        assert len(getattr(r, "merged", r).ttft_s) == len(wl.turns), rule


@pytest.mark.parametrize("nodes", [1, 3])
def test_shadows_are_judged_on_each_turns_own_time_not_their_backlog(nodes):
    """A replay's step gives each turn's TTFT and its wait behind earlier turns; the judge
    sees the rest (a backlog is the shadow's history, not what its rule does now)."""
    wl, cost = _wl(), _cost()
    make = _make(wl, cost, nodes)
    alone = make(replace(SYSTEMS["kvtier"], write_through=True))
    times = [alone.step(i, t) for i, t in enumerate(wl.turns)]
    res = alone.finish()
    merged = getattr(res, "merged", res)
    assert sorted(x.ttft_s for x in times) == pytest.approx(sorted(merged.ttft_s))
    assert sum(x.queued_s for x in times) == pytest.approx(merged.breakdown["queue_s"])
    assert any(x.queued_s > 0.01 * x.ttft_s for x in times)  # this workload queues
    replay = AdaptiveReplay(wl, ADAPTIVE, make, window=8, min_turns=4)
    judged: list[float] = []
    observe = replay.judge.observe
    replay.judge.observe = lambda rule, cost: (judged.append(cost) if rule == "through" else None,
                                               observe(rule, cost))[1]
    replay.run()
    judged_n = Counter(judged)  # the same replay, deterministic: the very same floats
    assert judged_n <= Counter(x.served_s for x in times) and len(judged) > len(times) // 2
    assert not judged_n <= Counter(x.ttft_s for x in times)  # not the TTFTs
    assert min(x.served_s for x in times) >= 0
