"""The reference engine: a model runner, a scheduler and chat sessions behind one object.

``Engine.chat(session_id, message)`` is the multi-turn chat backend's call: the turn's
prompt extends the session's exact token ids, so the KV of earlier turns still in the
pool is reused and only the new message is computed. ``chat_many`` and ``generate`` run many
requests together through continuous batching.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvtier.config import KVTierConfig
from kvtier.connectors.tiers.factory import build_tiers, chunk_blob_bytes
from kvtier.engine.model_runner import ModelRunner
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.scheduler import Request, Scheduler
from kvtier.engine.session import ChatSession, TurnResult
from kvtier.errors import InvalidArgumentError, KVTierError
from kvtier.hashing import chain_hashes
from kvtier.models.chat_template import Message
from kvtier.models.tokenizer import Tokenizer
from kvtier.policies.eviction import SessionAware
from kvtier.policies.live import LivePolicy, load_cost_model
from kvtier.policies.offload import Watermarks
from kvtier.transfer.kv_transfer import KVTransfer, LoadReport, SaveReport
from kvtier.transfer.store_queue import StoreQueue

log = logging.getLogger(__name__)


class RequestError(KVTierError):
    """One request failed (for example, its prompt is over max_model_len); others go on."""


class EngineStepError(RequestError):
    """The engine failed while running the request (a bug or a device error, not the
    request's fault); the engine itself goes on serving."""


DEFAULT_KV_BYTES = 256 << 20
"""The KV pool when the config sizes it neither by pool.num_blocks nor pool.memory_bytes."""


def turn_error(session_id: str, result: TurnResult) -> RequestError:
    """The exception a failed turn raises: the engine's fault or the request's."""
    cls = EngineStepError if result.internal_error else RequestError
    return cls(f"session {session_id!r}: {result.error}")


class UnknownSessionError(InvalidArgumentError, LookupError):
    """A session id the engine does not hold."""


class SessionBusyError(InvalidArgumentError):
    """The session already has a turn in flight (one turn per session at a time)."""


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
class PendingTurn:
    """A queued chat turn: its session, message and the request generating the reply."""

    session: ChatSession
    message: str
    system: str | None
    request: Request
    restored_tokens: int = 0

    def request_done(self) -> bool:
        return self.request.finished


class Engine:
    def __init__(
        self,
        model_dir: str | Path,
        config: KVTierConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``config``: the one kvtier config (its pool, engine, tiers, policy sections and
        chunk_tokens); ``clock`` times users' think gaps (a replay passes its virtual
        clock)."""
        cfg = config or KVTierConfig()
        self.config = cfg
        pool, opts = cfg.pool, cfg.engine
        if opts.num_threads:
            torch.set_num_threads(opts.num_threads)
        kv_bytes = pool.memory_bytes
        if pool.num_blocks is None and kv_bytes is None:
            kv_bytes = DEFAULT_KV_BYTES
        self.model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.runner = ModelRunner(
            model_dir,
            dtype=pool.dtype,
            device=pool.device,
            num_blocks=pool.num_blocks,
            memory_bytes=kv_bytes,
            block_size=pool.block_size,
            max_model_len=opts.max_model_len,
            enable_prefix_caching=pool.enable_prefix_caching,
        )
        self.tiers = None
        self.kv: KVTransfer | None = None
        self.transfers: StoreQueue | None = None
        self._pending: dict[
            str, tuple[Future[SaveReport], int | str, Future[OffloadResult], bool]
        ] = {}
        """Background stores by session: (store, tier, result, whether the blocks go after)."""
        model = self.runner.config
        slot = chunk_blob_bytes(
            model.num_hidden_layers,
            cfg.chunk_tokens,
            model.num_key_value_heads,
            model.head_dim,
            self.runner.pool.storage.kv.element_size(),
        )
        self.tiers = build_tiers(cfg.tiers, slot, self.runner.fingerprint)
        if self.tiers is not None:
            self.kv = KVTransfer(
                self.runner, self.tiers, cfg.chunk_tokens, stream=opts.stream_restore
            )
            self.transfers = StoreQueue(self.kv, opts.max_inflight_bytes)
        self.scheduler = Scheduler(
            self.runner,
            self.tokenizer,
            opts.max_num_seqs,
            opts.max_num_batched_tokens,
            swap=self.kv,
        )
        self.policy: LivePolicy | None = None
        if self.kv is not None:
            from kvtier.machine import this_machine

            pol = cfg.policy
            cost = load_cost_model(
                pol.profile, self.model_dir, self.runner.fingerprint.hex(), this_machine()
            )
            names = [t.name for t in self.kv.manager.tiers]
            marks = Watermarks(high=pol.watermarks.high, low=pol.watermarks.low)
            self.policy = LivePolicy(
                cost, names, cfg.chunk_tokens, marks, pol.check_every_s, pol.auto_offload, clock
            )
            for tier in self.kv.manager.tiers:
                if isinstance(tier.eviction, SessionAware):
                    tier.eviction.predictor = self.policy.eviction_rank
        self.sessions: dict[str, ChatSession] = {}
        self._busy: set[str] = set()
        self._resident_hashes: dict[str, list[bytes]] = {}
        """Block hashes of each session whose KV is meant to be in the pool."""
        self._resident_count: Counter[bytes] = Counter()
        """How many resident sessions hold each block (an offload keeps shared ones)."""

    # ----------------------------------------------------------------- requests
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: Hashable | None = None,
        on_token: Callable[[Request, int, str], None] | None = None,
    ) -> Request:
        return self.scheduler.add(self.encode(prompt), params, request_id, on_token)

    def step(self) -> list[Request]:
        if self._pending:
            self._settle_offloads()
        if self.policy is not None and self.policy.due():
            self._auto_offload()
        try:
            return self.scheduler.step()
        except Exception as exc:  # noqa: BLE001 - fail the batch, keep the engine alive
            log.exception("engine step failed; failing the requests in flight")
            return self.scheduler.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")

    def run_until_done(self, requests: Sequence[Request] | None = None) -> None:
        """Step until the given requests (default: all) are finished."""
        while self.scheduler.has_work and (
            requests is None or not all(r.finished for r in requests)
        ):
            self.step()

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None
    ) -> list[Request]:
        """Run prompts together (continuous batching); failed ones carry ``error``."""
        reqs = [self.add_request(p, params) for p in prompts]
        self.run_until_done(reqs)
        return reqs

    # ----------------------------------------------------------------- sessions
    def chat(
        self,
        session_id: str,
        message: str,
        params: SamplingParams | None = None,
        system: str | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> TurnResult:
        """One turn of a conversation; raises :class:`RequestError` if the turn fails (the
        session is then unchanged)."""
        (result,) = self.chat_many([(session_id, message)], params, system, on_text)
        if result.error is not None:
            raise turn_error(session_id, result)
        return result

    def chat_many(
        self,
        turns: Sequence[tuple[str, str]],
        params: SamplingParams | None = None,
        system: str | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> list[TurnResult]:
        """Turns of different sessions, batched together. A turn that fails comes back with
        ``error`` set and leaves its session unchanged; the others are unaffected."""
        ids = [sid for sid, _ in turns]
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError(f"one turn per session at a time, got {ids}")
        for sid in ids[1:]:  # look-ahead: later turns' chunks rise while earlier ones load
            self.prefetch(sid)
        pending: list[PendingTurn] = []
        try:
            for sid, message in turns:
                pending.append(self.begin_turn(sid, message, params, system, on_text))
        except BaseException:
            for turn in pending:
                self.scheduler.abort(turn.request.request_id)
                self._busy.discard(turn.session.session_id)
            raise
        self.run_until_done([t.request for t in pending])
        return [self.finish_turn(t) for t in pending]

    def begin_turn(
        self,
        session_id: str,
        message: str,
        params: SamplingParams | None = None,
        system: str | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> PendingTurn:
        """Queue a turn without running it (the async engine's half of :meth:`chat`)."""
        if session_id in self._busy:
            raise SessionBusyError(
                f"session {session_id!r} already has a turn in flight; wait for its reply"
            )
        self._settle_offloads(block=True, only=session_id, evict=False)  # active again
        session = self.sessions.get(session_id) or ChatSession(session_id)
        sys_msg = system if not session.messages else None
        prompt = session.next_prompt(self.tokenizer, message, sys_msg)
        if self.policy is not None:
            self.policy.turn_started(session_id)
        restored = self._restore_if_needed(session, len(prompt)).from_tiers
        if self.policy is not None and self.policy.auto_offload:
            self._make_room(len(prompt) - len(session.token_ids), exclude=session_id)
        cb = (lambda _r, _t, delta: on_text(delta) if delta else None) if on_text else None
        req = self.scheduler.add(prompt, params, f"{session_id}#{len(session.turns) + 1}", cb)
        self._busy.add(session_id)
        return PendingTurn(session, message, sys_msg, req, restored)

    def finish_turn(self, turn: PendingTurn) -> TurnResult:
        """Record a finished turn in its session (a failed one leaves the session as it was)."""
        sid = turn.session.session_id
        self._busy.discard(sid)
        if self.policy is not None and (sid in self.sessions or turn.request.finish_reason != "error"):
            self.policy.turn_ended(sid)
        req = turn.request
        if req.finish_reason == "error":
            failed = ChatSession(sid).record(turn.message, None, req)
            return replace(failed, error=req.error, internal_error=req.internal_error)
        result = turn.session.record(turn.message, turn.system, req, turn.restored_tokens)
        self.sessions[sid] = turn.session
        self._set_resident(turn.session, True)
        return result

    def _set_resident(self, session: ChatSession, resident: bool) -> None:
        """Track which blocks resident sessions hold, so an offload costs O(its own blocks)."""
        old = self._resident_hashes.pop(session.session_id, None)
        if not resident and self.policy is not None:
            self.policy.left_pool(session.session_id)
        count = self._resident_count
        for h in old or ():
            count[h] -= 1
            if count[h] <= 0:
                del count[h]
        if resident:
            hashes = chain_hashes(
                session.token_ids, self.runner.pool.block_size, self.runner.fingerprint
            )
            self._resident_hashes[session.session_id] = hashes
            count.update(hashes)

    # ------------------------------------------------------------ offload / restore
    def session(self, session_id: str) -> ChatSession:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise UnknownSessionError(f"unknown session {session_id!r}") from None

    @property
    def busy_sessions(self) -> frozenset[str]:
        """Sessions with a turn in flight."""
        return frozenset(self._busy)

    def _need_tiers(self) -> KVTransfer:
        if self.kv is None:
            raise InvalidArgumentError(
                "this engine has no lower tiers (every tier disabled in the config's tiers section)"
            )
        return self.kv

    def offload(
        self, session_id: str, tier: int | str = 0, wait: bool = True
    ) -> OffloadResult | Future[OffloadResult]:
        """Store the session's KV in ``tier`` (index or name), then free its pool blocks —
        only once every chunk is stored; a partial failure keeps the blocks and says which
        chunks failed and why.

        ``wait=False`` copies the KV out of the pool now and stores it in the background
        (the transfer engine, with a cap on bytes in flight) while the engine keeps serving;
        the blocks are freed when the store has finished, and the returned future gives the
        :class:`OffloadResult`."""
        kv = self._need_tiers()
        session = self.session(session_id)
        if session_id in self._busy:
            raise SessionBusyError(f"session {session_id!r} has a turn in flight")
        if isinstance(tier, str):
            kv.manager.tier_index(tier)  # an unknown tier name fails here, before any work
        self._settle_offloads(block=True, only=session_id)
        self.scheduler.settle_loads()  # a restore still streaming in holds blocks it frees
        if wait:
            report = kv.save(session.token_ids, tier, session_id)
            return self._complete_offload(session, report, tier, True)
        assert self.transfers is not None
        out: Future[OffloadResult] = Future()
        fut = self.transfers.submit_save(session.token_ids, tier, session_id)
        self._pending[session_id] = (fut, tier, out, True)
        return out

    def stage(self, session_id: str, tier: int | str = 0) -> Future[OffloadResult]:
        """Store the session's KV in ``tier`` in the background and keep its blocks: a
        later offload (one that makes room for a turn) then writes nothing and frees them at
        once, instead of storing on the admission path. The future's result says what was
        stored (``freed_blocks`` 0)."""
        kv = self._need_tiers()
        session = self.session(session_id)
        if session_id in self._busy:
            raise SessionBusyError(f"session {session_id!r} has a turn in flight")
        if isinstance(tier, str):
            kv.manager.tier_index(tier)
        self._settle_offloads(block=True, only=session_id)
        assert self.transfers is not None
        out: Future[OffloadResult] = Future()
        fut = self.transfers.submit_save(session.token_ids, tier, session_id)
        self._pending[session_id] = (fut, tier, out, False)
        return out

    def _settle_offloads(
        self, block: bool = False, only: str | None = None, evict: bool = True
    ) -> None:
        """Finish background offloads whose store is done (or all of them, ``block``)."""
        for sid, (fut, tier, out, leaves) in list(self._pending.items()):
            if (only is not None and sid != only) or not (block or fut.done()):
                continue
            del self._pending[sid]
            session = self.sessions.get(sid)
            try:
                report = fut.result()
            except Exception as exc:  # noqa: BLE001 - handed to whoever holds the future
                out.set_exception(exc)
                continue
            if session is None:  # ended meanwhile
                out.set_exception(UnknownSessionError(f"session {sid!r} ended during offload"))
                continue
            out.set_result(
                self._complete_offload(
                    session, report, tier, leaves and evict and sid not in self._busy
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
            self._set_resident(session, False)
            lookup = self.runner.pool.block_pool.lookup
            bs = self.runner.pool.block_size
            n = session.stored_tokens // bs
            mine = chain_hashes(session.token_ids[: n * bs], bs, self.runner.fingerprint)
            keep = {b for h in mine if self._resident_count[h] > 0 and (b := lookup(h)) is not None}
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

    def restore(self, session_id: str, wait: bool = True) -> LoadReport:
        """Bring the session's stored KV back into the pool now (a resumed turn does this
        by itself; call it on a hint that the user is coming back). ``wait=False`` returns
        once layer 0 is in and lets the other layers stream in meanwhile."""
        self._need_tiers()
        report = self._restore_if_needed(self.session(session_id))
        if wait and report.pending is not None:
            self.scheduler.settle_loads()
        return report

    def _restore_if_needed(
        self, session: ChatSession, prompt_tokens: int | None = None
    ) -> LoadReport:
        """Load the session's stored prefix, as much of it as the restore plan says beats
        recomputing (all of it without a cost model, or for an explicit restore)."""
        if self.kv is None or not session.stored_tokens:
            return LoadReport(tokens=0)
        limit = session.stored_tokens
        found = None
        if self.policy is not None and self.policy.cost is not None and prompt_tokens:
            found = self.kv.stored_prefix(session.token_ids, limit)
            k = self.policy.plan_load(found.chunks, prompt_tokens, found.cached)
            limit = found.cached + sum(n for n, _ in found.chunks[:k])
            if limit <= found.cached:
                return LoadReport(tokens=found.cached, from_pool=found.cached)
        t0 = time.perf_counter()
        report = self.kv.load(session.token_ids, limit, found=found)
        if self.policy is not None and report.pending is None and len(report.tier_hits) == 1:
            (tier,) = report.tier_hits
            self.policy.observe_read(tier, report.bytes, time.perf_counter() - t0)
        if report.tokens >= session.stored_tokens:
            session.offloaded = False
            self._set_resident(session, True)
        return report

    def prefetch(self, session_id: str) -> Future[int] | None:
        """Raise an offloaded session's chunks to the fastest tier in the background (its
        next restore then reads RAM, not disk or Redis); the future gives how many chunks
        were read. Unknown or resident sessions prefetch nothing (None)."""
        session = self.sessions.get(session_id)
        if self.transfers is None or session is None or not session.offloaded:
            return None
        return self.transfers.submit_prefetch(session.token_ids[: session.stored_tokens])

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
        if room >= 0 and session_id not in self._busy:
            self.restore(session_id, wait=False)
            if not session.offloaded:
                return "restoring"
        self.prefetch(session_id)
        return "prefetching"

    def _auto_offload(self) -> None:
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
        if used <= self.policy.watermarks.high * bp.num_blocks * bs:
            self.policy.leaving.clear()  # no pressure: no copy needs keeping for the pool
            return
        if self._pending:
            return  # one batch of pre-stages at a time: they never queue ahead of reads
        idle = self._idle_sessions()
        tiers = self.kv.manager.tiers
        empty = {  # speculative: empty space only, never displacing what a tier holds
            t.name: math.inf if t.capacity_bytes is None else float(t.capacity_bytes - t.used_bytes)
            for t in tiers
        }
        unstored = [(sid, g, p) for sid, g, p, stored in idle if not stored]
        chosen = self.policy.offloads(unstored, used, bp.num_blocks * bs, empty, staged=True)
        taken = {d.session for d in chosen if d.tier is not None}
        whole = {t.name: math.inf if t.capacity_bytes is None else float(t.capacity_bytes) for t in tiers}
        ahead = [(sid, g, p, stored or sid in taken) for sid, g, p, stored in idle]
        chosen += self.policy.stage_ahead(ahead, used, bp.num_blocks * bs, whole)
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
        for sid, hashes in self._resident_hashes.items():
            session = self.sessions.get(sid)
            if not hashes or session is None or sid == exclude or sid in self._busy or sid in self._pending:
                continue
            stored = session.stored_tokens >= self.kv.storable_tokens(session.token_ids)
            out.append((sid, len(hashes) * bs, len(hashes) * bs, stored))
        return out

    def _make_room(self, new_tokens: int, exclude: str) -> None:
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
                self.offload(d.session, d.tier, wait=wait)
            except KVTierError as exc:
                log.warning("offload of idle session %r failed: %s", d.session, exc)

    def tick(self) -> None:
        """Upkeep for an idle moment without blocking: settle finished background offloads
        and let the offload policy act (a server calls this while no request runs)."""
        if self._pending:
            self._settle_offloads()
        if self.policy is not None and self.policy.due():
            self._auto_offload()

    def open_session(self, session_id: str, history: Sequence[Message]) -> ChatSession:
        """Start (or restart) a session from a conversation the engine has not seen, such
        as an OpenAI-style request carrying its whole history: its next turn renders the
        history in full, and the prefix cache and tiers still reuse any KV they hold."""
        if session_id in self._busy:
            raise SessionBusyError(
                f"session {session_id!r} already has a turn in flight; wait for its reply"
            )
        old = self.sessions.pop(session_id, None)
        if old is not None:
            self._set_resident(old, False)
        session = ChatSession(session_id, messages=[dict(m) for m in history])
        self.sessions[session_id] = session
        return session

    def drain(self) -> None:
        """Finish every background offload and streaming restore (an idle moment)."""
        self.scheduler.settle_loads()
        self._settle_offloads(block=True)
        if self.policy is not None and self.policy.due():
            self._auto_offload()
            self._settle_offloads(block=True)

    def end_session(self, session_id: str) -> None:
        """Forget a session (its KV blocks stay in the prefix cache until evicted)."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            raise UnknownSessionError(f"unknown session {session_id!r}")
        self._set_resident(session, False)
        if self.policy is not None:
            self.policy.forget(session_id)

    def close(self) -> None:
        """Release the tiers (threads, connections, pinned memory)."""
        if self.kv is not None:
            self.scheduler.settle_loads()
            self.kv.close()
        if self.transfers is not None:
            self._settle_offloads(block=True)
            self.transfers.close()
            self.transfers = None
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None
