"""The live policy state the engine and the simulator share: ranks and predictions on a
clock passed in, and where a tier's victims go."""

from __future__ import annotations

from kvtier.policies.cost_model import CostModel, LinearCost, PrefillCost, TierCost
from kvtier.policies.live import LivePolicy


def _cost(**tiers) -> CostModel:
    """1,000 KV bytes per token, prefill 1 ms per token; tiers (latency s, bytes/s)."""
    return CostModel("m", "test", 1000, 10, PrefillCost(0.0, 1e-3, 0.0), {
        n: TierCost(n, LinearCost(lat, bw), LinearCost(lat, bw)) for n, (lat, bw) in tiers.items()
    })


def test_a_victim_goes_down_only_where_reloading_it_beats_recompute():
    names = ["cpu", "disk", "redis"]
    live = LivePolicy(_cost(cpu=(0.0, 1e9), disk=(1e-3, 1e8), redis=(0.05, 1e3)), names, 256)
    chunk = 256 * 1000  # one chunk: 0.256 s to recompute
    assert live.demotion_target(0, chunk) == 1  # disk: 3.6 ms back
    assert live.demotion_target(1, chunk) is None  # redis: 256 s back, dropped
    assert live.demotion_target(2, chunk) is None  # nothing below the last tier
    assert live.demotion_target(0, chunk, in_pool=True) is None  # the pool still holds it
    unmeasured = LivePolicy(None, names, 256)
    assert [unmeasured.demotion_target(i, chunk) for i in range(3)] == [1, 2, None]


def test_ranks_and_predictions_follow_the_clock_passed_in():
    live = LivePolicy(_cost(cpu=(0.0, 1e9)), ["cpu"], 256, clock=lambda: 0.0)
    for gap in (30.0, 60.0, 90.0):  # the population's think times
        live.turn_started("x", 0.0)
        live.turn_ended("x", at=0.0)
        live.turn_started("x", gap)
    live.turn_started("a", 0.0)
    live.turn_ended("a", at=100.0)  # a replay records the end ahead of its clock
    assert live.session_rank("a", 50.0) == -1.0 and live.predicted_next_s("a", 50.0) == 0.0
    rank = live.session_rank("a", 200.0)
    assert rank >= 0.0 and live.predicted_next_s("a", 200.0) > 0.0
    live.set_leaving({"a"})
    assert live.eviction_rank("a", 200.0) == -1.0  # the pool lets it go next: copies kept
    assert live.session_rank("a", 200.0) == rank  # the pool's own order is unchanged
    live.left_pool("a")
    assert live.eviction_rank("a", 200.0) == rank
    assert live.session_rank("a", 7200.0) > rank  # idle longer: let go sooner
    live.turn_started("a", 7300.0)
    assert live.eviction_rank("a", 7300.0) == -1.0  # running


def test_a_prediction_is_reused_until_the_idle_time_grows_five_percent():
    live = LivePolicy(_cost(cpu=(0.0, 1e9)), ["cpu"], 256)
    live.turn_started("a", 0.0)
    live.turn_ended("a", at=0.0)
    first = live.prediction("a", 100.0)
    assert live.prediction("a", 104.0) == first
    assert live.prediction("a", 200.0) != first
    assert live.prediction("a", 100.0) == first  # never one made for a longer idle time
    live.forget("a")
    assert live.prediction("a", 200.0) is None


def test_copies_are_raised_only_once_sessions_are_seen_to_come_back():
    names = ["cpu", "disk"]
    convo = LivePolicy(_cost(cpu=(0.0, 1e9), disk=(1e-3, 1e8)), names, 256, clock=lambda: 0.0)
    assert not convo.raises_copies()  # the prior alone decides nothing
    for k in range(25):  # one session, turn after turn
        convo.turn_started("a", now=10.0 * k)
        convo.turn_ended("a", at=10.0 * k + 1)
    assert convo.raises_copies()
    oneshot = LivePolicy(_cost(cpu=(0.0, 1e9), disk=(1e-3, 1e8)), names, 256, clock=lambda: 0.0)
    for k in range(25):  # every request a new session, none comes back
        oneshot.turn_started(k, now=float(k))
        oneshot.turn_ended(k, at=k + 0.5)
    assert not oneshot.raises_copies()
