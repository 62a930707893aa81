"""The reference engine: a model runner, a scheduler and chat sessions behind one object.

``Engine.chat(session_id, message)`` is the multi-turn chat backend's call: the turn's
prompt extends the session's exact token ids, so the KV of earlier turns still in the
pool is reused and only the new message is computed. ``chat_many`` and ``generate`` run many
requests together through continuous batching.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvtier.errors import InvalidArgumentError, KVTierError
from kvtier.model_runner import ModelRunner
from kvtier.sampling import SamplingParams
from kvtier.scheduler import Request, Scheduler
from kvtier.session import ChatSession, TurnResult
from kvtier.tokenizer import Tokenizer


class RequestError(KVTierError):
    """One request failed (for example, its prompt is over max_model_len); others go on."""


@dataclass(frozen=True)
class EngineOptions:
    dtype: str = "float32"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_bytes: int | None = None
    """KV pool budget; default: 256 MiB on CPU, unless num_blocks is given."""
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    """torch CPU threads (small ops are far faster with few threads on a busy machine)."""


@dataclass
class PendingTurn:
    """A queued chat turn: its session, message and the request generating the reply."""

    session: ChatSession
    message: str
    system: str | None
    request: Request

    def request_done(self) -> bool:
        return self.request.finished


class Engine:
    def __init__(self, model_dir: str | Path, options: EngineOptions | None = None):
        opts = options or EngineOptions()
        if opts.num_threads:
            torch.set_num_threads(opts.num_threads)
        kv_bytes = opts.kv_memory_bytes
        if opts.num_blocks is None and kv_bytes is None:
            kv_bytes = 256 << 20
        self.options = opts
        self.model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.runner = ModelRunner(
            model_dir,
            dtype=opts.dtype,
            device=opts.device,
            num_blocks=opts.num_blocks,
            memory_bytes=kv_bytes,
            block_size=opts.block_size,
            max_model_len=opts.max_model_len,
            enable_prefix_caching=opts.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            self.runner, self.tokenizer, opts.max_num_seqs, opts.max_num_batched_tokens
        )
        self.sessions: dict[str, ChatSession] = {}
        self._busy: set[str] = set()

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
        return self.scheduler.step()

    def run_until_done(self, requests: Sequence[Request] | None = None) -> None:
        """Step until the given requests (default: all) are finished."""
        while self.scheduler.has_work and (
            requests is None or not all(r.finished for r in requests)
        ):
            self.scheduler.step()

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
            raise RequestError(f"session {session_id!r}: {result.error}")
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
            raise InvalidArgumentError(
                f"session {session_id!r} already has a turn in flight; wait for its reply"
            )
        session = self.sessions.get(session_id) or ChatSession(session_id)
        sys_msg = system if not session.messages else None
        prompt = session.next_prompt(self.tokenizer, message, sys_msg)
        cb = (lambda _r, _t, delta: on_text(delta) if delta else None) if on_text else None
        req = self.scheduler.add(prompt, params, f"{session_id}#{len(session.turns) + 1}", cb)
        self._busy.add(session_id)
        return PendingTurn(session, message, sys_msg, req)

    def finish_turn(self, turn: PendingTurn) -> TurnResult:
        """Record a finished turn in its session (a failed one leaves the session as it was)."""
        sid = turn.session.session_id
        self._busy.discard(sid)
        req = turn.request
        if req.finish_reason == "error":
            failed = ChatSession(sid).record(turn.message, None, req)
            return replace(failed, error=req.error)
        result = turn.session.record(turn.message, turn.system, req)
        self.sessions[sid] = turn.session
        return result

    def end_session(self, session_id: str) -> None:
        """Forget a session (its KV blocks stay in the prefix cache until evicted)."""
        if self.sessions.pop(session_id, None) is None:
            raise InvalidArgumentError(f"unknown session {session_id!r}")
