"""Shared-memory regions for same-host clients (see :mod:`kvtier.server.shm_regions`):
create, list, renew and delete them. Chunks move through them with
``PUT``/``GET /v1/chunks/{key}`` and the ``region`` query parameters."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response
from fastapi.concurrency import run_in_threadpool

from kvtier.server.errors import RouteError, error_responses
from kvtier.server.identity import identity_of
from kvtier.server.schemas import RegionRequest, RegionResponse
from kvtier.server.shm_regions import Region
from kvtier.server.state import ServiceState

router = APIRouter(prefix="/v1/regions", tags=["regions"])
RegionId = Annotated[str, Path(pattern=r"^[0-9a-f]{32}$", description="region id")]


@router.post("", status_code=201, response_model=RegionResponse,
             responses=error_responses(400, 401, 404, 413, 429, 507))
async def create_region(body: RegionRequest, request: Request) -> RegionResponse:
    """A region of ``bytes`` bytes, mapped by the server: map ``path`` (same host, same
    user) and name the region in chunk PUTs and GETs. 404 where the server offers none."""
    state: ServiceState = request.app.state.kvtier
    limit = state.config.server.max_body_bytes
    if body.bytes > limit:
        raise RouteError(413, f"a region holds at most one largest body ({limit} bytes)")
    tenant = identity_of(request.scope).tenant
    region = await run_in_threadpool(state.regions.create, tenant, body.bytes)
    return _answer(state, region)


def _answer(state: ServiceState, region: Region) -> RegionResponse:
    return RegionResponse(id=region.id, path=str(region.path), bytes=region.size,
                          expires_in_s=state.regions.expires_in(region))


@router.get("", response_model=list[RegionResponse], responses=error_responses(401))
async def list_regions(request: Request) -> list[RegionResponse]:
    """The caller's tenant's regions (a client that lost track of its own finds them here,
    to use or delete)."""
    state: ServiceState = request.app.state.kvtier
    regions = await run_in_threadpool(state.regions.list, identity_of(request.scope).tenant)
    return [_answer(state, r) for r in regions]


@router.post("/{region_id}/renew", response_model=RegionResponse,
             responses=error_responses(401, 404))
async def renew_region(region_id: RegionId, request: Request) -> RegionResponse:
    """Start the region's lease anew (every chunk PUT or GET through it does too)."""
    state: ServiceState = request.app.state.kvtier
    region = await run_in_threadpool(state.regions.renew, identity_of(request.scope).tenant,
                                     region_id)
    return _answer(state, region)


@router.delete("/{region_id}", status_code=204, responses=error_responses(401, 404))
async def delete_region(region_id: RegionId, request: Request) -> Response:
    """Unmap and remove the region (requests using it finish first)."""
    state: ServiceState = request.app.state.kvtier
    await run_in_threadpool(state.regions.delete, identity_of(request.scope).tenant, region_id)
    return Response(status_code=204)
