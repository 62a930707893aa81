"""Load-aware decisions on hand-computable cases: measured busy shares and their weights,
what a write or a wait for a copy is worth under load, the restore plan on a busy or queued
link, and the watch on the pool's victims."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.errors import InvalidArgumentError
from kvtier.policies.cost_model import CostModel, LinearCost, PrefillCost, TierCost
from kvtier.policies.live import LivePolicy
from kvtier.policies.load import IDLE, MAX_SHARE, BusyShare, LoadMeter, LoadWeights, delay_weight
from kvtier.policies.offload import (
    IdleSession,
    PredictiveOffload,
    copy_value,
    displace_pays,
    landing_pays,
    worth_storing,
    write_pays,
)
from kvtier.policies.restore import StoredChunk, plan_restore
from kvtier.policies.victim_reuse import VictimReuse


def _cost(read_bps: float = 1e6, write_bps: float = 1e6) -> CostModel:
    """1 KB of KV per token, 1 ms per prefilled token: a 256-token chunk recomputes in
    0.256 s and moves in 0.256 s at 1 MB/s."""
    return CostModel("m", "test", 1000, 4, PrefillCost(0.0, 1e-3, 0.0),
                     {"cpu": TierCost("cpu", LinearCost(0.0, read_bps), LinearCost(0.0, write_bps))})


# ----------------------------------------------------------------- busy shares
def test_a_steady_duty_cycle_reads_as_its_share():
    b = BusyShare(horizon_s=60.0)
    for i in range(600):  # busy 0.25 s of every second for 10 minutes
        b.observe(float(i), 0.25)
    assert b.share(600.0) == pytest.approx(0.25, abs=0.01)


def test_a_short_history_is_not_diluted_by_the_horizon():
    b = BusyShare(horizon_s=60.0)
    for i in range(10):  # 10 s seen, half busy: a half, not 10/60 of a half
        b.observe(float(i), 0.5)
    assert b.share(10.0) == pytest.approx(0.5, abs=0.05)


def test_idle_time_decays_the_share_and_out_of_order_intervals_count():
    b = BusyShare(horizon_s=10.0)
    b.observe(0.0, 10.0)
    assert b.share(10.0) == MAX_SHARE  # busy all along: read as saturated, not infinite
    assert b.share(40.0) < 0.1  # 30 s idle, three horizons
    late = BusyShare(horizon_s=10.0)
    late.observe(5.0, 5.0)
    late.observe(0.0, 5.0)  # reported after a later one
    assert late.share(10.0) == MAX_SHARE
    assert BusyShare().share(1.0) == 0.0  # nothing seen: idle
    with pytest.raises(InvalidArgumentError, match="horizon"):
        BusyShare(horizon_s=0.0)


@given(st.floats(0.0, 1.0))
def test_delay_weight_is_one_over_the_idle_share_and_finite(share):
    w = delay_weight(share)
    assert 1.0 <= w <= 1.0 / (1.0 - MAX_SHARE) + 1e-9
    assert w == pytest.approx(1.0 / (1.0 - min(share, MAX_SHARE)))


def test_meter_weights_name_every_link_it_has_seen():
    m = LoadMeter(horizon_s=60.0)
    for i in range(120):
        m.observe_compute(float(i), 0.5)
        m.observe_link("disk", float(i), 0.75)
    w = m.weights(120.0, {"disk": 0.3})
    assert w.compute == pytest.approx(2.0, rel=0.05)
    assert w.link("disk") == pytest.approx(4.0, rel=0.1)
    assert w.link("cpu") == 1.0 and w.wait("disk") == 0.3 and w.wait("cpu") == 0.0


def test_a_duplex_tiers_writes_are_weighed_on_their_own_path():
    """PCIe or a network link carries writes beside reads: a write is priced by its own
    path's load and queue, a read by the reads'; a drive's writes share its reads' path."""
    m = LoadMeter(horizon_s=60.0, duplex=["cpu"])
    for i in range(120):
        m.observe_link("cpu", float(i), 0.75)  # reads: busy
        m.observe_link("disk", float(i), 0.75, write=True)  # a drive: writes share the path
    w = m.weights(120.0, {"cpu": 0.3}, {"cpu": 0.0})
    assert w.link("cpu") == pytest.approx(4.0, rel=0.1) and w.write_link("cpu") == 1.0
    assert w.wait("cpu") == 0.3 and w.write_wait("cpu") == 0.0
    assert w.link("disk") == pytest.approx(4.0, rel=0.1) == w.write_link("disk")
    m.observe_link("cpu", 119.0, 50.0, write=True)  # now the write path is the busy one
    assert m.weights(120.0).write_link("cpu") > 1.5
    cost = _cost(read_bps=1e7, write_bps=1e6)  # write 0.256 s, load 0.0256 s
    s = IdleSession("s", 256, 256, 60.0, p_return=0.2)  # gains 0.2 * 0.23 = 0.046
    reads_busy = LoadWeights(links={"cpu": 1.5}, write_links={"cpu": 1.0})
    assert write_pays(cost, "cpu", s, reads_busy, blocking=False)  # its path is idle
    writes_busy = LoadWeights(write_links={"cpu": 1.5})
    assert not write_pays(cost, "cpu", s, writes_busy, blocking=False)
    likely = IdleSession("s", 256, 256, 60.0, p_return=0.5)
    fast = _cost(read_bps=1e7, write_bps=1e7)
    queued_reads = LoadWeights(link_wait_s={"cpu": 0.2}, write_wait_s={"cpu": 0.0})
    assert write_pays(fast, "cpu", likely, queued_reads, blocking=True)  # nothing ahead of it
    assert not write_pays(fast, "cpu", likely, LoadWeights(write_wait_s={"cpu": 0.2}), blocking=True)


# ------------------------------------------------------------ write decisions
def test_idle_and_off_the_admission_path_a_write_pays_exactly_when_storing_is_worth_it():
    for read_bps in (1e5, 1e6, 1e7):
        cost = _cost(read_bps)
        s = IdleSession("s", 256, 256, 60.0)
        assert write_pays(cost, "cpu", s, IDLE, blocking=False) == worth_storing(cost, "cpu", 256)


def test_a_write_on_the_admission_path_must_beat_its_delay():
    cost = _cost(read_bps=1e7, write_bps=1e7)  # load 0.0256 s, write 0.0256 s, saves 0.23 s
    likely = IdleSession("s", 256, 256, 60.0, p_return=0.5)
    unlikely = IdleSession("s", 256, 256, 60.0, p_return=0.05)
    assert write_pays(cost, "cpu", likely, IDLE, blocking=True)  # 0.5 * 0.23 > 0.0256
    assert not write_pays(cost, "cpu", unlikely, IDLE, blocking=True)  # 0.05 * 0.23 < 0.0256
    assert write_pays(cost, "cpu", unlikely, IDLE, blocking=False)  # ahead of need it is free
    queued = LoadWeights(link_wait_s={"cpu": 0.2})
    assert not write_pays(cost, "cpu", likely, queued, blocking=True)  # 0.115 < 0.2256
    slack = LoadWeights(link_wait_s={"cpu": -1.0})  # the turn waits a second anyway
    assert write_pays(cost, "cpu", unlikely, slack, blocking=True)


def test_a_busy_link_makes_a_write_cost_what_it_delays_for_others():
    cost = _cost(read_bps=1e7, write_bps=1e6)  # write 0.256 s, load 0.0256 s
    s = IdleSession("s", 256, 256, 60.0, p_return=0.2)  # gains 0.2 * 0.23 = 0.046
    assert write_pays(cost, "cpu", s, IDLE, blocking=False)
    busy = LoadWeights(links={"cpu": 1.5})  # the write's 0.256 s cost others 0.128 s
    assert not write_pays(cost, "cpu", s, busy, blocking=False)


def test_the_offload_policy_drops_on_the_admission_path_what_does_not_pay():
    cost = _cost(read_bps=1e7, write_bps=1e7)
    pol = PredictiveOffload(chunk_tokens=256)
    idle = [IdleSession("gone", 128, 256, 600.0, p_return=0.01),
            IdleSession("back", 128, 256, 60.0, p_return=0.9)]  # both leave (1000 -> 744)
    out = {d.session: d.tier for d in pol.decide(idle, 1000, 1000, cost, ["cpu"], {"cpu": 1e12},
                                                  force=True, weights=IDLE)}
    assert out == {"gone": None, "back": "cpu"}
    legacy = pol.decide(idle, 1000, 1000, cost, ["cpu"], {"cpu": 1e12}, force=True)
    assert {d.tier for d in legacy} == {"cpu"}  # without weights: the plain test


def test_waiting_for_a_copy_to_land_pays_only_for_a_likely_return():
    cost = _cost(read_bps=1e7)  # a restore saves 0.23 s
    likely = IdleSession("s", 256, 256, 60.0, p_return=0.9)
    unlikely = IdleSession("s", 256, 256, 60.0, p_return=0.01)
    assert landing_pays(cost, "cpu", likely, IDLE, remaining_s=0.1)
    assert not landing_pays(cost, "cpu", unlikely, IDLE, remaining_s=0.1)
    assert not landing_pays(cost, "cpu", likely, IDLE, remaining_s=0.5)


def test_prestage_fills_empty_space_longest_away_first():
    cost = _cost(read_bps=1e7, write_bps=1e7)
    pol = PredictiveOffload(chunk_tokens=256)
    idle = [IdleSession("soon", 256, 256, 10.0), IdleSession("later", 256, 256, 900.0)]
    room = {"cpu": 256 * 1000}  # one session fits
    out = [(d.session, d.tier) for d in pol.prestage(idle, cost, ["cpu"], room, IDLE)]
    assert out == [("later", "cpu"), ("soon", None)]


def test_a_copy_displaces_a_full_tiers_victim_only_when_it_is_worth_more():
    cost = _cost(read_bps=1e7, write_bps=1e7)  # a copy saves 0.23 s when reused
    likely = IdleSession("new", 256, 256, 10.0, p_return=0.9)
    stale = IdleSession("old", 256, 256, 3600.0, p_return=0.1)
    assert copy_value(cost, "cpu", likely, IDLE) == pytest.approx(0.9 * (0.256 - 0.0256))
    assert displace_pays(cost, "cpu", likely, stale, IDLE)
    assert not displace_pays(cost, "cpu", stale, likely, IDLE)
    assert not displace_pays(cost, "cpu", likely, likely, IDLE)  # no gain: keep what is there
    busy = LoadWeights(links={"cpu": 20.0})  # the write's 0.0256 s cost others 0.49 s
    assert not displace_pays(cost, "cpu", likely, stale, busy)


# -------------------------------------------------------------- restore plans
def _chunks(n: int = 4) -> list[StoredChunk]:
    return [StoredChunk(256, "cpu")] * n


def test_idle_weights_give_the_plain_lowest_ttft_plan():
    cost = _cost(read_bps=1e7)
    a = plan_restore(cost, _chunks(), 1100)
    b = plan_restore(cost, _chunks(), 1100, load_weights=IDLE)
    assert a == b and a.load_chunks == 4


def test_a_queued_link_or_a_busy_one_tips_the_plan_to_recompute():
    cost = _cost(read_bps=3e6)  # a chunk loads in 0.085 s, recomputes in 0.256 s
    assert plan_restore(cost, _chunks(), 1100).load_chunks == 4
    queued = LoadWeights(link_wait_s={"cpu": 5.0})
    assert plan_restore(cost, _chunks(), 1100, load_weights=queued).load_chunks == 0
    busy = LoadWeights(links={"cpu": 20.0})  # each second of load costs others 19
    assert plan_restore(cost, _chunks(), 1100, load_weights=busy).load_chunks == 0
    slack = LoadWeights(link_wait_s={"cpu": -5.0})  # no queue: a negative wait is none
    assert plan_restore(cost, _chunks(), 1100, load_weights=slack).load_chunks == 4


# ------------------------------------------------------------------ victims
def test_victim_reuse_counts_each_victim_asked_for_again_once():
    v = VictimReuse(capacity=100)
    assert v.rate() == 0.5  # the prior
    v.let_go(["a", "b", "c", "d"])
    v.requested(["a", "a", "x"])  # "a" once; "x" was never a victim
    assert v.reused_total == 1 and v.let_go_total == 4
    v.let_go(["a"])  # a victim again: a new bet
    v.requested(["a"])
    assert v.reused_total == 2 and v.let_go_total == 5


def test_a_victim_not_asked_for_yet_is_not_counted_as_never_reused():
    """Two victims in five are asked for again 500 to 1,500 victims after they left: the
    rate is that share, not the share asked for so far (which counts the young as misses)."""
    v, rng, due = VictimReuse(capacity=4096), random.Random(0), {}
    for i in range(6000):
        v.let_go([i])
        if i % 5 < 2:
            due.setdefault(i + rng.randint(500, 1500), []).append(i)
        v.requested(due.pop(i, []))
    assert v.reused_total / v.let_go_total < 0.34  # what counting the young as misses says
    assert v.rate() == pytest.approx(0.4, abs=0.02)
    for i in range(6000, 9000):  # from now on nobody asks for anything again
        v.let_go([i])
    assert v.rate() < 0.3  # the victims that aged past 1,500 unasked pull it down


def test_victims_aging_out_of_the_list_count_as_never_reused():
    v = VictimReuse(capacity=100)
    for i in range(2000):
        v.let_go([i])
        if i >= 10 and i % 4 == 0:
            v.requested([i - 10])  # one in four, ten victims later; the rest age out
    assert v.rate() == pytest.approx(0.25, abs=0.02)


def test_turnover_is_victims_per_block_requested():
    v = VictimReuse()
    assert v.turnover() == 1.0  # nothing seen: assume the pool lets everything go
    v.requested(range(10))
    v.let_go([1, 2])
    assert v.turnover() == pytest.approx(0.2)


def test_victims_are_remembered_only_as_long_as_the_tiers_could_hold_them():
    v = VictimReuse(capacity=2)
    v.let_go(["a", "b", "c"])  # "a" ages out
    v.requested(["a", "b", "c"])
    assert v.reused_total == 2
    with pytest.raises(InvalidArgumentError):
        VictimReuse(capacity=0)


def test_the_live_policy_bets_on_what_its_victims_show():
    """A session's own return, or any request wanting what the pool let go: whichever is
    likelier; a workload that asks for nothing again drives the bet toward zero."""
    now = [0.0]
    live = LivePolicy(_cost(), ["cpu"], 256, clock=lambda: now[0])
    for i in range(200):  # sessions that never come back, whose blocks nobody asks for
        live.turn_started(i)
        live.turn_ended(i)
        live.left_pool(i, [("own", i)])
        live.requested([("new", i)])
    now[0] = 1000.0
    quiet = live.p_return(0)
    assert quiet < 0.05 and live.victims.rate() < 0.01
    for i in range(200):  # now every victim is asked for again by someone else
        live.left_pool(1000 + i, [("shared", i)])
        live.requested([("shared", i)])
    assert live.p_return(0) > 0.4 and not math.isclose(live.p_return(0), quiet)
