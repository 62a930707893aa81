"""Eviction, think-time and offload decisions on hand-computable cases, and policies by name."""

from __future__ import annotations

import pytest

from kvtier.errors import InvalidArgumentError
from kvtier.policies.cost_model import CostModel, LinearCost, PrefillCost, TierCost
from kvtier.policies.eviction import (
    ARC,
    LFU,
    LRU,
    SLRU,
    ChunkInfo,
    CostAware,
    SessionAware,
    make_eviction,
)
from kvtier.policies.live import LivePolicy
from kvtier.policies.offload import IdleSession, PredictiveOffload, Watermarks
from kvtier.policies.registry import names, resolve
from kvtier.policies.think_time import ThinkTimeModel

INFO = ChunkInfo(nbytes=100)


def _fill(policy, keys, now=0.0):
    for i, k in enumerate(keys):
        policy.insert(k, INFO, now + i)
    return policy


def test_policies_by_name_and_by_dotted_path():
    assert {"lru", "slru", "lfu", "arc", "cost-aware", "session-aware"} <= set(names("eviction"))
    assert isinstance(make_eviction("arc"), ARC)
    assert resolve("eviction", "kvtier.policies.eviction:LRU") is LRU
    assert resolve("eviction", "kvtier.policies.eviction.LFU") is LFU
    with pytest.raises(InvalidArgumentError, match="unknown eviction policy 'mru'.*known: arc"):
        resolve("eviction", "mru")
    with pytest.raises(InvalidArgumentError, match="cannot import eviction policy"):
        resolve("eviction", "kvtier.policies.eviction:Nope")


def test_lru_evicts_the_least_recent_and_never_a_pinned_key():
    p = _fill(LRU(), "abc")
    p.access("a", 5)
    assert p.victim(6) == "b"
    assert p.victim(6, pinned={"b"}) == "c"
    assert p.victim(6, pinned={"a", "b", "c"}) is None


def test_slru_keeps_reused_keys_through_a_scan():
    p = _fill(SLRU(protected_fraction=0.5), "ab")
    p.access("a", 3)  # a is reused: protected
    _fill(p, "xyz", 10)  # a scan of cold keys
    assert [p.victim(20) for _ in range(1)] == ["b"]
    p.remove("b")
    assert p.victim(20) == "x"  # probation first; a survives
    assert "a" in p


def test_lfu_evicts_the_least_used_then_the_oldest():
    p = _fill(LFU(), "abc")
    p.access("a", 5)
    p.access("c", 6)
    assert p.victim(7) == "b"
    p.remove("b")
    assert p.victim(7) == "a"  # a and c used twice; a less recently


def test_arc_moves_towards_the_list_whose_ghosts_come_back():
    p = ARC(capacity_keys=2)
    _fill(p, "ab")
    p.access("a", 3)  # a -> T2
    assert p.victim(4) == "b"  # T1 is over its target p=0
    p.remove("b")  # b becomes a ghost in B1
    p.insert("b", INFO, 5)  # a ghost hit: T1 was too small, b goes to T2
    assert p.p >= 1 and "b" in p.t2


def test_cost_aware_keeps_expensive_chunks_and_ages_them():
    p = CostAware(half_life_s=10)
    p.insert("cheap", ChunkInfo(100, recompute_s=0.1), 0)
    p.insert("dear", ChunkInfo(100, recompute_s=1.0), 0)
    assert p.victim(0) == "cheap"
    p.access("cheap", 1000)  # the expensive one has not been read for 1000 s
    assert p.victim(1000) == "dear"


def test_session_aware_evicts_the_session_away_longest_tail_first():
    away = {"soon": 5.0, "hours": 7200.0}
    p = SessionAware(predictor=lambda s, now: away[s])
    for i in range(3):
        p.insert(("hours", i), ChunkInfo(100, session="hours", index=i), 0)
        p.insert(("soon", i), ChunkInfo(100, session="soon", index=i), 0)
    p.insert("system", ChunkInfo(100, session=None), 0)
    order = []
    while (v := p.victim(1)) is not None:
        order.append(v)
        p.remove(v)
    assert order[:3] == [("hours", 2), ("hours", 1), ("hours", 0)]
    assert order[3:6] == [("soon", 2), ("soon", 1), ("soon", 0)]
    assert order[6] == "system"  # shared chunks go last


