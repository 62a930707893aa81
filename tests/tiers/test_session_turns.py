"""A store's session-aware eviction with reported turns: the session least likely back
soon goes first (kvtier's think-time model), not the one whose chunks were touched longest
ago; a running turn keeps its session; each tenant's reports teach its own model; the
record is bounded; a turn never reported ended stops protecting its session."""

from __future__ import annotations

import math

import pytest

from kvtier.client import SessionTurn, TurnEvent
from kvtier.connectors.tiers.session_turns import RUNNING_LEASE_S, SessionTurns
from kvtier.errors import InvalidArgumentError
from kvtier.policies.eviction import ChunkInfo, SessionAware


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stored(policy: SessionAware, session: str, chunks: int, now: float) -> None:
    for i in range(chunks):
        policy.insert(f"{session}-{i}", ChunkInfo(1, session, i), now)


def live_turns(turns: SessionTurns, clock: Clock, session: str, gaps: list[float],
               tenant: str = "") -> None:
    """``session`` takes a turn after each of ``gaps`` (seconds); each turn lasts 1 s."""
    for gap in gaps:
        turns.report([SessionTurn(session, TurnEvent.STARTED)], tenant)
        clock.now += 1.0
        turns.report([SessionTurn(session, TurnEvent.ENDED)], tenant)
        clock.now += gap


def test_the_session_past_its_habit_goes_before_the_one_idle_longer():
    """Both ended their last turn: "steady" thinks about 60 s and is idle 50 s (it is
    likely back soon), "quick" thinks about 2 s and is idle 40 s, twenty times its habit
    (it is likely gone). Idle time alone evicts "steady"; the reports evict "quick"."""
    clock = Clock()
    reported, plain = SessionAware(), SessionAware()
    turns = SessionTurns([reported], clock)
    assert reported.predictor is not None and plain.predictor is None
    live_turns(turns, clock, "steady", [60.0] * 8)
    live_turns(turns, clock, "quick", [2.0] * 8)
    turns.report([SessionTurn("steady", TurnEvent.STARTED, ago_s=1.0),
                  SessionTurn("steady", TurnEvent.ENDED)])
    for policy in (reported, plain):
        stored(policy, "steady", 3, clock.now)
    clock.now += 10.0
    turns.report([SessionTurn("quick", TurnEvent.STARTED, ago_s=1.0),
                  SessionTurn("quick", TurnEvent.ENDED)])
    for policy in (reported, plain):
        stored(policy, "quick", 3, clock.now)
    clock.now += 40.0
    assert plain.victim(clock.now) == "steady-2"
    assert reported.victim(clock.now) == "quick-2"  # its tail first
    assert turns.reported == 2 * 16 + 4


def test_a_running_turn_keeps_its_session_until_its_lease_runs_out():
    clock = Clock()
    policy = SessionAware()
    turns = SessionTurns([policy], clock)
    stored(policy, "running", 2, clock.now)
    clock.now += 10.0
    stored(policy, "done", 2, clock.now)
    turns.report([SessionTurn("running", TurnEvent.STARTED, ago_s=10.0),
                  SessionTurn("done", TurnEvent.STARTED, ago_s=1.0), SessionTurn("done", TurnEvent.ENDED)])
    clock.now += 5.0
    assert turns.rank(policy, "running", clock.now) == -1.0
    assert policy.victim(clock.now) == "done-1"  # idle time alone would take "running"'s
    clock.now += RUNNING_LEASE_S  # its engine never said it ended: it protects no longer
    assert turns.rank(policy, "running", clock.now) >= 0.0


def test_a_tenants_reports_move_no_other_tenants_ranks():
    clock = Clock()
    policy = SessionAware()
    turns = SessionTurns([policy], clock)
    stored(policy, "b:s", 1, clock.now)
    turns.report([SessionTurn("b:s", TurnEvent.STARTED, ago_s=2.0), SessionTurn("b:s", TurnEvent.ENDED)], "b")
    clock.now += 20.0
    before = turns.rank(policy, "b:s", clock.now)
    live_turns(turns, clock, "a:x", [5000.0] * 30, tenant="a")  # tenant a: very long think times
    clock.now -= 30 * 5001.0  # same instant again
    assert turns.rank(policy, "b:s", clock.now) == pytest.approx(before)
    assert 0.0 <= before <= 1.0


def test_a_session_that_never_reported_is_ranked_by_its_idle_time():
    clock = Clock()
    policy = SessionAware()
    turns = SessionTurns([policy], clock)
    stored(policy, "old", 1, clock.now)
    clock.now += 600.0
    stored(policy, "new", 1, clock.now)
    clock.now += 1.0
    assert turns.rank(policy, "old", clock.now) > turns.rank(policy, "new", clock.now)
    assert policy.victim(clock.now) == "old-0"


def test_the_record_of_reported_sessions_is_bounded():
    clock = Clock()
    policy = SessionAware()
    turns = SessionTurns([policy], clock, max_sessions=3)
    turns.report([SessionTurn("s0", TurnEvent.STARTED)])
    assert turns.rank(policy, "s0", clock.now) == -1.0
    turns.report([SessionTurn(f"s{i}", TurnEvent.STARTED) for i in range(1, 4)])
    assert turns.rank(policy, "s0", clock.now) >= 0.0  # forgotten: no longer kept as running
    assert all(turns.rank(policy, f"s{i}", clock.now) == -1.0 for i in range(1, 4))


def test_a_session_aware_tier_with_its_own_predictor_is_left_to_it():
    policy = SessionAware(predictor=lambda session, now: 0.5)
    SessionTurns([policy])
    assert policy.predictor(None, 0.0) == 0.5


@pytest.mark.parametrize("ago", [-1.0, math.nan])
def test_a_turn_before_nothing_is_refused(ago):
    with pytest.raises(InvalidArgumentError, match="ago_s"):
        SessionTurn("s", TurnEvent.ENDED, ago)
