"""kvtier's write-or-drop decisions in the simulator, under the load the simulated node is
under: which tier a GPU victim goes to (or none), whether a turn waits for a copy still in
flight, where a chunk just computed is stored. The decisions are the live policy's
(:mod:`kvtier.policies.offload` through the simulator's
:class:`~kvtier.policies.live.LivePolicy`); this module only reads the simulated state:
each chunk's owner and place, the links' queues, the tiers' next victims."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace
from typing import TYPE_CHECKING

from kvtier.policies.eviction import ChunkInfo
from kvtier.policies.load import LoadWeights
from kvtier.policies.offload import (
    IdleSession,
    displace_pays,
    landing_pays,
    worth_storing,
    write_pays,
)
from kvtier.policies.victim_reuse import VictimReuse

if TYPE_CHECKING:
    from kvtier.benchmarks.policy_sim.node import Store
    from kvtier.benchmarks.policy_sim.simulator import Simulator


class WriteDecisions:
    def __init__(self, sim: Simulator, tier_bytes: float) -> None:
        """``tier_bytes``: what the node's lower tiers hold together (victims are watched
        as long as the tiers could keep their copies)."""
        self.sim = sim
        sim.live.load.links = {t: link.busy for t, link in sim.links.items()}
        sim.live.load.write_links = {t: link.writes.busy for t, link in sim.links.items()
                                     if link.writes is not None}
        chunk_bytes = sim.w.chunk_tokens * sim.bpt
        sim.live.victims = VictimReuse(max(1, int(tier_bytes // chunk_bytes)))

    def weights(self, now: float, waiting_until: float | None = None) -> LoadWeights:
        """The load now, as the policy weighs it: the server's and links' busy shares and
        what each link has queued ahead of a read and of a write (``waiting_until``: a
        write on a turn's admission path, which waits till then anyway, so only what is
        queued beyond that delays it further, and a path that frees earlier leaves it
        slack)."""
        links = self.sim.links
        reads = {t: link.wait_s(now) for t, link in links.items()}
        if waiting_until is None:  # a background write: behind everything queued
            writes = {t: max(link.write_path.idle_at - now, 0.0) for t, link in links.items()}
        else:
            after = max(now, waiting_until)  # negative: the path frees before the turn can start
            writes = {t: max(link.write_path.free_at, now) - after for t, link in links.items()}
        return self.sim.live.weights(now, reads, writes)

    def victim(self, key: Hashable, tokens: int, now: float) -> IdleSession:
        """A chunk as the offload policy weighs it: its owner's chance of coming back
        (about certain for a chunk sessions share), its place in the conversation."""
        sim = self.sim
        owner = sim._owner.get(key)
        info = sim.infos.of(key, tokens * sim.bpt)
        context = info.index * sim.w.chunk_tokens
        s = sim.live.idle_session(owner, tokens, tokens, now, context)
        return replace(s, p_return=1.0) if key in sim._shared or owner is None else s

    def target(self, key: Hashable, tokens: int, now: float,
               waiting_until: float | None = None) -> int | None:
        """The tier a GPU victim goes to (None: dropped), by the offload policy under the
        load now; ``waiting_until``: the write is on a turn's admission path, which waits
        till then already. Tiers make room by evicting."""
        sim = self.sim
        names = [t.name for t in sim.tiers]
        room = {t.name: t.capacity for t in sim.tiers}
        choice = sim.offload.target_tier(self.victim(key, tokens, now), sim.cost, names, room,
                                         self.weights(now, waiting_until),
                                         blocking=waiting_until is not None)
        return None if choice is None else names.index(choice)

    def raise_copy(self, key: Hashable, tokens: int, where: Store, now: float,
                   waiting_until: float | None = None) -> float | None:
        """A GPU victim whose only copy is on a slower tier than the offload policy picks
        for it now is written to that faster tier too (a restore from there beats one
        from where it lies); returns when the write is done, None if it wrote nothing."""
        sim = self.sim
        if not sim.live.raises_copies():
            return None
        target = self.target(key, tokens, now, waiting_until)
        if target is None or target >= sim.tiers.index(where):
            return None
        sim.count(sim.res.decisions, f"raise_{sim.tiers[target].name}")
        info = sim.infos.of(key, tokens * sim.bpt)
        return sim.write(target, key, tokens, info, now, background=waiting_until is None)

    def abandons(self, key: Hashable, tokens: int, where: Store | None, now: float,
                 remaining_s: float) -> bool:
        """A turn would wait ``remaining_s`` for this victim's copy to land: kvtier drops
        the copy unfinished (never read) when the wait costs more than the copy is worth
        (:func:`landing_pays`); True if it did."""
        sim = self.sim
        if not sim.spec.predictive or where is None:
            return False
        s = self.victim(key, tokens, now)
        if landing_pays(sim.cost, where.name, s, self.weights(now), remaining_s, sim.w.chunk_tokens):
            return False
        sim.count(sim.res.decisions, "abandon_copy")
        where.remove(key)
        return True

    def waits_for(self, key: Hashable, tokens: int, where: Store | None, now: float,
                  landing: float, done: float, blocking: bool) -> bool:
        """Whether a victim's blocks wait for its copy still in flight (landing then; the
        turn waits till ``done`` anyway): always off the admission path; on it, unless the
        copy is worth less than the wait (then dropped unfinished, :meth:`abandons`)."""
        return not (blocking and landing > done and self.abandons(key, tokens, where, now, landing - done))

    def store_computed(self, key: Hashable, tokens: int, info: ChunkInfo, now: float) -> None:
        """kvtier stores a chunk it just computed, off the admission path, in the first
        tier where that pays under the load now: into empty space when the write pays
        (:func:`write_pays`), into the first tier when full if the copy is worth more than
        its next victim's (:func:`displace_pays`); lower tiers fill by demotion."""
        sim = self.sim
        s = self.victim(key, tokens, now)
        w = self.weights(now)
        for ti, st in enumerate(sim.tiers):
            if not worth_storing(sim.cost, st.name, tokens, sim.w.chunk_tokens):
                continue
            if st.used + sim.cost.stored_bytes(st.name, tokens) <= st.capacity:
                pays = write_pays(sim.cost, st.name, s, w, False, sim.w.chunk_tokens)
            elif ti == 0:
                pays = self._displaces(st, s, w, now)
            else:
                continue
            if pays:
                sim.count(sim.res.decisions, f"store_{st.name}")
                sim.write(ti, key, tokens, info, now)
                return

    def _displaces(self, st: Store, s: IdleSession, w: LoadWeights, now: float) -> bool:
        """Whether a copy of ``s`` is worth more than the full tier's next victim's. The
        copy matters only if the GPU lets the chunk go at all (the pool's measured
        turnover); the victim's is needed now (its chunk has left)."""
        sim = self.sim
        v = st.index.victim(frozenset(), now)
        if v is None or v not in sim.infos:
            return False
        vs = self.victim(v, sim.cost.tokens_in(st.name, st.size(v)), now)
        leaves = sim.live.victims.turnover()
        return displace_pays(sim.cost, st.name, replace(s, p_return=s.p_return * leaves), vs, w,
                             sim.w.chunk_tokens)
