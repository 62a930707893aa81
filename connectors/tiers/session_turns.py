"""When the sessions whose chunks a store holds start and end their turns, as the engines
serving them report it, and what that predicts for eviction.

A store beside a serving engine (the vLLM connector's tiers, ``kvtier serve`` as a sidecar)
sees chunks, not conversations: without reports its session-aware tiers give up first the
session whose chunks were touched longest ago. With them, they rank by kvtier's think-time
model (:class:`~kvtier.policies.live.LivePolicy`, the one the engine and the policy
simulator rank by): the session least likely to come back within a typical think time goes
first; a regular user idle for less than they usually think keeps their KV over one idle
far past their habit, and a session whose turn is running is kept.

Each tenant's reports teach a model of that tenant's own (one tenant cannot skew how
another's sessions are ranked). A session with no reported turn (a client that reports
none) is ranked by the chance that it is over, given its chunks' idle time: a rank that
only grows with idle time, so such sessions go in the order they went before. A turn
reported started and never ended (its engine died) counts as running for at most
:data:`RUNNING_LEASE_S`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from functools import partial

from kvtier.client import SessionTurn, TurnEvent
from kvtier.policies.eviction import SessionAware
from kvtier.policies.live import LivePolicy

RUNNING_LEASE_S = 3600.0
"""How long a turn reported started counts as running without an end reported."""

MAX_SESSIONS = 100_000
"""Sessions whose turns are remembered; past it the least recently reported is forgotten
(ranked by its idle time again): reports from a client cannot grow the store's memory
without bound."""


class SessionTurns:
    """The store's record of reported turns, and the ranks its session-aware tiers evict
    by. Thread-safe: reports arrive on request threads, ranks are asked under a tier's
    lock (this lock is never held while a tier's is taken)."""

    def __init__(self, evictions: Iterable[object], clock: Callable[[], float] = time.monotonic,
                 max_sessions: int = MAX_SESSIONS) -> None:
        """``evictions``: the tiers' eviction policies (those session-aware and without a
        predictor of their own rank by this one's); ``clock``: theirs."""
        self.clock = clock
        self.max_sessions = max_sessions
        self._lock = threading.Lock()
        self._models: dict[str, LivePolicy] = {}
        """Per tenant: when its sessions' turns ended, and its think-time model."""
        self._fallback = self._model()
        """What ranks a session of a tenant that never reported (the prior)."""
        self._owner: OrderedDict[Hashable, str] = OrderedDict()
        """Reported sessions (least recently reported first) -> their tenant."""
        self._running: dict[Hashable, float] = {}
        """Sessions whose turn runs -> when it started."""
        self.reported = 0
        for policy in evictions:
            if isinstance(policy, SessionAware) and policy.predictor is None:
                policy.predictor = partial(self.rank, policy)

    def stats(self) -> dict[str, int]:
        """Turns reported, sessions remembered, turns running (a service's ``turns``)."""
        with self._lock:
            return {"reported": self.reported, "sessions": len(self._owner),
                    "running": len(self._running)}

    def _model(self) -> LivePolicy:
        return LivePolicy(None, [], chunk_tokens=1, clock=self.clock)

    def report(self, turns: Iterable[SessionTurn], tenant: str = "") -> None:
        """Take ``turns`` (in the order they happened) of ``tenant``'s sessions, whose names
        are as the tiers know them (a service prefixes its tenant's)."""
        now = self.clock()
        with self._lock:
            model = self._models.get(tenant)
            if model is None:
                model = self._models[tenant] = self._model()
            for turn in turns:
                at = now - turn.ago_s
                self._remember(turn.session, tenant)
                if turn.event is TurnEvent.STARTED:
                    model.turn_started(turn.session, at)
                    self._running[turn.session] = at
                else:
                    model.turn_ended(turn.session, at)
                    self._running.pop(turn.session, None)
                self.reported += 1

    def _remember(self, session: Hashable, tenant: str) -> None:
        owner = self._owner.get(session)
        if owner is not None and owner != tenant:
            self._models[owner].forget(session)
        self._owner[session] = tenant
        self._owner.move_to_end(session)
        while len(self._owner) > self.max_sessions:
            old, old_tenant = self._owner.popitem(last=False)
            self._models[old_tenant].forget(old)
            self._running.pop(old, None)

    def rank(self, policy: SessionAware, session: Hashable, now: float) -> float:
        """``policy``'s eviction rank of ``session`` (higher: evicted sooner; -1 while its
        turn runs). ``now``: the tier's clock, which must be this one's."""
        with self._lock:
            started = self._running.get(session)
            if started is not None and now - started < RUNNING_LEASE_S:
                return -1.0
            tenant = self._owner.get(session)
            model = self._fallback if tenant is None else self._models[tenant]
            if started is None and session in model.idle_since:
                return model.session_rank(session, now)
            # no turn known: the chance it is over, which only grows with its idle time
            # (so such sessions keep their idle-time order among themselves)
            return 1.0 - model.think.p_alive(session, policy.idle_s(session, now))
