"""The scheduler side of kvtier's vLLM connector: which of a request's chunks the store
holds (every rank's part), what to load into the blocks vLLM allocates, which chunks to save
as vLLM computes them, and, when a request finishes, the rest of the conversation (its
reply included) to save before its blocks are freed. Each step's work goes to the workers
as a :class:`~kvtier.connectors.vllm_blocks.StepPlan`.

It reads vLLM's objects only for the fields named here (``request.request_id``,
``prompt_token_ids``, ``all_token_ids``, ``num_computed_tokens``; the allocated blocks'
``get_block_ids()``; the scheduler output's new, cached and preempted requests), so the
main suite drives it with plain stand-ins.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvtier.connectors.chunk_store import ChunkStore
from kvtier.connectors.store_breaker import StoreUnavailableError
from kvtier.connectors.vllm_arrivals import ArrivalPrefetch
from kvtier.connectors.vllm_blocks import (
    ChunkGrid,
    ChunkSpan,
    ChunkTransfer,
    Rank,
    Role,
    Segment,
    SequenceKeys,
    StepPlan,
)
from kvtier.connectors.vllm_lookup import FINISHING, PassLookups, PrefixProbe, Stored
from kvtier.connectors.vllm_policy import LoadObservation, LoadPolicy, LoadTiming
from kvtier.connectors.vllm_sources import SegmentSources
from kvtier.connectors.vllm_turns import TurnReporter
from kvtier.policies.restore import StoredChunk

log = logging.getLogger(__name__)

@dataclass
class _ReqState:
    """One running request."""

    tokens: list[int]
    seq: SequenceKeys
    """The keys of the prompt's segments."""
    block_ids: list[int] = field(default_factory=list)
    covered: int = 0
    """Leading blocks known to be stored (saved, being saved, loaded, or found by a
    lookup): a save starts after them."""
    shared: int = 0
    """Leading blocks vLLM's own prefix cache held when the request was scheduled: another
    request computed them, so others are likely to share them too. A save past the
    stored ones ends a segment there, which a third request over the same tokens finds
    (a segment running past it has a key only this request's tokens make)."""
    saving: bool = False
    """A save was planned for it: its blocks are freed once the workers report it landed."""
    session: str | None = None
    """vLLM's session id of the request (its chunks are kept and evicted as a session's)."""


@dataclass(frozen=True)
class _Found:
    """What the last lookup of a request found: vLLM holds its first ``computed`` blocks;
    the store its first ``covered``; ``load``: the leading stored segments the policy chose
    to load (the rest is recomputed)."""

    computed: int
    covered: int
    load: tuple[Stored, ...]
    declined: int = 0
    """Stored tokens the policy chose to recompute."""
    parked: bool = True
    """The load runs parked (vLLM's async-load protocol), not before the forward pass."""

    @property
    def blocks(self) -> int:
        return sum(s.take for s in self.load)


