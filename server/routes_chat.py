"""``POST /v1/chat/completions``: OpenAI-compatible chat on the reference engine.

A conversation is a session: its id comes from the ``X-Session-Id`` header or the request's
``user`` field. When the request's history is exactly what the session holds, only the new
user message is computed and the earlier turns' KV is reused from the pool, or restored from
the tiers if the session was offloaded. A history the engine has not seen (another client,
an edited conversation) reseeds the session from the request. Without a session id the turn
runs in a throwaway session. Every response carries per-turn timings under ``kvtier``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import StreamingResponse

from kvtier.engine.async_engine import AsyncEngine
from kvtier.engine.engine import Engine, RequestError
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.session import TurnResult
from kvtier.errors import InvalidArgumentError
from kvtier.server.chat_bounds import ChatBounds
from kvtier.server.errors import RouteError, error_body, error_responses, status_of
from kvtier.server.identity import DEFAULT_TENANT, identity_of, tenant_session
from kvtier.server.schemas import ChatCompletion, ChatCompletionRequest, ModelCard, ModelList
from kvtier.server.state import ServiceState

router = APIRouter(tags=["chat"])
_ERRORS = error_responses(400, 401, 404, 409, 503)


def _params(body: ChatCompletionRequest, default_max: int) -> SamplingParams:
    stop = body.stop if isinstance(body.stop, list) else ([body.stop] if body.stop else [])
    return SamplingParams(
        max_tokens=body.max_completion_tokens or body.max_tokens or default_max,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=tuple(stop),
    )


@dataclass
class _SessionSetup:
    """Continue the session when the request's history is what it holds; otherwise open
    it from the history (runs on the engine thread, in the same step as the turn). A turn
    the engine refuses leaves no session it opened behind (:meth:`undo`)."""

    session_id: str
    history: list[dict[str, str]]
    opened: bool = False

    def __call__(self, engine: Engine) -> None:
        session = engine.sessions.get(self.session_id)
        if session is not None and [dict(m) for m in session.messages] == self.history:
            return
        fresh = all(m["role"] == "system" for m in self.history) and len(self.history) <= 1
        if session is None and fresh:
            return  # a new conversation: begin_turn renders the system prompt itself
        engine.open_session(self.session_id, self.history)
        self.opened = True

    def undo(self, engine: Engine) -> None:
        """Forget the session this request opened if it holds no turn (its turn was
        refused) and no other turn runs in it."""
        session = engine.sessions.get(self.session_id)
        if (self.opened and session is not None and not session.turns
                and self.session_id not in engine.busy_sessions):
            engine.end_session(self.session_id)


def _timings(result: TurnResult) -> dict[str, Any]:
    s = result.stats
    return {
        "session_id": result.session_id,
        "turn": s.turn,
        "reused_tokens": s.reused_tokens,
        "restored_tokens": s.restored_tokens,
        "restored_from": dict(s.restored_from),
        "restored_bytes": s.restored_bytes,
        "recomputed_tokens": s.recomputed_tokens,
        "queue_s": s.queue_s,
        "ttft_s": s.ttft_s,
        "tpot_s": s.tpot_s,
        "total_s": s.total_s,
        "preemptions": s.preemptions,
    }


def _usage(result: TurnResult) -> dict[str, Any]:
    s = result.stats
    return {
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.output_tokens,
        "total_tokens": s.prompt_tokens + s.output_tokens,
        "prompt_tokens_details": {"cached_tokens": s.reused_tokens},
    }


@dataclass
class _Turn:
    """One request's turn: what the engine is asked, and what every response carries."""

    state: ServiceState
    eng: AsyncEngine
    session_id: str
    ephemeral: bool
    message: str
    system: str | None
    params: SamplingParams
    prepare: _SessionSetup
    model: str
    completion_id: str
    created: int
    headers: dict[str, str]

    async def forget(self) -> None:
        """End a throwaway session (no session id was given)."""
        if self.ephemeral:
            await _forget(self.eng, self.session_id)

    async def refused(self, exc: BaseException) -> None:
        """The engine refused the turn at admission: no session of it stays behind."""
        if isinstance(exc, RequestError | InvalidArgumentError) and self.prepare.opened:
            await self.eng.call(self.prepare.undo, self.eng.engine)

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> str:
        """One ``chat.completion.chunk`` server-sent event."""
        payload = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
            **extra,
        }
        return f"data: {json.dumps(payload)}\n\n"


