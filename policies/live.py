"""The live policy state: what the engine and the simulator know of sessions, and how
they rank them.

The simulator (``kvtier bench policies``) and the engine both hold a :class:`LivePolicy`
(the simulator with its virtual clock, passing event times in) and decide with the same
functions:
``plan_restore`` picks how much of a resuming session's stored prefix to load, the
think-time model learns when users come back, and ``PredictiveOffload`` picks which idle
sessions leave the pool under memory pressure and how far down they go. This module keeps
the live state those decisions need (when each session went idle, the cost model refined
from observed transfers, counts of decisions by kind) and nothing else: the engine moves
the bytes.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from kvtier.policies.cost_model import CostModel
from kvtier.policies.load import LoadMeter, LoadWeights
from kvtier.policies.offload import (
    IdleSession,
    OffloadDecision,
    PredictiveOffload,
    Watermarks,
    worth_storing,
)
from kvtier.policies.restore import StoredChunk, plan_restore
from kvtier.policies.think_time import ThinkTimeModel
from kvtier.policies.victim_reuse import VictimReuse

log = logging.getLogger(__name__)

PROFILE_NAME = "kvtier-profile.json"
"""Where ``kvtier calibrate --model DIR`` writes by default, and where an engine looks."""


class LivePolicy:
    def __init__(
        self,
        cost: CostModel | None,
        tier_names: Sequence[str],
        chunk_tokens: int,
        watermarks: Watermarks | None = None,
        check_every_s: float = 0.05,
        auto_offload: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``watermarks``: pool occupancy that starts offloading (high) and where it stops
        (low); ``check_every_s``: least time between two watermark checks (each walks the
        idle sessions); ``auto_offload``: offload at all under pressure; ``clock``: the
        time source (a replay passes its virtual clock)."""
        self.watermarks = watermarks or Watermarks()
        self.check_every_s = check_every_s
        self.auto_offload = auto_offload
        self.cost = cost
        self.tier_names = list(tier_names)
        self.chunk_tokens = chunk_tokens
        self.clock = clock
        self.think = ThinkTimeModel()
        self.offload = PredictiveOffload(self.watermarks, chunk_tokens)
        self.idle_since: dict[Hashable, float] = {}
        """When each idle session's last turn ended (a replay may record a time ahead of
        its clock: the session runs until then)."""
        self._memo: dict[Hashable, tuple[float, float, int, tuple[float, float]]] = {}
        self.decisions: Counter[str] = Counter()
        self.leaving: set[Hashable] = set()
        """Idle sessions the pool lets go next (stage-ahead's reach): the tiers keep their
        copies, which let their blocks go with no write on the admission path."""
        self._next_check = -float("inf")
        self.load = LoadMeter(duplex=[] if cost is None else
                              [n for n, t in cost.tiers.items() if t.duplex])
        """How busy the GPU and the tiers' links have been (what the engine's steps and
        transfers, or the simulator's events, report): what makes decisions load-aware."""
        self.victims = VictimReuse()
        """Of the blocks the pool let go, the share asked for again (the engine's
        scheduler and offloads, or the simulator, feed it): how likely a victim is wanted,
        whoever asks (a prefix shared across sessions comes back though its session
        does not; a session's return may want none of its blocks)."""

    # ---------------------------------------------------------------- sessions
    def turn_started(self, session: Hashable, now: float | None = None) -> None:
        """A turn arrived: the gap since the last one ended teaches the think-time model."""
        since = self.idle_since.pop(session, None)
        self.leaving.discard(session)
        if since is not None:
            now = self.clock() if now is None else now
            self.think.observe(session, max(now - since, 0.0))

    def turn_ended(self, session: Hashable, at: float | None = None) -> None:
        """The session's turn is over (``at``: when, if not now)."""
        self.idle_since[session] = self.clock() if at is None else at
        self.think.turn_ended(session)

    def left_pool(self, session: Hashable, blocks: Iterable[Hashable] = ()) -> None:
        """Its blocks are gone: what the tiers hold of it is ranked like any other copy,
        and whether ``blocks`` (their keys) are asked for again is watched."""
        self.leaving.discard(session)
        self.victims.let_go(blocks)

    def requested(self, blocks: Iterable[Hashable]) -> None:
        """A request asks for these blocks (a prompt's full blocks, by key)."""
        self.victims.requested(blocks)

    def forget(self, session: Hashable) -> None:
        self.leaving.discard(session)
        self.idle_since.pop(session, None)
        self._memo.pop(session, None)
        self.think.forget(session)

    def set_leaving(self, sessions: set[Hashable]) -> None:
        """The idle sessions the pool lets go next (stage-ahead's reach; empty below the
        high watermark): the tiers keep their copies until they leave or run."""
        self.leaving = sessions

    def prediction(self, session: Hashable, now: float | None = None) -> tuple[float, float] | None:
        """(eviction rank, expected seconds to the next turn) of an idle session, None
        while it runs. Memoised until its idle time grows 5 % or the population's
        think-time estimate has taken 1 % more gaps: predictions move slowly, and a
        session-aware eviction asks for them per resident session at every victim."""
        since = self.idle_since.get(session)
        now = self.clock() if now is None else now
        if since is None or since > now:
            return None
        idle = now - since
        seen = self.think.population.n
        m = self._memo.get(session)
        fresh = m is not None and m[0] == since and m[1] <= idle <= m[1] * 1.05 + 1e-3
        if fresh and seen <= m[2] * 1.01 + 1:  # never one made for a longer idle time
            return m[3]  # type: ignore[index]
        out = (self.think.eviction_rank(session, idle), self.think.expected_next_s(session, idle))
        self._memo[session] = (since, idle, seen, out)
        return out

    def p_return(self, session: Hashable, now: float | None = None) -> float:
        """Chance that an idle session's KV is asked for again: its own return (the
        think-time model) or, measured over the pool's victims, any request wanting a
        block it let go. A session still running (or unknown) has not started its wait:
        the chance any session comes back after a turn."""
        since = self.idle_since.get(session)
        now = self.clock() if now is None else now
        idle = 0.0 if since is None or since > now else now - since
        return max(self.think.p_alive(session, idle), self.victims.rate())

    def idle_session(self, session: Hashable, gpu_tokens: int, prefix_tokens: int,
                     now: float | None = None, context_tokens: int = 0) -> IdleSession:
        """What the offload policy weighs of an idle session (its predictions included)."""
        return IdleSession(session, gpu_tokens, prefix_tokens, self.predicted_next_s(session, now),
                           self.p_return(session, now), context_tokens)

    def weights(self, now: float | None = None,
                link_wait_s: Mapping[str, float] | None = None,
                write_wait_s: Mapping[str, float] | None = None) -> LoadWeights:
        """What a second of the GPU's and each link's time costs now (``link_wait_s``: the
        transfers each link has queued ahead of a read, ``write_wait_s`` ahead of a write,
        where the caller knows them)."""
        return self.load.weights(self.clock() if now is None else now, link_wait_s, write_wait_s)

    def session_rank(self, session: Hashable, now: float | None = None) -> float:
        """Higher = let the session's KV go sooner; running sessions rank -1 (kept)."""
        p = self.prediction(session, now)
        return -1.0 if p is None else p[0]

    def eviction_rank(self, session: Hashable, now: float | None = None) -> float:
        """For a tier's session-aware eviction: :meth:`session_rank`, except that the
        copies of the sessions the pool lets go next are kept as a running one's (they
        are what lets those blocks go with no write on the admission path)."""
        if session in self.leaving:
            return -1.0
        return self.session_rank(session, now)

    def raises_copies(self) -> bool:
        """Whether a session leaving the pool is written to the tier picked for it though
        a slower tier holds it already: when sessions mostly come back (conversations),
        a copy where a restore is fastest pays; when they mostly do not (one-shot requests
        sharing prefixes), it only adds writes that reads then queue behind. Decided on
        what was seen (20 finished turns at least), not on the prior alone."""
        return self.think.turns_ended >= 20 and self.think.p_continue() >= 0.5

    def predicted_next_s(self, session: Hashable, now: float | None = None) -> float:
        """Expected seconds until the session's next turn (0 while it runs)."""
        p = self.prediction(session, now)
        return 0.0 if p is None else p[1]

    # ---------------------------------------------------------------- demotion
    def demotion_target(self, index: int, nbytes: int, in_pool: bool = False) -> int | None:
        """Where a chunk that tier ``index`` (of ``tier_names``) lets go goes: the next
        tier down, when there is one and, with measured costs, loading it back from there
        beats recomputing it (:func:`worth_storing`); None: it is dropped. The engine's
        tier manager and the simulator's cascade both ask this. A copy of a chunk the
        pool still holds (``in_pool``) is dropped: the pool writes it back where the
        policy says when it lets it go, and demoting it now would tie those blocks to a
        write on a slower tier."""
        if in_pool:
            return None
        below = index + 1
        if below >= len(self.tier_names):
            return None
        name = self.tier_names[below]
        if self.cost is None or name not in self.cost.tiers:
            return below  # nothing measured: demote
        upper = self.tier_names[index]
        tokens = (self.cost.tokens_in(upper, nbytes) if upper in self.cost.tiers
                  else max(1, nbytes // max(self.cost.kv_bytes_per_token, 1)))
        return below if worth_storing(self.cost, name, tokens, self.chunk_tokens) else None

    # ----------------------------------------------------------------- restore
    def plan_load(
        self, chunks: Sequence[tuple[int, str]], prompt_tokens: int, cached_tokens: int,
        link_wait_s: Mapping[str, float] | None = None,
    ) -> int:
        """How many of the stored chunks (tokens, tier name), in order after what the pool
        holds, to load; the rest of the prompt is recomputed (under the load now,
        :func:`plan_restore`). Without a cost model: all."""
        if self.cost is None or not chunks:
            return len(chunks)
        known = [StoredChunk(n, t) for n, t in chunks if t in self.cost.tiers]
        if len(known) < len(chunks):
            # A tier the profile has not measured: load up to it, decide nothing about it.
            first_unknown = next(i for i, (_, t) in enumerate(chunks) if t not in self.cost.tiers)
            known = known[:first_unknown]
        plan = plan_restore(self.cost, known, prompt_tokens, cached_tokens,
                            load_weights=self.weights(link_wait_s=link_wait_s))
        self.decisions["restore_recompute" if plan.recompute_all else "restore_load"] += 1
        return plan.load_chunks

    def observe_compute(self, seconds: float, end: float | None = None) -> None:
        """The model ran for ``seconds`` (a step), ending ``end`` (default now)."""
        end = self.clock() if end is None else end
        self.load.observe_compute(end - seconds, seconds)

    def observe_transfer(self, tier: str, seconds: float, end: float | None = None,
                         write: bool = False) -> None:
        """A tier's link carried a read or (``write``) a write for ``seconds``, ending
        ``end``."""
        end = self.clock() if end is None else end
        self.load.observe_link(tier, end - seconds, seconds, write)

    def observe_read(self, tier: str, nbytes: int, seconds: float) -> None:
        """Refine a tier's read bandwidth from a restore that was timed end to end (and
        count the link busy for it)."""
        self.observe_transfer(tier, seconds)
        if self.cost is None or tier not in self.cost.tiers or nbytes <= 0:
            return
        tiers = dict(self.cost.tiers)
        tiers[tier] = tiers[tier].observe_read(nbytes, seconds)
        self.cost = replace(self.cost, tiers=tiers)

    # ----------------------------------------------------------------- offload
    def due(self) -> bool:
        """Rate limit for :meth:`offloads` (a check walks every idle session)."""
        now = self.clock()
        if now < self._next_check:
            return False
        self._next_check = now + self.check_every_s
        return self.auto_offload

    def offloads(
        self,
        idle: Sequence[tuple[Hashable, int, int]],
        used_tokens: int,
        capacity_tokens: int,
        room_bytes: Mapping[str, float],
        force: bool = False,
        staged: bool = False,
    ) -> list[OffloadDecision]:
        """Idle sessions (id, tokens held in the pool, tokens a resume reuses) that should
        leave the pool now, and where to (``force``: down to the low watermark even below
        the high one, to admit a turn); ``room_bytes`` as in
        :meth:`PredictiveOffload.target_tier`; ``staged``: they are pre-staged (stored,
        kept in the pool), counted as such)."""
        sessions = [self.idle_session(s, g, p) for s, g, p in idle]
        if self.cost is None:
            # No measured costs: no "worth storing" test; the fastest tier with room.
            if not force and used_tokens <= self.offload.watermarks.high * max(capacity_tokens, 1):
                return []
            target = self.offload.watermarks.low * capacity_tokens
            out = []
            for s in sorted(sessions, key=lambda s: -s.predicted_next_s):
                if used_tokens <= target:
                    break
                out.append(OffloadDecision(s.session, self.tier_names[0] if self.tier_names else None))
                used_tokens -= s.gpu_tokens
        else:
            names = [t for t in self.tier_names if t in self.cost.tiers]
            out = self.offload.decide(
                sessions, used_tokens, capacity_tokens, self.cost, names, room_bytes, force,
                self.weights(),
            )
        for d in out:
            kind = "prestage" if staged else "offload"
            self.decisions[f"{kind}_{d.tier}" if d.tier else f"{kind}_drop"] += 1
        return out

    def prestage(
        self, idle: Sequence[tuple[Hashable, int, int]], empty_bytes: Mapping[str, float]
    ) -> list[OffloadDecision]:
        """Idle sessions (id, tokens held, tokens a resume reuses) not stored yet to store
        into the tiers' empty space now, whatever the pool's use, where the write pays
        under the load now (:meth:`PredictiveOffload.prestage`): as the simulator stores
        each computed chunk. Nothing without measured costs."""
        if self.cost is None:
            return []
        names = [t for t in self.tier_names if t in self.cost.tiers]
        out = self.offload.prestage([self.idle_session(s, g, p) for s, g, p in idle],
                                    self.cost, names, empty_bytes, self.weights())
        for d in out:
            if d.tier is not None:
                self.decisions[f"store_{d.tier}"] += 1
        return out

    def stage_ahead(
        self,
        idle: Sequence[tuple[Hashable, int, int, bool]],
        used_tokens: int,
        capacity_tokens: int,
        room_bytes: Mapping[str, float],
    ) -> list[OffloadDecision]:
        """Idle sessions (id, tokens held, tokens a resume reuses, stored already) to store
        now while they keep their blocks: the next ones :meth:`offloads` would let go to
        make room, so that a turn needing the room does not wait for their write
        (:meth:`PredictiveOffload.stage_ahead`; a full tier demotes its own victims).
        Without measured costs every such session goes to the fastest tier."""
        sessions = [(self.idle_session(s, g, p), done) for s, g, p, done in idle]
        order = sorted(sessions, key=lambda x: -x[0].predicted_next_s)  # decide()'s order
        reach = list(self.offload.leaving_next(order, used_tokens, capacity_tokens, lambda x: x[0].gpu_tokens))
        self.set_leaving({s.session for s, _ in reach})
        names = list(self.tier_names) if self.cost is None else [t for t in self.tier_names if t in self.cost.tiers]
        out = self.offload.stage_ahead(reach, used_tokens, capacity_tokens, self.cost, names,
                                       room_bytes, None if self.cost is None else self.weights())
        for d in out:
            self.decisions[f"stage_ahead_{d.tier}"] += 1
        return out


def load_cost_model(
    profile: str | Path | None, model_dir: Path, fingerprint: str, machine: str
) -> CostModel | None:
    """The engine's cost model: the given profile (an error if missing), else the model
    directory's default one if present; profiles of another model or machine are used with
    a logged warning (recalibrate to silence it)."""
    from kvtier.policies.profile import load_profile

    path = Path(profile) if profile is not None else model_dir / PROFILE_NAME
    if profile is None and not path.is_file():
        return None
    cost, warnings = load_profile(path, model_fingerprint=fingerprint, machine=machine)
    for w in warnings:
        log.warning("%s", w)
    return cost
