"""Control plane: health, stats, metrics, and the engine's chat sessions.

Session calls run on the engine thread (:meth:`AsyncEngine.call`), between model steps,
so an offload never races a turn. A sidecar (no model) holds no sessions: listing is empty
and every session id is unknown (404).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request, Response

from kvtier.engine.engine import Engine, UnknownSessionError
from kvtier.server.errors import ErrorBody, error_responses
from kvtier.server.metrics import CONTENT_TYPE
from kvtier.server.schemas import (
    Health,
    HintResponse,
    OffloadRequest,
    OffloadResponse,
    RestoreResponse,
    SessionDetail,
    SessionInfo,
    Stats,
)
from kvtier.server.state import ServiceState, session_info

router = APIRouter()
_ERRORS = error_responses(400, 401, 404, 409)


def _state(request: Request) -> ServiceState:
    return request.app.state.kvtier


def _engine(state: ServiceState, session_id: str):
    if state.engine is None:
        raise UnknownSessionError(
            f"unknown session {session_id!r}: this server is a sidecar without a model "
            "(start kvtier serve with --model to hold chat sessions)"
        )
    return state.engine


@router.get("/healthz", response_model=Health, tags=["control"])
async def healthz(request: Request) -> Health:
    """Liveness and mode (``engine`` with a model, ``sidecar`` without); needs no token."""
    state = _state(request)
    return Health(mode=state.mode, model=state.model_name)


@router.get("/v1/stats", response_model=Stats, responses=_ERRORS, tags=["control"])
async def stats(request: Request) -> dict[str, Any]:
    """Every counter of the service as JSON: tiers, tier manager, pool, sessions, policy."""
    return await _state(request).snapshot()


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE: {}}}, 401: {"model": ErrorBody}},
    tags=["control"],
)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition (see docs/server.md for the list)."""
    state = _state(request)
    body = state.metrics.render(await state.snapshot())
    return Response(body, media_type=CONTENT_TYPE)


@router.get("/v1/sessions", response_model=list[SessionInfo], responses=_ERRORS, tags=["sessions"])
async def list_sessions(request: Request) -> list[dict[str, Any]]:
    """Every chat session the engine holds (empty in sidecar mode)."""
    state = _state(request)
    if state.engine is None:
        return []

    def listing(engine: Engine) -> list[dict[str, Any]]:
        return [session_info(engine, s) for s in engine.sessions.values()]

    return await state.engine.call(listing, state.engine.engine)


@router.get(
    "/v1/sessions/{session_id}", response_model=SessionDetail, responses=_ERRORS, tags=["sessions"]
)
async def get_session(session_id: str, request: Request) -> dict[str, Any]:
    """One session with its per-turn history (timings, where each turn's KV came from)."""
    eng = _engine(_state(request), session_id)

    def detail(engine: Engine) -> dict[str, Any]:
        return session_info(engine, engine.session(session_id), detail=True)

    return await eng.call(detail, eng.engine)


@router.post(
    "/v1/sessions/{session_id}/offload",
    response_model=OffloadResponse,
    responses=_ERRORS,
    tags=["sessions"],
)
async def offload_session(
    session_id: str, request: Request, body: OffloadRequest | None = None
) -> dict[str, Any]:
    """Store the session's KV in a tier (default the fastest) and free its pool blocks."""
    state = _state(request)
    eng = _engine(state, session_id)
    body = body or OffloadRequest()
    tier: int | str = body.tier if body.tier is not None else 0
    t0 = time.perf_counter()
    result = await eng.call(eng.engine.offload, session_id, tier, body.wait)
    if not body.wait:
        # The copy out of the pool is done; the store runs in the background.
        return {
            "session_id": session_id,
            "stored_tokens": 0,
            "freed_blocks": 0,
            "tier": body.tier or state.manager.tiers[0].name,
            "bytes": 0,
            "failed": {},
            "pending": True,
        }
    state.metrics.transfer.labels("offload").observe(time.perf_counter() - t0)
    state.metrics.transfer_bytes.labels("offload").inc(result.bytes)
    return {
        "session_id": result.session_id,
        "stored_tokens": result.stored_tokens,
        "freed_blocks": result.freed_blocks,
        "tier": result.tier,
        "bytes": result.bytes,
        "failed": result.failed,
    }


@router.post(
    "/v1/sessions/{session_id}/restore",
    response_model=RestoreResponse,
    responses=_ERRORS,
    tags=["sessions"],
)
async def restore_session(session_id: str, request: Request) -> dict[str, Any]:
    """Bring the session's stored KV back into the pool now."""
    state = _state(request)
    eng = _engine(state, session_id)
    t0 = time.perf_counter()
    report = await eng.call(eng.engine.restore, session_id, True)
    state.metrics.transfer.labels("restore").observe(time.perf_counter() - t0)
    state.metrics.transfer_bytes.labels("restore").inc(report.bytes)
    return {
        "session_id": session_id,
        "tokens": report.tokens,
        "from_pool": report.from_pool,
        "from_tiers": report.from_tiers,
        "tier_hits": dict(report.tier_hits),
        "bytes": report.bytes,
    }


@router.post(
    "/v1/sessions/{session_id}/hint",
    response_model=HintResponse,
    responses=_ERRORS,
    tags=["sessions"],
)
async def hint_session(session_id: str, request: Request) -> dict[str, Any]:
    """The user is typing: bring the session back before its turn arrives."""
    eng = _engine(_state(request), session_id)
    action = await eng.call(eng.engine.hint, session_id)
    return {"session_id": session_id, "action": action}


@router.delete(
    "/v1/sessions/{session_id}", status_code=204, responses=_ERRORS, tags=["sessions"]
)
async def delete_session(session_id: str, request: Request) -> Response:
    """End the session (its stored chunks stay in the tiers until evicted)."""
    eng = _engine(_state(request), session_id)
    await eng.call(eng.engine.end_session, session_id)
    return Response(status_code=204)

