"""The offload/restore side of the engine: a session's KV between the pool and the tiers.

An idle session's KV is stored below (now, or in the background with its blocks freed once
the store is done, or pre-staged with its blocks kept), and brought back when its user
returns: restored into the pool, or raised to the fastest tier ahead of the turn. The live
policy decides when and where; this module carries its decisions out, and keeps the
bookkeeping they need (which sessions' blocks are resident, which stores are in flight).

An :class:`Offloader` is owned by :class:`~kvtier.engine.engine.Engine`, which shares with it
the sessions, the set of sessions with a turn in flight and the :class:`Residency`; the
Engine's ``offload``, ``restore`` and the rest hand over to it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.chunk_format import NAMESPACE_RE as TENANT_RE
from kvtier.engine.errors import SessionBusyError, UnknownSessionError
from kvtier.engine.residency import Residency
from kvtier.engine.session import ChatSession
from kvtier.errors import InvalidArgumentError, KVTierError
from kvtier.hashing import chain_hashes
from kvtier.transfer.kv_transfer import KVTransfer, SaveReport
from kvtier.transfer.restore import LoadReport

if TYPE_CHECKING:
    from kvtier.engine.model_runner import ModelRunner
    from kvtier.engine.scheduler import Scheduler
    from kvtier.policies.live import LivePolicy
    from kvtier.policies.offload import OffloadDecision
    from kvtier.transfer.store_queue import StoreQueue

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffloadResult:
    session_id: str
    stored_tokens: int
    """Leading tokens of the session now stored in the tiers."""
    freed_blocks: int
    """Pool blocks released (only once everything storable was stored)."""
    tier: str
    bytes: int
    failed: dict[str, str]


@dataclass
class PendingOffload:
    """A background store of a session: its ``store``, the ``tier`` asked for, the
    ``result`` handed to the caller, and whether the blocks ``leave`` once it is done
    (False: a pre-stage keeps them)."""

    store: Future[SaveReport]
    tier: int | str
    result: Future[OffloadResult]
    leaves: bool


class Offloader:
    """Offload, stage, restore, prefetch and hint, and the policy's automatic offloads.
    ``sessions`` and ``busy`` (sessions with a turn in flight) are the engine's own,
    shared; ``session(id)`` looks one up or raises ``UnknownSessionError``."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        kv: KVTransfer | None,
        transfers: StoreQueue | None,
        policy: LivePolicy | None,
        sessions: dict[str, ChatSession],
        busy: set[str],
        residency: Residency,
        session: Callable[[str], ChatSession],
        system_tenant: str | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.kv = kv
        self.transfers = transfers
        self.policy = policy
        self.sessions = sessions
        self.busy = busy
        self.residency = residency
        self.session = session
        self.system_tenant = system_tenant
        """Where the chunks of sessions of no tenant go (``engine.system_tenant``)."""
        self.pending: dict[str, PendingOffload] = {}
        """Background stores by session."""

    def kv_namespace(self, session_id: str) -> str | None:
        """The namespace a session's chunks are stored in (and its tenant's quota charged
        for): the tenant a service names in the session id (``tenant:id``), else
        ``engine.system_tenant`` (None: none, the engine's own keys)."""
        tenant, sep, _ = session_id.partition(":")
        if sep and TENANT_RE.fullmatch(tenant):
            return tenant
        return self.system_tenant

    # ---------------------------------------------------------------------- offload
    def _need_tiers(self) -> KVTransfer:
        if self.kv is None:
            raise InvalidArgumentError(
                "this engine has no lower tiers (every tier disabled in the config's tiers section)"
            )
        return self.kv

    def offload(
        self, session_id: str, tier: int | str = 0, wait: bool = True, raise_copies: bool = True
    ) -> OffloadResult | Future[OffloadResult]:
        """Store the session's KV in ``tier`` (index or name), then free its pool blocks —
        only once every chunk is stored; a partial failure keeps the blocks and says which
        chunks failed and why.

        ``wait=False`` copies the KV out of the pool now and stores it in the background
        (the transfer engine, with a cap on bytes in flight) while the engine keeps serving;
        the blocks are freed when the store has finished, and the returned future gives the
        :class:`OffloadResult`. ``raise_copies``: chunks only a slower tier holds are
        written to ``tier`` too (the session is asked to be there)."""
        kv = self._need_tiers()
        session = self.session(session_id)
        if session_id in self.busy:
            raise SessionBusyError(f"session {session_id!r} has a turn in flight")
        if isinstance(tier, str):
            kv.manager.tier_index(tier)  # an unknown tier name fails here, before any work
        self.settle(block=True, only=session_id)
        self.scheduler.settle_loads()  # a restore still streaming in holds blocks it frees
        # The session leaves the pool for ``tier``: with ``raise_copies``, chunks only a
        # slower tier holds are written there too (a restore from ``tier`` beats one from
        # where they lie; the policy's offloads ask LivePolicy.raises_copies, as the
        # simulator's ``WriteDecisions.raise_copy`` does).
        if wait:
            t0 = time.perf_counter()
            report = kv.save(session.token_ids, tier, session_id, raise_copies=raise_copies,
                             namespace=self.kv_namespace(session_id))
            result = self._complete_offload(session, report, tier, True)
            if self.policy is not None and report.bytes:
                self.policy.observe_transfer(result.tier, time.perf_counter() - t0, write=True)
            return result
        assert self.transfers is not None
        out: Future[OffloadResult] = Future()
        fut = self.transfers.submit_save(session.token_ids, tier, session_id,
                                         raise_copies=raise_copies,
                                         namespace=self.kv_namespace(session_id))
        self.pending[session_id] = PendingOffload(fut, tier, out, True)
        return out

    def stage(self, session_id: str, tier: int | str = 0) -> Future[OffloadResult]:
        """Store the session's KV in ``tier`` in the background and keep its blocks: a
        later offload (one that makes room for a turn) then writes nothing and frees them at
        once, instead of storing on the admission path. The future's result says what was
        stored (``freed_blocks`` 0)."""
        kv = self._need_tiers()
        session = self.session(session_id)
        if session_id in self.busy:
            raise SessionBusyError(f"session {session_id!r} has a turn in flight")
        if isinstance(tier, str):
            kv.manager.tier_index(tier)
        self.settle(block=True, only=session_id)
        assert self.transfers is not None
        out: Future[OffloadResult] = Future()
        fut = self.transfers.submit_save(session.token_ids, tier, session_id,
                                         namespace=self.kv_namespace(session_id))
        self.pending[session_id] = PendingOffload(fut, tier, out, False)
        return out

    def settle(
        self, block: bool = False, only: str | None = None, evict: bool = True
    ) -> None:
        """Finish background offloads whose store is done (or all of them, ``block``)."""
        for sid, p in list(self.pending.items()):
            if (only is not None and sid != only) or not (block or p.store.done()):
                continue
            del self.pending[sid]
            session = self.sessions.get(sid)
            try:
                report = p.store.result()
            except Exception as exc:  # noqa: BLE001 - handed to whoever holds the future
                p.result.set_exception(exc)
                continue
            if session is None:  # ended meanwhile
                p.result.set_exception(UnknownSessionError(f"session {sid!r} ended during offload"))
                continue
            p.result.set_result(
                self._complete_offload(
                    session, report, p.tier, p.leaves and evict and sid not in self.busy
                )
            )

    def _complete_offload(
        self, session: ChatSession, report: SaveReport, tier: int | str, evict: bool
    ) -> OffloadResult:
        kv = self._need_tiers()
        if report.tokens:
            session.stored_tokens = report.tokens
        storable = kv.storable_tokens(session.token_ids)
        freed = 0
        if evict and not report.failed and session.stored_tokens >= storable:
            self.residency.set(session, False)
            lookup = self.runner.pool.block_pool.lookup
            bs = self.runner.pool.block_size
            n = session.stored_tokens // bs
            mine = chain_hashes(session.token_ids[: n * bs], bs, self.runner.fingerprint)
            shared = self.residency.held_by_others(mine)
            keep = {b for h in shared if (b := lookup(h)) is not None}
            freed = kv.evict(session.token_ids[: session.stored_tokens], keep)
            session.offloaded = True
        name = kv.manager.tiers[kv.manager.tier_index(tier) if isinstance(tier, str) else tier].name
        return OffloadResult(
            session.session_id,
            session.stored_tokens,
            freed,
            name,
            report.bytes,
            dict(report.failed),
        )

    # ----------------------------------------------------------- restore / prefetch
    def restore(self, session_id: str, wait: bool = True) -> LoadReport:
        """Bring the session's stored KV back into the pool now (a resumed turn does this
        by itself; call it on a hint that the user is coming back). ``wait=False`` returns
        once layer 0 is in and lets the other layers stream in meanwhile."""
        self._need_tiers()
        report = self.restore_if_needed(self.session(session_id), None)
        if wait and report.pending is not None:
            self.scheduler.settle_loads()
        return report

    def restore_if_needed(
        self, session: ChatSession, prompt: Sequence[int] | None
    ) -> LoadReport:
        """Load the longest stored prefix of what the turn needs, as much of it as the
        restore plan says beats recomputing (all of it without a cost model, or for an
        explicit restore, ``prompt`` None).

        A session with KV of its own in the tiers restores that (its tail chunk included).
        Any other turn (a new session, one opened from a request's history, the first turn
        after a restart) looks its prompt up by content: chunk keys are chained content
        hashes under this model's fingerprint, so a system prompt or document another
        session stored is found in whichever tier holds it. The prompt's last token is
        always computed: its logits start the reply."""
        if self.kv is None:
            return LoadReport(tokens=0)
        ns = self.kv_namespace(session.session_id)
        if session.stored_tokens:
            tokens, limit = session.token_ids, session.stored_tokens
        elif prompt is not None and len(prompt) > 1:
            tokens, limit = prompt, len(prompt) - 1
        else:
            return LoadReport(tokens=0)
        found = None
        if self.policy is not None and self.policy.cost is not None and prompt is not None:
            found = self.kv.stored_prefix(tokens, limit, ns)
            k = self.policy.plan_load(found.chunks, len(prompt), found.cached)
            limit = found.cached + sum(n for n, _ in found.chunks[:k])
            if limit <= found.cached:
                return LoadReport(tokens=found.cached, from_pool=found.cached)
        t0 = time.perf_counter()
        report = self.kv.load(tokens, limit, found=found, namespace=ns)
        if self.policy is not None and report.pending is None and len(report.tier_hits) == 1:
            (tier,) = report.tier_hits
            self.policy.observe_read(tier, report.bytes, time.perf_counter() - t0)
        if session.stored_tokens and report.tokens >= session.stored_tokens:
            session.offloaded = False
            self.residency.set(session, True)
        return report

    def prefetch(self, session_id: str) -> Future[int] | None:
        """Raise an offloaded session's chunks to the fastest tier in the background (its
        next restore then reads RAM, not disk or Redis); the future gives how many chunks
        were read. Unknown or resident sessions prefetch nothing (None)."""
        session = self.sessions.get(session_id)
        if self.transfers is None or session is None or not session.offloaded:
            return None
        return self.transfers.submit_prefetch(session.token_ids[: session.stored_tokens],
                                              self.kv_namespace(session_id))

    def hint(self, session_id: str) -> str:
        """The chat backend says the user is typing: bring the session back before the
        turn arrives. With room in the pool (below the low watermark after it) the KV is
        restored into the pool at once, streaming; otherwise its chunks rise to the fastest
        tier. Returns what was done: ``resident``, ``restoring``, ``prefetching``."""
        session = self.session(session_id)
        self._need_tiers()
        if not session.offloaded:
            return "resident"
        assert self.policy is not None
        bp = self.runner.pool.block_pool
        need = -(-session.stored_tokens // self.runner.pool.block_size)
        room = bp.num_empty - need - (1 - self.policy.watermarks.low) * bp.num_blocks
        if room >= 0 and session_id not in self.busy:
            self.restore(session_id, wait=False)
            if not session.offloaded:
                return "restoring"
        self.prefetch(session_id)
        return "prefetching"

    # -------------------------------------------------------- the policy's offloads
    def auto_offload(self) -> None:
        """Above the high watermark, idle sessions are pre-staged: stored in the background
        while their blocks stay in the pool. Into the tiers' empty space, those predicted
        to stay away longest first; and, displacing what the tiers would demote anyway,
        the next ones a turn making room would let go (stage-ahead). When a turn needs the
        blocks (:meth:`_make_room`) they leave at once, with nothing left to write on the
        admission path; until then a session that comes back finds its KV still in the
        pool."""
        bp = self.runner.pool.block_pool
        bs = self.runner.pool.block_size
        used = (bp.num_blocks - bp.num_empty) * bs
        assert self.policy is not None and self.kv is not None
        pressure = used > self.policy.watermarks.high * bp.num_blocks * bs
        if not pressure:
            self.policy.leaving.clear()  # no pressure: no copy needs keeping for the pool
        if self.pending:
            return  # one batch of pre-stages at a time: they never queue ahead of reads
        idle = self._idle_sessions()
        tiers = self.kv.manager.tiers
        empty = {  # speculative: empty space only, never displacing what a tier holds
            t.name: math.inf if t.capacity_bytes is None else float(t.capacity_bytes - t.used_bytes)
            for t in tiers
        }
        unstored = [(sid, g, p) for sid, g, p, stored in idle if not stored]
        if not pressure:  # copies into empty space where they pay: later, blocks go free
            self._stage_all(self.policy.prestage(unstored, empty))
            return
        chosen = self.policy.offloads(unstored, used, bp.num_blocks * bs, empty, staged=True)
        taken = {d.session for d in chosen if d.tier is not None}
        whole = {t.name: math.inf if t.capacity_bytes is None else float(t.capacity_bytes) for t in tiers}
        ahead = [(sid, g, p, stored or sid in taken) for sid, g, p, stored in idle]
        chosen += self.policy.stage_ahead(ahead, used, bp.num_blocks * bs, whole)
        self._stage_all(chosen)

    def _stage_all(self, chosen: list[OffloadDecision]) -> None:
        for d in chosen:
            if d.tier is None:
                continue
            try:
                self.stage(d.session, d.tier)
            except KVTierError as exc:
                log.warning("pre-stage of idle session %r failed: %s", d.session, exc)

    def _idle_sessions(self, exclude: str | None = None) -> list[tuple[str, int, int, bool]]:
        """Idle sessions holding pool blocks: (id, tokens held, tokens a resume reuses,
        whether all of it is stored below already)."""
        assert self.kv is not None
        bs = self.runner.pool.block_size
        out = []
        for sid, blocks in self.residency.sessions():
            session = self.sessions.get(sid)
            if not blocks or session is None or sid == exclude or sid in self.busy or sid in self.pending:
                continue
            stored = session.stored_tokens >= self.kv.storable_tokens(session.token_ids)
            out.append((sid, blocks * bs, blocks * bs, stored))
        return out

    def make_room(self, new_tokens: int, exclude: str) -> None:
        """Write-back before eviction: when a turn's new tokens do not fit in the empty
        blocks, idle sessions are stored (now, on the admission path) and leave, rather
        than the pool's LRU dropping cached KV that nothing stored."""
        bp = self.runner.pool.block_pool
        bs = self.runner.pool.block_size
        need = -(-max(new_tokens, 0) // bs) + 1
        if bp.num_empty >= need:
            return
        used = (bp.num_blocks - bp.num_empty + need) * bs
        self._offload_idle(used, force=True, wait=True, exclude=exclude)

    def _offload_idle(self, used: int, force: bool, wait: bool, exclude: str | None = None) -> None:
        assert self.policy is not None and self.kv is not None
        bp = self.runner.pool.block_pool
        bs = self.runner.pool.block_size
        idle = self._idle_sessions(exclude)
        room = {
            t.name: math.inf if t.capacity_bytes is None else float(t.capacity_bytes)
            for t in self.kv.manager.tiers
        }  # a full tier makes room by demoting its own victims
        # Sessions stored already go first: they leave without a write.
        stored = [(sid, g, p) for sid, g, p, done in idle if done]
        chosen = self.policy.offloads(stored, used, bp.num_blocks * bs, room, force)
        leaving = {d.session for d in chosen if d.tier is not None}
        used -= sum(g for sid, g, _, _ in idle if sid in leaving)
        rest = [(sid, g, p) for sid, g, p, done in idle if not done]
        chosen += self.policy.offloads(rest, used, bp.num_blocks * bs, room, force)
        for d in chosen:
            if d.tier is None:
                continue  # not worth storing anywhere: the pool's LRU drops it when needed
            try:
                self.offload(d.session, d.tier, wait=wait, raise_copies=self.policy.raises_copies())
            except KVTierError as exc:
                log.warning("offload of idle session %r failed: %s", d.session, exc)