class SchedulerSide:
    """``store()`` opens the store when first needed (the scheduler process may never).
    ``world``: the ranks (TP x PP) whose parts make a chunk."""

    def __init__(self, store: Callable[[], ChunkStore], grid: ChunkGrid, world: int = 1,
                 save_decode: bool = True, policy: LoadPolicy | None = None,
                 role: Role = Role.BOTH, timing: LoadTiming = LoadTiming.PARKED) -> None:
        self._store = store
        self.role = role
        self.timing = timing
        """When planned loads run: parked, before the forward pass, or chosen per request."""
        self.grid = grid
        self.policy = policy
        """Restore or recompute (None: every stored prefix is loaded)."""
        self.recomputed_by_decision = 0
        """Stored tokens the policy chose to recompute rather than load."""
        self._load_tiers: dict[str, set[str]] = {}
        self.ranks = [Rank(i, world) for i in range(world)]
        self._probe = PrefixProbe(self.ranks)
        self._lookups = PassLookups(self._probe)
        """A pass's lookups, asked together."""
        self.save_decode = save_decode
        """Save a finished request's reply too (a returning turn restores it)."""
        self._requests: dict[str, _ReqState] = {}
        self._found: dict[str, _Found] = {}
        self._loads: dict[str, ChunkTransfer] = {}
        self._final_saves: list[ChunkTransfer] = []
        self._finishing: set[str] = set()
        """Keys of the final saves planned for the next step: stored by the time a load
        of that step reads them (the workers save them first)."""
        self._saving: dict[str, str] = {}
        """Chunk keys a running request's save is writing (key -> that request): another
        request over the same tokens (a shared prompt, concurrent first turns) does not
        upload them again. Dropped once the owner's saves landed (:meth:`saves_landed`)."""
        self._owned: dict[str, list[str]] = {}
        """The keys each request owns in ``_saving``."""
        self._sources = SegmentSources()
        """Segments saved or found stored: a save of blocks one holds is cut out of it."""
        self.hit_blocks = 0
        self.parked_loads = 0
        """Requests loaded while vLLM parked them (its async-load protocol)."""
        self.forward_loads = 0
        """Requests loaded before the forward pass of the step that scheduled them."""
        self.busy_s = 0.0
        """Time vLLM's scheduler spent in this side's hooks (kept by the connector)."""
        self.arrivals = ArrivalPrefetch(self._store, self.ranks, self._parts)
        """Requests' keys asked about when vLLM adds them (their chunks raised into RAM)."""
        self.turns = TurnReporter(lambda turns: self._store().report_turns(turns))
        """When sessions' turns start and end, for the store's session-aware tiers (sent
        by an instance that serves whole turns: not a prefill peer)."""

    @property
    def tails_at_finish(self) -> bool:
        """A prompt's blocks past its last full slot are saved only by the request's final
        save, in one segment with its reply's: fewer, larger segments for a returning turn
        to load. A prefill peer (no final save of the reply, a decode peer asking at once)
        saves them with the prompt."""
        return self.save_decode and self.role is Role.BOTH

    @property
    def lookups(self) -> int:
        """Questions asked of the store (a request vLLM could not schedule is asked about
        again at its next try)."""
        return self._probe.round_trips

    # ------------------------------------------------------------------ arrivals
    def arrived(self, request: Any) -> None:
        """vLLM added a request: it is looked up with the pass's first lookup, or, where
        the pass after its arrival does not look it up (it waits in the queue), its stored
        chunks are raised from the slower tiers into the fastest one in the background
        (:meth:`raise_waiting`)."""
        state = self._state(request)
        if state.seq.slots:
            self._lookups.arrived(request.request_id, state.seq)

    def raise_waiting(self) -> list[Future[int]]:
        """The end of a scheduling pass: raise the chunks of the requests that arrived
        before it and were not looked up in it (:mod:`.vllm_arrivals`)."""
        waiting = self._lookups.pass_ended()
        return [self.arrivals.arrive(seq, found) for seq, found in waiting] if self.role.loads else []

    def _state(self, request: Any) -> _ReqState:
        state = self._requests.get(request.request_id)
        if state is None:
            prompt = list(request.prompt_token_ids or [])
            session = getattr(request, "session_id", None)
            state = self._requests[request.request_id] = _ReqState(
                prompt, SequenceKeys(self.grid, prompt), session=str(session) if session else None)
            if state.session is not None and self.role.loads:
                self.turns.started(state.session)
        return state

    # ------------------------------------------------------------------ lookups
    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens past ``num_computed_tokens`` the store can provide and the policy chose to
        load: of the longest stored prefix of the prompt's full blocks, leaving at least
        one token to compute. An instance that never loads (a prefill peer) still looks, so
        that it does not upload again what the store holds."""
        state = self._state(request)
        prompt = state.tokens
        bs = self.grid.block_size
        usable = (len(prompt) - 1) // bs
        try:
            stored = self._lookups.lookup(self._store(), request.request_id, state.seq,
                                          self._finishing)
        except StoreUnavailableError:  # set aside after a failure: a miss, counted by the store
            stored = []
        except Exception as exc:  # noqa: BLE001 - an unreachable store is a miss
            log.warning("kvtier lookup failed, recomputing: %s", exc)
            stored = []
        computed = num_computed_tokens // bs
        covered = 0
        for s in stored:
            self._sources.remember(state.seq, Segment(s.key, covered, s.blocks))
            covered += s.blocks
        if not self.role.loads:  # what is stored is not saved again; nothing is loaded
            self._found[request.request_id] = _Found(computed, covered, ())
            return 0
        chain, first = [], 0
        for s in stored:  # no further than the usable blocks
            chain.append(Stored(s.key, s.blocks, s.tier, max(0, min(s.blocks, usable - first))))
            first += s.blocks
        chain = [s for s in chain if s.take]
        load, declined = self._chosen(chain, computed, len(prompt))
        loads = sum(s.take for s in load) > computed
        found = _Found(computed, covered, load, declined, not loads or self._parks(load, computed))
        self._found[request.request_id] = found  # acted on once vLLM allocates (no side effect here)
        return max(0, found.blocks * bs - num_computed_tokens) if found.blocks > computed else 0

    def _chosen(self, chain: list[Stored], computed: int, prompt_tokens: int
                ) -> tuple[tuple[Stored, ...], int]:
        """The leading stored chunks worth loading past vLLM's ``computed`` blocks, and the
        stored tokens left to recompute."""
        bs = self.grid.block_size
        new = self._past_computed(chain, computed)
        skipped = sum(1 for c in new if c.tokens == 0)  # chunks vLLM holds whole
        if self.policy is None or skipped == len(chain):
            return tuple(chain), 0
        k = self.policy.chunks_to_load(new[skipped:], prompt_tokens, computed * bs)
        return (tuple(chain[: skipped + k]) if k else ()), sum(c.tokens for c in new[skipped + k :])

    def _parks(self, load: tuple[Stored, ...], computed: int) -> bool:
        """Whether a load of ``load`` past vLLM's ``computed`` blocks runs parked (see
        :class:`LoadTiming`); one that reads a chunk a finishing save is writing always
        does (it waits for the save on the loading thread, not on the forward path)."""
        if self.timing is not LoadTiming.AUTO:
            return self.timing is LoadTiming.PARKED
        if self.policy is None or any(s.tier == FINISHING for s in load):
            return True
        nbytes: dict[str, int] = {}
        for c in self._past_computed(list(load), computed):
            nbytes[c.tier] = nbytes.get(c.tier, 0) + c.tokens * self.policy.kv_bytes_per_token
        return self.policy.parks(nbytes)

    def _past_computed(self, chain: list[Stored], computed: int) -> list[StoredChunk]:
        """Each stored segment of ``chain`` with the tokens it brings past vLLM's
        ``computed`` blocks (0 where vLLM holds it whole), and its tier."""
        bs, first, out = self.grid.block_size, 0, []
        for s in chain:
            out.append(StoredChunk(max(0, first + s.take - max(first, computed)) * bs, s.tier))
            first += s.blocks
        return out

    def parks(self, request: Any) -> bool:
        """Whether the load the last lookup of ``request`` planned runs parked (vLLM's
        async-load protocol) rather than before the forward pass."""
        found = self._found.get(request.request_id)
        return found is None or found.parked

    def _parts(self, keys: Sequence[str]) -> list[str]:
        """Every rank's storage key of each of ``keys``, rank by rank."""
        return [ChunkGrid.rank_key(k, r) for r in self.ranks for k in keys]

    # -------------------------------------------------------------- allocation
    def allocated(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: the planned load targets them. Chunks the
        lookup found stored are not saved again, loaded or not."""
        state = self._requests[request.request_id]
        state.block_ids = list(block_ids)
        found = self._found.pop(request.request_id, None)
        if found is None:
            return
        state.covered = max(state.covered, found.covered)
        state.shared = max(state.shared, found.computed)
        self.recomputed_by_decision += found.declined
        if num_external_tokens <= 0:
            return
        self._loads[request.request_id] = ChunkTransfer(
            request.request_id, self._spans(state, found), state.session, parked=found.parked)
        self._load_tiers[request.request_id] = {s.tier for s in found.load}
        self.hit_blocks += found.blocks - found.computed
        if found.parked:
            self.parked_loads += 1
        else:
            self.forward_loads += 1

    def _spans(self, state: _ReqState, found: _Found) -> list[ChunkSpan]:
        """The chunks to load: each one's blocks past those vLLM computed already and no
        further than the load may take (the rest None: left alone)."""
        spans, first = [], 0
        for s in found.load:
            if first + s.take > found.computed:
                ids = tuple(state.block_ids[first + j]
                            if found.computed <= first + j < first + s.take else None
                            for j in range(s.blocks))
                spans.append(ChunkSpan(s.key, ids, first))
            first += s.blocks
        return spans

    def observe(self, loads: Sequence[LoadObservation]) -> None:
        """Loads the workers made: each tier's read speed for the policy (a request's
        chunks from one tier only: a mixed load says nothing of either)."""
        for obs in loads:
            tiers = self._load_tiers.get(obs.req_id, set())
            if self.policy is not None and len(tiers) == 1 and FINISHING not in tiers:
                self.policy.observe_load(next(iter(tiers)), obs.nbytes, obs.seconds)

    # ------------------------------------------------------------------- steps
    def step_plan(self, scheduler_output: Any) -> StepPlan:
        """This step's loads, and saves of the chunks the step completes."""
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        self.raise_waiting()
        if self.policy is not None:
            self.policy.steps.plan_built(time.monotonic(),
                                         int(getattr(scheduler_output, "total_num_scheduled_tokens", 0)),
                                         len(scheduled))
            self.policy.step_planned()
        plan = StepPlan(loads=list(self._loads.values()), finishing=self._final_saves)
        self._loads.clear()
        self._final_saves = []
        self._finishing.clear()
        plan.preempted = bool(getattr(scheduler_output, "preempted_req_ids", None))
        plan.prefill = sum(scheduled.values()) > len(scheduled)
        plan.idle = not any(scheduled.values())
        for req_id, computed in self._progress(scheduler_output).items():
            save = self._completed(req_id, computed)
            if save is not None:
                plan.saves.append(save)
        return plan

    def _progress(self, scheduler_output: Any) -> dict[str, int]:
        """Tokens each scheduled request will have computed after this step (its blocks
        brought up to date)."""
        progress: dict[str, int] = {}
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                progress[new.req_id] = new.num_computed_tokens + scheduled.get(new.req_id, 0)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                state.block_ids = list(new_ids[0])  # a resumed request gets all its blocks
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            progress[req_id] = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
        return progress

    def _completed(self, req_id: str, done: int) -> ChunkTransfer | None:
        """The blocks of ``req_id``'s prompt that ``done`` computed tokens complete and that
        are not stored yet, up to the last slot they fill; the prompt's last blocks once it
        is done, where no final save will store them (:attr:`tails_at_finish`)."""
        state = self._requests[req_id]
        if not self.role.saves:
            return None
        blocks = min(done, len(state.tokens)) // self.grid.block_size
        if self.tails_at_finish or blocks < state.seq.full_blocks:
            blocks -= blocks % self.grid.chunk_blocks
        spans = self._unsaved(state, state.seq, blocks)
        if not spans:
            return None
        state.saving = True
        self._own(req_id, spans)
        return ChunkTransfer(req_id, spans, state.session)

    def _own(self, req_id: str, spans: list[ChunkSpan]) -> None:
        for span in spans:
            self._saving[span.key] = req_id
        self._owned.setdefault(req_id, []).extend(span.key for span in spans)

    def saves_landed(self, req_ids: Sequence[str]) -> None:
        """The workers reported every save of ``req_ids`` landed: the store answers for
        their chunks from now on."""
        for req_id in req_ids:
            for key in self._owned.pop(req_id, ()):
                if self._saving.get(key) == req_id:
                    del self._saving[key]

    def _unsaved(self, state: _ReqState, seq: SequenceKeys, blocks: int) -> list[ChunkSpan]:
        """The segments of ``seq`` past the blocks stored and within the first ``blocks``
        (counted stored now: they will be), less those another request is saving; the
        first ends where vLLM's prefix cache hit ended, or else where the blocks a stored
        segment holds end (those are cut out of it, :mod:`.vllm_sources`)."""
        stop = min(blocks, len(state.block_ids))
        spans = []
        for seg in self._sources.segments(seq, state.covered, stop, state.shared):
            state.covered = seg.end
            if seg.key in self._saving or seg.key in self._finishing:
                continue  # another request's save writes the same tokens' segment
            source = self._sources.source_of(seq, seg)
            self._sources.remember(seq, seg)
            spans.append(ChunkSpan(seg.key, tuple(state.block_ids[seg.first : seg.end]),
                                   seg.first, source))
        return spans

    # ---------------------------------------------------------------- finishing
    def finished(self, request: Any, block_ids: list[int]) -> bool:
        """The request is done: plan the save of what its prompt's saves left (its reply
        too, with ``save_decode``). True: its blocks stay until the workers report every
        save of it landed."""
        req_id = request.request_id
        self._lookups.forget(req_id)
        self._found.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._load_tiers.pop(req_id, None)
        state = self._requests.pop(req_id, None)
        if state is None:
            return False
        if state.session is not None and self.role.loads:
            self.turns.ended(state.session)
        if self.save_decode and self.role.saves and block_ids:
            tokens = list(getattr(request, "all_token_ids", state.tokens))
            computed = int(getattr(request, "num_computed_tokens", 0)) - int(
                getattr(request, "num_in_flight_tokens", 0) or 0)  # async scheduling
            computed = min(computed, len(tokens))
            blocks = min(computed // self.grid.block_size, len(block_ids))
            state.block_ids = list(block_ids)
            prompt = state.seq if tokens[: len(state.tokens)] == state.tokens else None
            seq = SequenceKeys(self.grid, tokens[: blocks * self.grid.block_size], prompt)
            spans = self._unsaved(state, seq, blocks)
            if spans:
                state.saving = True
                self._own(req_id, spans)
                self._final_saves.append(ChunkTransfer(req_id, spans, state.session))
                self._finishing.update(span.key for span in spans)
        if not state.saving:
            self.saves_landed([req_id])
        return state.saving

    def close(self) -> None:
        """Send the turn reports still pending; stop the background threads."""
        self.turns.close()
        self.arrivals.close()
