"""Discrete-event replay of a multi-turn workload against one system on one serving node.

The node is modelled the way its costs were measured (a calibration profile): prefill is
one FIFO server (``prefill(cached, new)`` seconds per turn); each lower tier is one link
(``latency + bytes / bandwidth``; :class:`~kvtier.benchmarks.policy_sim.node.Link`: a
drive serves the transfers turns wait for ahead of background writes, a duplex medium
carries writes on a path of their own); a restore overlaps
loading with compute layer by layer, so a turn's first token comes at
``max(start + compute, load_end + compute / layers)``. Memory is counted in chunks: the GPU
holds a budget of KV bytes, every lower tier its capacity, and each evicts by the system's
policy. What is simulated is exactly what the policies decide; everything else (decode
batching, kernels) is folded into the measured costs.

The decisions and the bookkeeping are the live engine's own code, not a model of it: each
tier's contents are a :class:`~kvtier.connectors.tiers.chunk_index.ChunkIndex` (the CPU and
disk tiers' index, eviction included), sessions are ranked and predicted by a
:class:`~kvtier.policies.live.LivePolicy` on the simulation's clock, and a tier's victims
go down (or are dropped) by :meth:`LivePolicy.demotion_target`, as the engine's tier
manager does.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Hashable

from kvtier.benchmarks.policy_sim.node import (
    KeySet,
    KnownChunks,
    Landing,
    Link,
    SessionState,
    SimResult,
    Store,
    TurnTime,
)
from kvtier.benchmarks.policy_sim.staging import Stager
from kvtier.benchmarks.policy_sim.systems import SystemSpec
from kvtier.benchmarks.policy_sim.workloads import Turn, Workload
from kvtier.benchmarks.policy_sim.writes import WriteDecisions
from kvtier.policies.cost_model import CostModel
from kvtier.policies.eviction import (
    ChunkInfo,
    CostAware,
    EvictionPolicy,
    SessionAware,
    make_eviction,
)
from kvtier.policies.live import LivePolicy
from kvtier.policies.load import IDLE, LoadWeights
from kvtier.policies.offload import worth_storing
from kvtier.policies.restore import StoredChunk, plan_restore

__all__ = ["Link", "SessionState", "SimResult", "Simulator", "Store"]

_NO_PINS: frozenset = frozenset()


def tiers_pay(cost: CostModel, spec: SystemSpec, tier_bytes: dict[str, float],
              chunk_tokens: int) -> bool:
    """Loading a chunk back from the fastest tier beats recomputing it. Then the GPU's
    order only decides which sessions move down (and recency serves: the live engine's
    pool is an LRU too); what is lost is decided by the tiers' predictive eviction.
    When no tier pays, the GPU is the only cache that counts, and its victims are the
    sessions predicted back last."""
    names = [t for t in cost.tiers if spec.use_tiers and tier_bytes.get(t, 0) > 0]
    return bool(names) and worth_storing(cost, names[0], chunk_tokens, chunk_tokens)


def eviction_for(name: str, spec: SystemSpec, live: LivePolicy, gpu: bool, pay: bool
                 ) -> EvictionPolicy:
    """The eviction policy ``name`` of the GPU (``gpu``) or a tier, predicting with the
    live policy where the system is predictive (``pay``: see :func:`tiers_pay`)."""
    if spec.retention_value and name == "cost-aware":
        return CostAware(half_life_s=1.0)  # value ~ recompute cost / idle time
    pol = make_eviction(name)
    if isinstance(pol, SessionAware) and spec.predictive and (not gpu or not pay):
        pol.predictor = live.session_rank if gpu else live.eviction_rank
    return pol


def restore_plan(cost: CostModel, t: Turn, gpu_tokens: int, lower: list[tuple[int, Store]],
                 head_start: float = 0.0, load_weights: LoadWeights = IDLE) -> int:
    """kvtier's restore plan, as the live engine makes it: the number of stored chunks to
    load (0 = recompute); loads that start ``head_start`` seconds before the turn can
    compute are that much done; ``load_weights``: the load now."""
    chunks = [StoredChunk(t.tokens_of(i), st.name) for i, st in lower]
    return plan_restore(cost, chunks, t.prompt_tokens, gpu_tokens,
                        head_start_s=head_start, load_weights=load_weights).load_chunks


class Simulator:
    def __init__(
        self,
        workload: Workload,
        system: SystemSpec,
        cost: CostModel,
        gpu_bytes: float,
        tier_bytes: dict[str, float],
        timeline_points: int = 200,
        shared: dict[str, tuple[Store, Link]] | None = None,
    ) -> None:
        """``shared``: tiers this node shares with others (a cluster's Redis), by name:
        their contents and link are the same objects in every node (see ``cluster``)."""
        self.w, self.spec, self.cost = workload, system, cost
        self.bpt = cost.kv_bytes_per_token
        self.sessions: dict[Hashable, SessionState] = {}
        self._tier_bytes = tier_bytes
        names = [t for t in cost.tiers if system.use_tiers and tier_bytes.get(t, 0) > 0]
        self.live = LivePolicy(cost, names, workload.chunk_tokens, clock=lambda: 0.0)
        """The live engine's policy state, on the simulation's clock (every call passes
        the event's time): think times, predictions, ranks, the pool's next to leave."""
        self.offload = self.live.offload
        self._landing: dict[Hashable, Landing] = {}
        """GPU chunk -> when its copy written ahead is down (its blocks go only then)."""
        self.gpu = Store("gpu", gpu_bytes, self._policy(system.gpu_eviction, gpu=True))
        shared = shared or {}
        self.tiers = [shared[t][0] if t in shared else
                      Store(t, tier_bytes[t], self._policy(system.tier_eviction)) for t in names]
        self.links = {t: shared[t][1] if t in shared else Link.of(cost.tier(t)) for t in names}
        self.res = SimResult(system.name)
        self.through = system.write_through  # LMCache's store rule (adaptive: switched per turn)
        self._server_free = 0.0
        span = (workload.turns[-1].arrival_s - workload.turns[0].arrival_s) if workload.turns else 0
        self._sample_every = max(span / max(timeline_points, 1), 1e-9)
        self._next_sample = -math.inf
        self.pinned: set[Hashable] = set()
        self._shared: set[Hashable] = set()
        self._ends: list[tuple[float, Hashable]] = []
        self._owner: dict[Hashable, Hashable] = {}
        """Chunk -> the session that used it last."""
        self.by_session: dict[Hashable, KeySet] = {}
        """Session -> the chunks it owns that are in the GPU."""
        self.recent: OrderedDict[Hashable, None] = OrderedDict()
        """Sessions holding GPU chunks, least recently run first: the order in which
        kvtier's GPU lets idle sessions go (its eviction ranks by idle time when tiers
        pay), and so the order in which it stores them ahead of need."""
        self.infos = KnownChunks()
        self.unstored: dict[Hashable, KeySet] = {}
        """Session -> its GPU chunks that no tier holds a copy of (kept as chunks move,
        so stage-ahead need not look every chunk up at every turn)."""
        self.tiers_worth = self._tiers_pay()
        self.stager = Stager(self)
        self.writes = WriteDecisions(self, sum(tier_bytes.get(t, 0) for t in names))
        self.gpu.on_remove = self._left_gpu
        for st in self.tiers:
            if st.name not in shared:  # a shared tier tells every node (the cluster wires it)
                st.on_remove = self._forget_if_gone

    def _forget_if_gone(self, key: Hashable) -> None:
        if self.where(key) is not None:
            return
        if not self.gpu.has(key):
            self.infos.forget(key)
            return
        owner = self._owner.get(key)  # a tier let go of the last copy of a GPU chunk
        if key in self.by_session.get(owner, ()):
            self.unstored.setdefault(owner, KeySet()).add(key)

    def _left_gpu(self, key: Hashable) -> None:
        self._forget_if_gone(key)
        owner = self._owner.get(key)
        held = self.by_session.get(owner)
        if held is not None:
            held.discard(key)
            self.unstored.get(owner, KeySet()).discard(key)
            if not held:
                del self.by_session[owner]
                self.recent.pop(owner, None)
                self.live.left_pool(owner)

    # ------------------------------------------------------------------ helpers
    def _policy(self, name: str, gpu: bool = False) -> EvictionPolicy:
        return eviction_for(name, self.spec, self.live, gpu, self._tiers_pay())

    def _tiers_pay(self) -> bool:
        return tiers_pay(self.cost, self.spec, self._tier_bytes, self.w.chunk_tokens)

    def next_s(self, session: Hashable, now: float) -> float:
        return self.live.predicted_next_s(session, now)

    def _info(self, session: Hashable, index: int, tokens: int, key: Hashable = None) -> ChunkInfo:
        return ChunkInfo(
            nbytes=tokens * self.bpt,
            session=None if key in self._shared else session,
            index=index,
            recompute_s=self.cost.prefill.time(index * self.w.chunk_tokens, tokens),
        )

    def count(self, d: dict, key: str, n: int = 1) -> None:
        d[key] = d.get(key, 0) + n

    def _in_pool(self, key: Hashable) -> bool:
        """The GPU holds the chunk: a lower tier's copy of it is dropped, not demoted
        (``_forget_if_gone`` marks it unstored, so it is written back when it leaves)."""
        return self.gpu.has(key)

    def where(self, key: Hashable) -> Store | None:
        for st in self.tiers:
            if st.has(key):
                return st
        return None

    # ------------------------------------------------------------------- tiers
    def write(self, tier_index: int, key: Hashable, tokens: int, info: ChunkInfo, now: float,
              background: bool = True) -> float:
        """Store a chunk in a lower tier (its link carries the bytes; ``background``: no turn
        waits for it) and demote its victims (background); returns when it is done."""
        st = self.tiers[tier_index]
        if st.has(key):
            st.policy.access(key, now)
            return now
        # Pins protect running sessions' GPU blocks; their copies below may go.
        victims = st.add(key, self.cost.stored_bytes(st.name, tokens), info, now, _NO_PINS)
        if victims is None:
            return now
        self.infos.setdefault(key, info)
        self.unstored.get(self._owner.get(key), KeySet()).discard(key)
        encode = self.cost.encode_time(st.name, tokens)  # on the host's cores, then the link
        path, mark = self.links[st.name].write_path, self.links[st.name].write_path.mark
        done = path.transfer(now + encode, self.cost.store_time(st.name, tokens) - encode, background)
        if self.gpu.has(key):  # (a background write lands later if reads go ahead of it)
            self._landing[key] = Landing(done, path if background else None, mark)
        self.count(self.res.write_bytes, st.name, self.cost.stored_bytes(st.name, tokens))
        if self.spec.cascade:
            for vkey, vbytes in victims:
                # kvtier asks the live policy (worth it below?); the others always demote.
                below = (self.live.demotion_target(tier_index, vbytes, self._in_pool(vkey))
                         if self.spec.predictive
                         else tier_index + 1 if tier_index + 1 < len(self.tiers) else None)
                if below is not None:
                    self.write(below, vkey, self.cost.tokens_in(st.name, vbytes),
                               self.infos.of(vkey, vbytes), now)
        return done

    def evict_from_gpu(self, victims: list[tuple[Hashable, int]], now: float,
                       blocking: bool = False, waiting_until: float | None = None) -> float:
        """GPU victims leave; with write-back they go to a lower tier first, and their blocks
        are free only once written: returns when that is (``now`` if nothing was written).
        ``blocking``: a turn waits for these writes (they make its room), and for earlier
        ones until ``waiting_until``."""
        done = now if waiting_until is None else max(now, waiting_until)
        for key, nbytes in victims:
            tokens = nbytes // self.bpt
            if self.spec.predictive:
                self.live.victims.let_go((key,))
            landing = self._landing.pop(key, Landing(now)).at()
            where = self.where(key) if self.tiers else None
            if where is not None and self.spec.predictive and self.spec.offload_on_evict:
                raised = self.writes.raise_copy(key, tokens, where, now, done if blocking else None)
                if raised is not None:  # its blocks go once both copies are down
                    waits = self.writes.waits_for(key, tokens, where, now, landing, done, blocking)
                    done = max(done, raised, landing if waits else now)
                    continue
            if not self.spec.offload_on_evict or not self.tiers or where is not None:
                self.count(self.res.decisions, "gpu_drop")
                if self.spec.offload_on_evict:  # written ahead: its blocks go once it is down
                    if not self.writes.waits_for(key, tokens, where, now, landing, done, blocking):
                        continue
                    done = max(done, landing)
                continue
            target = 0
            if self.spec.predictive:
                target = self.writes.target(key, tokens, now, done if blocking else None)
                if target is None:
                    self.count(self.res.decisions, "gpu_drop_not_worth")
                    continue
            self.count(self.res.decisions, f"offload_{self.tiers[target].name}")
            info = self.infos.of(key, nbytes)
            done = max(done, self.write(target, key, tokens, info, now, background=not blocking))
        return done

    # -------------------------------------------------------------------- turns
    def run(self) -> SimResult:
        for i, turn in enumerate(self.w.turns):
            self.step(i, turn)
        return self.finish()

    def step(self, _index: int, t: Turn) -> TurnTime:
        """Replay the next turn (``_index``: its place in the workload); its times."""
        queued = self.res.breakdown["queue_s"]
        self._server_free = self._turn(t, self._server_free)
        return TurnTime(self.res.ttft_s[-1], self.res.breakdown["queue_s"] - queued)

    def finish(self) -> SimResult:
        self.res.peak_gpu_bytes = self.gpu.peak
        return self.res

    def _turn(self, t: Turn, server_free: float) -> float:
        """One turn: where its prefix lies, what to load, when its first token comes, and
        its context placed in the GPU; returns when the server is free again."""
        now = t.arrival_s
        self.infos.event_over()  # the last event's write-backs and demotions are all made
        sess = self._begin(t, now)
        head_start = 0.0  # loads that begin before the turn can compute (queue, hints)
        if self.spec.prefetch_on_arrival:
            head_start = max(server_free - now, 0.0)
        if self.spec.prefetch_on_hint and t.hint_lead_s > 0:
            head_start += t.hint_lead_s
        gpu_n, lower, k = self._locate(t, head_start)
        if self.spec.predictive:  # victims asked for again, as the engine's scheduler counts
            self.live.victims.requested(t.chunk_keys[:t.prompt_tokens // t.chunk_tokens])
        gpu_tokens = sum(t.tokens_of(i) for i in range(gpu_n))
        load_tokens = sum(t.tokens_of(i) for i, _ in lower[:k])
        cached = min(gpu_tokens + load_tokens, t.prompt_tokens - 1)  # a full hit computes one
        compute = self.cost.prefill.time(cached, t.prompt_tokens - cached)
        queued = max(now, server_free)
        start = max(queued, self._make_room(t, t.chunk_keys, now, queued))
        finish = self._first_token(t, now, start, compute, gpu_n, lower[:k], load_tokens)
        self.res.ttft_s.append(finish - now)
        self.live.observe_compute(finish - queued, end=finish)  # the server is held till then
        b = self.res.breakdown
        b["queue_s"] += queued - now
        b["write_back_s"] += start - queued
        b["compute_s"] += compute
        b["load_wait_s"] += finish - start - compute
        self.res.prompt_tokens += t.prompt_tokens
        self.res.saved_tokens += cached
        ctx_keys = self._place_context(t, sess, finish)
        for i, _ in lower[:k]:  # promoted chunks were read
            if i < len(ctx_keys):
                st = self.where(t.chunk_keys[i])
                if st is not None:
                    st.policy.access(t.chunk_keys[i], now)
        self._end(t, sess, now, finish)
        return finish

    def _begin(self, t: Turn, now: float) -> SessionState:
        """The session runs from now on (pinned); the policy learns its think time and,
        above the high watermark, stores idle sessions ahead of need."""
        sess = self.sessions.setdefault(t.session, SessionState())
        if self.spec.predictive:
            self.live.turn_started(t.session, now)
        self._unpin_finished(now)
        sess.busy_until = math.inf  # running from now on: pinned
        self.stager.unstaged.discard(t.session)
        for st in (self.gpu, *self.tiers):
            if isinstance(st.policy, SessionAware):
                st.policy.invalidate()  # this session's rank changed at this instant
        if self.spec.predictive:
            self.stager.watermark_offload(now)
        return sess

    def _locate(self, t: Turn, head_start: float = 0.0) -> tuple[int, list[tuple[int, Store]], int]:
        """Leading prompt chunks in the GPU, the stored ones after them (index, tier), and
        how many of those the system loads (kvtier: its restore plan)."""
        spec, keys = self.spec, t.chunk_keys
        gpu_n = 0
        if spec.restore != "none":
            while gpu_n < len(keys) and self.gpu.has(keys[gpu_n]):
                gpu_n += 1
        lower: list[tuple[int, Store]] = []
        if spec.restore in ("any", "cost") and self.tiers:
            for i in range(gpu_n, len(keys)):
                st = self.where(keys[i])
                if st is None:
                    break
                lower.append((i, st))
        k = len(lower)
        if spec.restore == "cost" and lower:
            k = restore_plan(self.cost, t, sum(t.tokens_of(i) for i in range(gpu_n)), lower, head_start,
                             self.writes.weights(t.arrival_s))
            self.count(self.res.decisions, "restore_recompute" if k == 0 else "restore_load")
        return gpu_n, lower, k

    def _first_token(
        self, t: Turn, now: float, start: float, compute: float, gpu_n: int,
        loads: list[tuple[int, Store]], load_tokens: int,
    ) -> float:
        """When the turn's first token comes: loads run on their tiers' links from
        arrival (look-ahead), the hint, or the start of the turn, overlapping compute
        layer by layer when the cost model says a restore streams."""
        spec, cost = self.spec, self.cost
        load_from = start
        if spec.prefetch_on_arrival:
            load_from = now
        if spec.prefetch_on_hint and t.hint_lead_s > 0:
            load_from = now - t.hint_lead_s
        load_end = load_from
        per_tier: dict[str, int] = {}
        for i, st in loads:
            per_tier[st.name] = per_tier.get(st.name, 0) + t.tokens_of(i)
        for name, tokens in per_tier.items():
            chunks = sum(1 for _, st in loads if st.name == name)
            secs = cost.load_time(name, tokens)  # each tier's share in one request
            decode = cost.decode_time(name, tokens)  # after the link, on the host's cores
            load_end = max(load_end, self.links[name].transfer(load_from, secs - decode) + decode)
            self.count(self.res.read_bytes, name, self.cost.stored_bytes(name, tokens))
            self.count(self.res.hits, name, chunks)
        self.count(self.res.hits, "gpu", gpu_n)
        self.count(self.res.hits, "miss", len(t.chunk_keys) - gpu_n - len(loads))
        finish = start + compute
        if loads and cost.overlaps(load_tokens):  # streamed: layer l computes as l + 1 loads
            finish = max(finish, load_end + compute / max(cost.num_layers, 1))
        elif loads:  # loaded whole, then computed
            finish = max(start, load_end) + compute
        return finish

    def _place_context(self, t: Turn, sess: SessionState, finish: float) -> list[Hashable]:
        """The turn's context now lives in the GPU (pinned while it runs): the prompt's full
        chunks, and the full chunks the reply completes when the system keeps generated
        tokens' KV (a partial tail is recomputed next turn, by every system)."""
        spec = self.spec
        prompt_full = t.prompt_tokens // t.chunk_tokens
        ctx_keys = list(t.chunk_keys[:prompt_full])
        if spec.keep_reply:
            ctx_keys.extend(t.reply_keys)
        for key in sess.gpu_keys:
            self.pinned.discard(key)
        sess.gpu_keys = ctx_keys
        self.pinned.update(ctx_keys)
        # Tail first: an LRU then evicts a session's last chunks before its first (as vLLM
        # frees a sequence's blocks in reverse), keeping a usable prefix.
        for i, key in reversed(list(enumerate(ctx_keys))):
            prev = self._owner.get(key)
            shared = prev is not None and prev != t.session
            if shared:
                self._left_gpu(key)
                self._shared.add(key)
            self._owner[key] = t.session
            if spec.restore != "none":
                self._place_chunk(t, i, key, shared, finish, stored_at_prefill=i < prompt_full)
        return ctx_keys

    def _place_chunk(
        self, t: Turn, i: int, key: Hashable, shared: bool, finish: float, stored_at_prefill: bool
    ) -> None:
        tokens = t.chunk_tokens
        info = self._info(t.session, i, tokens, key)
        if shared and self.gpu.has(key):
            self.gpu.policy.update(key, info)  # seen by two sessions: a shared chunk
        victims = self.gpu.add(key, tokens * self.bpt, info, finish, self.pinned)
        if victims is None:
            self.res.overcommits += 1
            return
        self.by_session.setdefault(t.session, KeySet()).add(key)
        if self.where(key) is None:
            self.unstored.setdefault(t.session, KeySet()).add(key)
        self.recent[t.session] = None
        self.recent.move_to_end(t.session)
        self.infos[key] = info
        if self.gpu.used > self.gpu.capacity:
            self.res.overcommits += 1
        self.evict_from_gpu(victims, finish)
        if self.through and self.tiers and stored_at_prefill:
            for ti in range(len(self.tiers)):
                self.write(ti, key, tokens, info, finish)
        elif self.spec.store_computed and self.tiers and self.where(key) is None:
            self.writes.store_computed(key, tokens, info, finish)

    def _end(self, t: Turn, sess: SessionState, now: float, finish: float) -> None:
        """The reply decodes; the session is idle from its end. (Its chunks are unpinned
        lazily: at the start of anyone's next turn after that end.)"""
        ctx_tokens = t.prompt_tokens + t.output_tokens
        end = finish + t.output_tokens * self.cost.prefill.time(ctx_tokens, 1)
        sess.busy_until = end
        sess.last_end = end
        if self.spec.predictive:
            self.live.turn_ended(t.session, at=end)
        heapq.heappush(self._ends, (end, t.session))
        sess.context_tokens = ctx_tokens
        if now >= self._next_sample:
            self._next_sample = now + self._sample_every
            self.res.timeline.append((now, {"gpu": self.gpu.used, **{s.name: s.used for s in self.tiers}}))

    def _make_room(self, t: Turn, keys: tuple, now: float, queued: float | None = None) -> float:
        """Free GPU space for the turn's new chunks before it computes (it waits in the
        queue till ``queued`` anyway); returns when the write-back of the victims lets
        their blocks go."""
        if self.spec.restore == "none":
            return now
        need = sum(t.chunk_tokens for i, k in enumerate(keys)
                   if t.tokens_of(i) == t.chunk_tokens and not self.gpu.has(k)) * self.bpt
        done = now if queued is None else max(now, queued)
        pinned = self.pinned | set(keys)
        if self.spec.predictive and self.tiers_worth and self.gpu.used + need > self.gpu.capacity:
            self.stager.drop_stored_first(need, pinned, now)
        for victim in self.gpu.evict_while(lambda: self.gpu.used + need > self.gpu.capacity, pinned, now):
            done = max(done, self.evict_from_gpu([victim], now, blocking=True, waiting_until=done))
        return done

    def _unpin_finished(self, now: float) -> None:
        while self._ends and self._ends[0][0] <= now:
            end, sid = heapq.heappop(self._ends)
            s = self.sessions[sid]
            if s.busy_until != end:
                continue  # a later turn of the session superseded this entry
            for key in s.gpu_keys:
                self.pinned.discard(key)
            s.gpu_keys = []
            self.stager.unstaged.add(sid)

