"""Sessions' turns, as the engines serving them report them: a sidecar's session-aware
tiers then keep the sessions likely back soon (:mod:`kvtier.connectors.tiers.session_turns`)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from kvtier.client import SessionTurn, TurnEvent
from kvtier.server.errors import RouteError, error_responses
from kvtier.server.identity import identity_of, tenant_session
from kvtier.server.schemas import TurnReport
from kvtier.server.state import ServiceState

router = APIRouter(prefix="/v1/chunks", tags=["chunks"])


@router.post("/turns", status_code=204, response_class=Response,
             responses=error_responses(400, 401, 404, 409))
async def report_turns(body: TurnReport, request: Request) -> Response:
    """When sessions' turns started and ended (oldest first; ``ago_s``: how long before
    this report). Sessions are the caller's tenant's. 409 in engine mode (the engine ranks
    its own sessions); 404 where the server has no tiers."""
    state: ServiceState = request.app.state.kvtier
    if state.manager is None:
        raise RouteError(404, "this server has no tiers configured (all of them are disabled)")
    if state.turns is None:
        raise RouteError(409, "this server runs an engine, which ranks its own sessions")
    tenant = identity_of(request.scope).tenant
    state.turns.report([SessionTurn(tenant_session(tenant, t.session), TurnEvent(t.event), t.ago_s)
                        for t in body.turns], tenant)
    return Response(status_code=204)