_SESSION_ID = re.compile(r"[\x20-\x39\x3b-\x7e]{1,256}")
"""Printable ASCII but ``:``, which joins a tenant to its sessions' ids."""


def _check_session_id(session_id: str, where: str) -> None:
    """A session id travels back in the ``X-Session-Id`` header: printable ASCII only, so
    a bad one is a 400 before the turn runs, never a broken response after it. No ``:``:
    another tenant's sessions are ``tenant:id``, and must not be nameable."""
    if not _SESSION_ID.fullmatch(session_id):
        raise InvalidArgumentError(
            f"the session id in the {where} must be 1 to 256 printable ASCII characters "
            f"other than ':' (no control characters or non-ASCII text), got "
            f"{session_id[:40]!r}"
        )


def _served_name(state: ServiceState, requested: str | None) -> str:
    """The name a reply carries: the one requested, if this server serves it."""
    if requested is None:
        return state.model_names[0]
    if requested not in state.model_names:
        raise RouteError(
            404,
            f"The model `{requested}` does not exist; this server serves "
            f"{', '.join(repr(n) for n in state.model_names)} (GET /v1/models lists them; "
            "kvtier serve --served-model-name adds aliases)",
            "model_not_found",
        )
    return requested


def _cards(state: ServiceState) -> list[ModelCard]:
    root = state.model_root or ""
    return [ModelCard(id=n, created=state.created, root=root) for n in state.model_names]


@router.get("/v1/models", response_model=ModelList, responses=_ERRORS)
async def list_models(request: Request) -> ModelList:
    """The models this server chats with: one, under each of its served names (a sidecar
    without a model lists none)."""
    return ModelList(data=_cards(request.app.state.kvtier))


@router.get("/v1/models/{model}", response_model=ModelCard, responses=_ERRORS)
async def get_model(model: str, request: Request) -> ModelCard:
    """One served model; any other name is OpenAI's 404 ``model_not_found``."""
    state: ServiceState = request.app.state.kvtier
    if state.engine is None:
        raise RouteError(404, f"The model `{model}` does not exist; this server runs without "
                         "a model (kvtier serve --model DIR)", "model_not_found")
    name = _served_name(state, model)
    return next(c for c in _cards(state) if c.id == name)


def _turn(body: ChatCompletionRequest, state: ServiceState, x_session_id: str | None,
          request_scope: dict) -> _Turn:
    """Check the request and gather what the turn needs."""
    if state.engine is None:
        raise RouteError(
            404, "this server runs without a model: start kvtier serve with --model DIR to chat"
        )
    messages = [m.model_dump() for m in body.messages]
    if messages[-1]["role"] != "user":
        raise InvalidArgumentError("the last message must be the user's (role 'user')")
    history, message = messages[:-1], messages[-1]["content"]
    system = history[0]["content"] if len(history) == 1 and history[0]["role"] == "system" else None
    session_id = x_session_id or body.user
    if session_id:
        _check_session_id(session_id, "X-Session-Id header" if x_session_id else "user field")
    ephemeral = not session_id
    headers = {} if ephemeral else {"X-Session-Id": session_id}
    session_id = session_id or f"ephemeral-{uuid.uuid4().hex}"
    tenant = identity_of(request_scope).tenant
    if tenant != DEFAULT_TENANT:  # tenants' sessions never meet: another tenant's id is not
        session_id = tenant_session(tenant, session_id)  # theirs to continue
    params = _params(body, state.config.server.max_tokens_default)
    prepare = _SessionSetup(session_id, history)
    model = _served_name(state, body.model)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    return _Turn(
        state=state, eng=state.engine, session_id=session_id, ephemeral=ephemeral,
        message=message, system=system, params=params, prepare=prepare, model=model,
        completion_id=completion_id, created=created, headers=headers,
    )


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses={200: {"content": {"text/event-stream": {}}}, **_ERRORS},
)
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    x_session_id: str | None = Header(default=None, max_length=256),
) -> Any:
    """One chat turn; ``stream: true`` answers with server-sent events."""
    turn = _turn(body, request.app.state.kvtier, x_session_id, request.scope)
    bounds: ChatBounds = request.app.state.chat_bounds
    messages = [m.model_dump() for m in body.messages]
    bounds.check_size(messages)  # before any tokenizing
    await bounds.check_tokens(turn.eng.engine, messages)  # on a worker thread
    if not body.stream:
        return await _complete(turn, request)
    return await _stream(turn, bool(body.stream_options and body.stream_options.include_usage))


