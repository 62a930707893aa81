"""The reference engine: a model runner, a scheduler and chat sessions behind one object.

``Engine.chat(session_id, message)`` is the multi-turn chat backend's call: the turn's
prompt extends the session's exact token ids, so the KV of earlier turns still in the
pool is reused and only the new message is computed. ``chat_many`` and ``generate`` run many
requests together through continuous batching. Moving idle sessions' KV to the tiers and
back is an :class:`~kvtier.engine.offload.Offloader`'s, which the Engine owns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvtier.chunk_format import kv_payload_bytes, max_chunk_bytes
from kvtier.config import KVTierConfig
from kvtier.connectors.tiers.codec_setup import CodecContext, tier_codecs
from kvtier.connectors.tiers.factory import build_tiers
from kvtier.connectors.tiers.manager import TierManager
from kvtier.engine.errors import (
    EngineStepError,
    RequestError,
    SessionBusyError,
    UnknownSessionError,
    turn_error,
)
from kvtier.engine.model_runner import ModelRunner
from kvtier.engine.offload import Offloader, OffloadResult
from kvtier.engine.residency import Residency
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.scheduler import Request, Scheduler
from kvtier.engine.session import ChatSession, TurnResult
from kvtier.errors import InvalidArgumentError
from kvtier.models.chat_template import Message
from kvtier.models.tokenizer import Tokenizer
from kvtier.policies.cost_model import CostModel
from kvtier.policies.eviction import SessionAware
from kvtier.policies.live import LivePolicy, load_cost_model
from kvtier.policies.offload import Watermarks
from kvtier.transfer.kv_transfer import KVTransfer
from kvtier.transfer.restore import LoadReport
from kvtier.transfer.store_queue import StoreQueue

__all__ = [
    "DEFAULT_KV_BYTES",
    "Engine",
    "EngineStepError",
    "OffloadResult",
    "PendingTurn",
    "RequestError",
    "SessionBusyError",
    "UnknownSessionError",
    "turn_error",
]

log = logging.getLogger(__name__)


DEFAULT_KV_BYTES = 256 << 20
"""The KV pool when the config sizes it neither by pool.num_blocks nor pool.memory_bytes."""


@dataclass
class PendingTurn:
    """A queued chat turn: its session, message and the request generating the reply."""

    session: ChatSession
    message: str
    system: str | None
    request: Request
    restore: LoadReport | None = None
    """What was brought back from the tiers for this turn's prompt."""

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
            fingerprint_salt=opts.fingerprint_salt,
        )
        self.tiers = self._build_tiers(cfg)
        self.kv: KVTransfer | None = None
        self.transfers: StoreQueue | None = None
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
        self.policy: LivePolicy | None = (
            None if self.kv is None else self._live_policy(cfg, self.kv, clock)
        )
        self.sessions: dict[str, ChatSession] = {}
        self._busy: set[str] = set()
        self._turns: dict[str, PendingTurn] = {}
        """The turn in flight of each busy session."""
        self._ended: set[str] = set()
        """Sessions ended during their turn: gone once the (aborted) turn finishes."""
        self.residency = Residency(self.runner.pool.block_size, self.runner.fingerprint,
                                   None if self.policy is None else self.policy.left_pool)
        self.offloader = Offloader(self.runner, self.scheduler, self.kv, self.transfers,
                                   self.policy, self.sessions, self._busy, self.residency,
                                   self.session, opts.system_tenant)

    def _build_tiers(self, cfg: KVTierConfig) -> TierManager | None:
        """The lower tiers of the config (None: every tier disabled), their slots sized
        to one chunk of this model."""
        model = self.runner.config
        slot = max_chunk_bytes(model.num_hidden_layers, kv_payload_bytes(
            model.num_hidden_layers, cfg.chunk_tokens, model.num_key_value_heads,
            model.head_dim, self.runner.pool.storage.kv.element_size()))
        codecs = CodecContext(self._chunk_shape(cfg), self.runner.pool.storage.kv.dtype,
                              cfg.policy.max_kv_error, self._cost_model(cfg))
        return build_tiers(cfg.tiers, slot, self.runner.fingerprint, codecs)

    def _chunk_shape(self, cfg: KVTierConfig) -> tuple[int, int, int, int, int]:
        model = self.runner.config
        return (model.num_hidden_layers, 2, cfg.chunk_tokens, model.num_key_value_heads,
                model.head_dim)

    def _cost_model(self, cfg: KVTierConfig) -> CostModel | None:
        """The calibrated costs (loaded once: the tiers' codecs and the policy use them)."""
        if not hasattr(self, "_cost"):
            from kvtier.machine import this_machine

            self._cost = load_cost_model(cfg.policy.profile, self.model_dir,
                                         self.runner.fingerprint.hex(), this_machine())
        return self._cost

    def _live_policy(
        self, cfg: KVTierConfig, kv: KVTransfer, clock: Callable[[], float]
    ) -> LivePolicy:
        """The policy over this engine's tiers: the calibrated costs, the session ranks the
        tiers' session-aware eviction asks for, and where their victims go; the scheduler
        tells it each step's time and each prompt's blocks (load and victim reuse)."""
        pol = cfg.policy
        cost = self._cost_model(cfg)
        if cost is not None:
            cost = replace(cost, codecs=tier_codecs(kv.manager.tiers, self._chunk_shape(cfg),
                                                    self.runner.pool.storage.kv.dtype))
        names = [t.name for t in kv.manager.tiers]
        marks = Watermarks(high=pol.watermarks.high, low=pol.watermarks.low)
        policy = LivePolicy(
            cost, names, cfg.chunk_tokens, marks, pol.check_every_s, pol.auto_offload, clock
        )
        for tier in kv.manager.tiers:
            if isinstance(tier.eviction, SessionAware):
                # on the policy's clock (the engine's), not the tier's own monotonic one:
                # idle times from two clocks must never meet in one prediction
                tier.eviction.predictor = lambda session, _tier_now: policy.eviction_rank(session)
        kv.manager.demotion = policy.demotion_target  # as the simulator's cascade asks
        self.scheduler.on_step = policy.observe_compute
        self.scheduler.on_prompt_blocks = policy.requested
        return policy

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
        self.tick()
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
        """Queue a turn without running it (the async engine's half of :meth:`chat`).

        The turn's clock (its TTFT) starts here, so a restore done before it is queued
        counts in the TTFT it reports."""
        arrival = time.perf_counter()
        if session_id in self._busy:
            raise SessionBusyError(
                f"session {session_id!r} already has a turn in flight; wait for its reply"
            )
        self.offloader.settle(block=True, only=session_id, evict=False)  # active again
        session = self.sessions.get(session_id) or ChatSession(session_id)
        sys_msg = system if not session.messages else None
        prompt = session.next_prompt(self.tokenizer, message, sys_msg)
        if self.policy is not None:
            self.policy.turn_started(session_id)
        restored = self.offloader.restore_if_needed(session, prompt)
        if self.policy is not None and self.policy.auto_offload:
            self.offloader.make_room(len(prompt) - len(session.token_ids), exclude=session_id)
        cb = (lambda _r, _t, delta: on_text(delta) if delta else None) if on_text else None
        req = self.scheduler.add(prompt, params, f"{session_id}#{len(session.turns) + 1}", cb,
                                 arrival=arrival)
        self._busy.add(session_id)
        self._turns[session_id] = PendingTurn(session, message, sys_msg, req, restored)
        return self._turns[session_id]

    def finish_turn(self, turn: PendingTurn) -> TurnResult:
        """Record a finished turn in its session (a failed one leaves the session as it was)."""
        sid = turn.session.session_id
        self._busy.discard(sid)
        self._turns.pop(sid, None)
        ended = sid in self._ended
        self._ended.discard(sid)
        if self.policy is not None and (sid in self.sessions or turn.request.finish_reason != "error"):
            self.policy.turn_ended(sid)
        req = turn.request
        if req.finish_reason == "error":
            failed = ChatSession(sid).record(turn.message, None, req)
            return replace(failed, error=req.error, internal_error=req.internal_error)
        result = turn.session.record(turn.message, turn.system, req, turn.restore)
        if ended:  # ended while the turn ran: the end wins, the session is not brought back
            if self.policy is not None:
                self.policy.forget(sid)
            return result
        self.sessions[sid] = turn.session
        self.residency.set(turn.session, True)
        return result

    def abort_turn(self, session_id: str) -> bool:
        """Stop the session's turn in flight at the next step (its client went away): it
        finishes with ``finish_reason`` ``"abort"`` and the text generated so far, recorded
        in the session as any turn. False when the session has no turn in flight."""
        turn = self._turns.get(session_id)
        if turn is None:
            return False
        return self.scheduler.abort(turn.request.request_id)

    # ------------------------------------------- offload / restore (the Offloader's)
    def offload(self, session_id: str, tier: int | str = 0, wait: bool = True,
                raise_copies: bool = True) -> OffloadResult | Future[OffloadResult]:
        """See :meth:`Offloader.offload`."""
        return self.offloader.offload(session_id, tier, wait, raise_copies)

    def stage(self, session_id: str, tier: int | str = 0) -> Future[OffloadResult]:
        """See :meth:`Offloader.stage`."""
        return self.offloader.stage(session_id, tier)

    def restore(self, session_id: str, wait: bool = True) -> LoadReport:
        """See :meth:`Offloader.restore`."""
        return self.offloader.restore(session_id, wait)

    def prefetch(self, session_id: str) -> Future[int] | None:
        """See :meth:`Offloader.prefetch`."""
        return self.offloader.prefetch(session_id)

    def hint(self, session_id: str) -> str:
        """See :meth:`Offloader.hint`."""
        return self.offloader.hint(session_id)

    def kv_namespace(self, session_id: str) -> str | None:
        """See :meth:`Offloader.kv_namespace`."""
        return self.offloader.kv_namespace(session_id)

    # ---------------------------------------------------------- session upkeep
    def session(self, session_id: str) -> ChatSession:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise UnknownSessionError(f"unknown session {session_id!r}") from None

    @property
    def busy_sessions(self) -> frozenset[str]:
        """Sessions with a turn in flight."""
        return frozenset(self._busy)

    def tick(self) -> None:
        """Upkeep for an idle moment without blocking: settle finished background offloads
        and let the offload policy act (a server calls this while no request runs)."""
        if self.offloader.pending:
            self.offloader.settle()
        if self.policy is not None and self.policy.due():
            self.offloader.auto_offload()

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
            self.residency.set(old, False)
        session = ChatSession(session_id, messages=[dict(m) for m in history])
        self.sessions[session_id] = session
        return session

    def drain(self) -> None:
        """Finish every background offload and streaming restore (an idle moment)."""
        self.scheduler.settle_loads()
        self.offloader.settle(block=True)
        if self.policy is not None and self.policy.due():
            self.offloader.auto_offload()
            self.offloader.settle(block=True)

    def end_session(self, session_id: str) -> None:
        """Forget a session (its KV blocks stay in the prefix cache until evicted). A turn
        in flight is aborted and the end wins: the session is gone when the turn finishes,
        not brought back by it."""
        if session_id in self._busy:
            self._ended.add(session_id)
            self.abort_turn(session_id)
            session = self.sessions.pop(session_id, None)
            if session is not None:
                self.residency.set(session, False)
            return
        session = self.sessions.pop(session_id, None)
        if session is None:
            raise UnknownSessionError(f"unknown session {session_id!r}")
        self.residency.set(session, False)
        if self.policy is not None:
            self.policy.forget(session_id)

    def close(self) -> None:
        """Release the tiers (threads, connections, pinned memory)."""
        if self.kv is not None:
            self.scheduler.settle_loads()
            self.kv.close()
        if self.transfers is not None:
            self.offloader.settle(block=True)
            self.transfers.close()
            self.transfers = None
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None