def test_session_aware_ranks_again_when_a_session_joins_or_the_owner_says_so():
    away = {"a": 5.0, "b": 50.0}
    p = SessionAware(predictor=lambda s, now: away[s])
    for s in away:
        p.insert((s, 0), ChunkInfo(100, session=s, index=0), 0)
    assert p.victim(1) == ("b", 0)
    away["c"] = 500.0
    p.insert(("c", 0), ChunkInfo(100, session="c", index=0), 1)  # same instant
    assert p.victim(1) == ("c", 0)
    away["a"] = 5000.0  # the predictor changed its mind without the clock moving
    assert p.victim(1) == ("c", 0)
    p.invalidate()
    assert p.victim(1) == ("a", 0)


def test_scored_eviction_samples_well_past_the_exact_limit():
    p = CostAware(half_life_s=1e9)
    n = 2000
    for i in range(n):  # value i: the cheap keys are the ones to give up
        p.insert(i, ChunkInfo(1, recompute_s=float(i)), 0)
    pinned = {0, 1, 2}
    victims = []
    for _ in range(100):
        v = p.victim(0, pinned)
        victims.append(v)
        p.remove(v)
    assert not pinned & set(victims)
    # random sampling alone would average n / 2; the carried-over pool keeps it low
    assert sum(victims) / len(victims) < n / 10


def test_a_sampled_session_ranking_never_gives_up_a_kept_session_first():
    """Past ``sample_over`` sessions the ranking is sampled; a session ranked as kept
    (below 0: running, or next to leave the pool) goes only when no other session is
    left, however few the sample holds of the others."""
    ranks = {s: -1.0 for s in range(400)}
    ranks[400] = 0.5  # the one session free to go
    p = SessionAware(predictor=lambda s, now: ranks[s])
    for s in ranks:
        p.insert(("k", s), ChunkInfo(1, s, 0), 0.0)
    assert p.victim(0.0) == ("k", 400)
    p.remove(("k", 400))
    assert p.victim(1.0)[1] in ranks  # only kept ones left: one of them goes


def test_think_time_model_learns_each_user_and_the_population():
    m = ThinkTimeModel(prior_median_s=30)
    fresh = m.expected_remaining("new", 0)
    for _ in range(10):
        m.observe("quick", 3.0)
        m.observe("slow", 600.0)
    assert m.expected_remaining("quick", 0) < fresh < m.expected_remaining("slow", 0)
    # Idle far longer than it ever thinks: predicted to stay away longer still (ended?).
    assert m.expected_remaining("quick", 3600) > m.expected_remaining("quick", 1)
    assert 0.0 <= m.p_return_within("slow", 0, 60) < m.p_return_within("quick", 0, 60) <= 1.0


def _cost(**tiers):
    return CostModel("m", "test", 1000, 10, PrefillCost(0.0, 1e-3, 0.0), {
        n: TierCost(n, LinearCost(lat, bw), LinearCost(lat, bw)) for n, (lat, bw) in tiers.items()
    })


def test_offload_waits_for_the_high_watermark_then_frees_longest_away_first():
    pol = PredictiveOffload(Watermarks(high=0.9, low=0.5))
    cost = _cost(cpu=(0.0, 1e9), disk=(0.001, 1e8))
    idle = [IdleSession("back-soon", 200, 200, 10.0), IdleSession("gone", 300, 300, 7200.0),
            IdleSession("lunch", 200, 200, 1800.0)]
    room = {"cpu": 1e9, "disk": 1e9}
    assert pol.decide(idle, 850, 1000, cost, ["cpu", "disk"], room) == []
    out = pol.decide(idle, 950, 1000, cost, ["cpu", "disk"], room)
    assert [d.session for d in out] == ["gone", "lunch"]  # 950 - 300 - 200 = 450 <= 500
    assert [d.tier for d in out] == ["cpu", "cpu"]  # the fastest tier that pays
    # room is used up as sessions are placed: the second goes one tier down
    kv = cost.kv_bytes_per_token
    out = pol.decide(idle, 950, 1000, cost, ["cpu", "disk"], {"cpu": 300 * kv, "disk": 1e9})
    assert [d.tier for d in out] == ["cpu", "disk"]