async def _until_disconnected(request: Request) -> None:
    """Returns once the client has gone (its body was read already: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _complete(turn: _Turn, request: Request) -> Response:
    """The whole turn as one ``chat.completion``. A client that goes away before the reply
    aborts the turn at the engine's next step, as a stream's does."""
    chat = asyncio.ensure_future(turn.eng.chat(
        turn.session_id, turn.message, turn.params, turn.system, prepare=turn.prepare))
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({chat, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not chat.done():
            turn.state.metrics.chat_disconnects.labels("false").inc()
            turn.eng.cancel(turn.session_id, end_session=turn.ephemeral)
        result = await chat  # an aborted turn ends at the next step
    except BaseException as exc:
        await turn.refused(exc)
        raise
    finally:
        gone.cancel()
        if not chat.done():  # this request was cancelled itself: its turn goes too
            turn.eng.cancel(turn.session_id, end_session=turn.ephemeral)
            chat.add_done_callback(lambda t: t.cancelled() or t.exception())
        await turn.forget()
    turn.state.metrics.observe_turn(result.stats.as_dict())
    out = {
        "id": turn.completion_id,
        "object": "chat.completion",
        "created": turn.created,
        "model": turn.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "finish_reason": result.stats.finish_reason,
            }
        ],
        "usage": _usage(result),
        "kvtier": _timings(result),
    }
    return Response(json.dumps(out), media_type="application/json", headers=turn.headers)


async def _stream(turn: _Turn, include_usage: bool) -> StreamingResponse:
    """The turn as server-sent events; a turn refused at admission is an HTTP error."""
    events = turn.eng.stream(
        turn.session_id, turn.message, turn.params, turn.system, prepare=turn.prepare
    )
    try:
        first = await anext(events)  # a turn refused at admission is an HTTP error
    except Exception as exc:
        await turn.refused(exc)
        await turn.forget()
        raise
    return StreamingResponse(
        _sse(turn, first, events, include_usage),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", **turn.headers},
    )


async def _sse(
    turn: _Turn, first: Any, events: AsyncIterator[Any], include_usage: bool
) -> AsyncIterator[str]:
    """The event stream: role, content deltas, the finish (with timings), usage, ``[DONE]``;
    an error after admission is reported in the stream, not raised."""
    state = turn.state
    item = first
    try:
        yield turn.chunk({"role": "assistant", "content": ""})
        while not isinstance(item, TurnResult):
            if item:
                yield turn.chunk({"content": item})
            item = await anext(events)
    except Exception as exc:  # noqa: BLE001 - reported in the stream, not raised
        status, type_ = status_of(exc)
        state.metrics.count_error(type_)
        yield f"data: {json.dumps(error_body(status, str(exc), type_))}\n\n"
        yield "data: [DONE]\n\n"
        await turn.forget()
        return
    except BaseException:
        # The client went away (the response was cancelled or closed): stop generating at
        # the next step, and a throwaway session goes with its turn. Nothing is awaited
        # here: a cancelled task cannot wait.
        state.metrics.chat_disconnects.labels("true").inc()
        turn.eng.cancel(turn.session_id, end_session=turn.ephemeral)
        raise
    state.metrics.observe_turn(item.stats.as_dict())
    await turn.forget()
    yield turn.chunk({}, item.stats.finish_reason, kvtier=_timings(item))
    if include_usage:
        usage = {
            "id": turn.completion_id,
            "object": "chat.completion.chunk",
            "created": turn.created,
            "model": turn.model,
            "choices": [],
            "usage": _usage(item),
        }
        yield f"data: {json.dumps(usage)}\n\n"
    yield "data: [DONE]\n\n"


async def _forget(eng, session_id: str) -> None:
    def end(engine: Engine) -> None:
        if session_id in engine.sessions:
            engine.end_session(session_id)

    await eng.call(end, eng.engine)