def test_stage_ahead_stores_the_next_victims_as_far_as_making_room_reaches():
    """Used 950 of 1000 (low watermark 0.5): making room would free 450 tokens, so the
    first sessions in eviction order up to 450 tokens are stored now; those stored already
    are passed over but count, those past the reach are left alone."""
    pol = PredictiveOffload(Watermarks(high=0.9, low=0.5))
    cost = _cost(cpu=(0.0, 1e9))
    order = [(IdleSession("a", 200, 200, 7200.0), False), (IdleSession("b", 200, 200, 3600.0), True),
             (IdleSession("c", 100, 100, 600.0), False), (IdleSession("d", 100, 100, 60.0), False)]
    room = {"cpu": 1e12, "disk": 1e12}  # callers pass capacities: a full tier demotes its own victims
    out = pol.stage_ahead(order, 950, 1000, cost, ["cpu"], room)
    assert [(d.session, d.tier) for d in out] == [("a", "cpu"), ("c", "cpu")]
    assert pol.stage_ahead(order, 850, 1000, cost, ["cpu"], room) == []  # below the high watermark
    unmeasured = pol.stage_ahead(order, 950, 1000, None, ["disk", "cpu"], room)
    assert [(d.session, d.tier) for d in unmeasured] == [("a", "disk"), ("c", "disk")]  # the first tier
    slow = _cost(cpu=(5.0, 1e3))  # a tier slower than recompute is never written ahead
    assert pol.stage_ahead(order, 950, 1000, slow, ["cpu"], room) == []


def test_leaving_next_is_the_reach_of_making_room_and_the_live_tiers_keep_those_copies():
    """Used 950 of 1000, low watermark 0.5: the first sessions in eviction order up to
    450 tokens. The live policy's tiers rank those as running (-1) until they leave or
    run again; others by their think-time rank."""
    pol = PredictiveOffload(Watermarks(high=0.9, low=0.5))
    order = [IdleSession("a", 200, 200, 0.0), IdleSession("b", 200, 200, 0.0),
             IdleSession("c", 100, 100, 0.0), IdleSession("d", 100, 100, 0.0)]
    assert [s.session for s in pol.leaving_next(order, 950, 1000)] == ["a", "b", "c"]
    assert list(pol.leaving_next(order, 900, 1000)) == []  # at the high watermark: no pressure
    now = [0.0]
    live = LivePolicy(_cost(cpu=(0.0, 1e9)), ["cpu"], 256,
                      Watermarks(high=0.9, low=0.5), clock=lambda: now[0])
    for sid in "abcd":
        live.turn_started(sid)
        live.turn_ended(sid)
        now[0] += 60.0
    idle = [("a", 200, 200, True), ("b", 200, 200, False), ("c", 100, 100, False), ("d", 100, 100, False)]
    staged = live.stage_ahead(idle, 950, 1000, {"cpu": 1e12})
    assert [d.session for d in staged] == ["b", "c"]  # "a" is stored already
    assert live.leaving == {"a", "b", "c"}
    assert [live.eviction_rank(s) for s in "abc"] == [-1.0] * 3
    assert live.eviction_rank("d") > 0
    live.left_pool("a")  # offloaded: its copy is now the only one, ranked by prediction
    live.turn_started("b")  # running again: out of the reach
    assert live.leaving == {"c"}
    assert live.eviction_rank("a") > live.eviction_rank("d") > 0


def test_offload_never_targets_a_tier_slower_than_recompute():
    pol = PredictiveOffload()
    slow = _cost(cpu=(5.0, 1e3))  # 5 s latency, 1 KB/s: recompute (1 ms/token) always wins
    out = pol.decide([IdleSession("s", 500, 500, 60.0)], 1000, 1000, slow, ["cpu"], {"cpu": 1e12})
    assert [(d.session, d.tier) for d in out] == [("s", None)]
    full = _cost(cpu=(0.0, 1e9))
    out = pol.decide([IdleSession("s", 500, 500, 60.0)], 1000, 1000, full, ["cpu"], {"cpu": 10})
    assert out[0].tier is None  # no room anywhere: dropped, not half-stored
    with pytest.raises(InvalidArgumentError, match="watermarks"):
        Watermarks(high=0.5, low=0.9)
