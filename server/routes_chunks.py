"""Data plane: chunks in and out of the tiers, one at a time or in batches.

A chunk travels in the chunk format of :mod:`kvtier.chunk_format` (header, per-layer
checksums, payload). Every key a caller names is its tenant's: chunk ``k`` is stored under
``tenant.k`` (:mod:`kvtier.server.identity`), so callers never reach another tenant's
chunks or the engine's own. Every upload is verified in full (header, length, checksums, that it
holds the key it is put under and, in engine mode, the engine's model) before any tier sees
it: a malformed chunk is a 400 and nothing is stored. A batch put is all-or-nothing on
validation. Reads are verified again by the tier manager; a chunk found corrupt at rest is
dropped and reported as missing, never served.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace
from typing import Annotated, Any

import numpy as np
import torch
from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.concurrency import run_in_threadpool

from kvtier.chunk_format import (
    BIND_SLACK,
    MAX_HEADER_BYTES,
    ChunkHeader,
    bind_namespace,
    logical_key,
    namespaced_key,
    parse_header,
    storage_namespace,
    validate_chunk,
)
from kvtier.chunk_keys import KEY_PATTERN, KEY_RE
from kvtier.connectors.tiers.base import Blob, ChunkWrite, PutResult
from kvtier.connectors.tiers.blobs import put_blobs
from kvtier.connectors.tiers.derived import Derived, TokenRange, derive_chunk
from kvtier.connectors.tiers.disk_io import NO_DESCRIPTORS
from kvtier.connectors.tiers.manager import PutReport, TierManager
from kvtier.errors import ChunkError, ChunkFormatError, InvalidArgumentError
from kvtier.io_priority import IOPriority, at_priority
from kvtier.policies.eviction import ChunkInfo
from kvtier.server.budgeted_reads import (
    LeasedChunk,
    Unlent,
    derive_charge,
    lease_whole,
    read_batch,
    read_copy,
)
from kvtier.server.budgeted_reads import prefetch as budgeted_prefetch
from kvtier.server.chunk_body import (
    LeasedResponse,
    PiecewiseResponse,
    declared_length,
    staged_body,
)
from kvtier.server.chunk_map import chunk_list_parts, parse_chunk_map
from kvtier.server.chunk_versions import Settled, Version, settle
from kvtier.server.errors import RouteError, error_responses
from kvtier.server.identity import identity_of, tenant_session
from kvtier.server.reader_codecs import AcceptCodecs, reader_codecs
from kvtier.server.region_reads import get_into_region, get_prefix_into_region
from kvtier.server.schemas import (
    BatchGetIntoRegionRequest,
    BatchGetIntoRegionResponse,
    BatchGetRequest,
    BatchPutResponse,
    DeriveRequest,
    GetIntoRegionResponse,
    LookupRequest,
    LookupResponse,
    PrefetchResponse,
    PutResponse,
    RegionChunkResponse,
)
from kvtier.server.shm_regions import Region
from kvtier.server.state import ServiceState

router = APIRouter(prefix="/v1/chunks", tags=["chunks"])
MSGPACK = "application/x-msgpack"
OCTETS = "application/octet-stream"
Key = Annotated[str, Path(pattern=KEY_PATTERN, description="chunk key")]
RegionArg = Annotated[str | None, Query(
    pattern=r"^[0-9a-f]{32}$", description="a shared-memory region of the caller's (POST /v1/regions)")]
OffsetArg = Annotated[int, Query(ge=0, description="with region: where in it the chunk lies")]
PriorityArg = Annotated[IOPriority, Query(description=(
    "background: nobody waits for this store now (a save off the request path); on the "
    "tiers it waits for the transfers someone waits for, which go first"))]
SessionArg = Annotated[str | None, Query(
    pattern=r"^[\x20-\x7e]{1,256}$", description=(
        "the conversation the chunk belongs to (1 to 256 printable ASCII characters): a "
        "session-aware tier keeps a session's chunks together and gives up its last ones "
        "first; sessions are the caller's tenant's"))]
PlaceArg = Annotated[int, Query(ge=0, description=(
    "with session: the chunk's place in the session's chain (e.g. its first block); "
    "higher goes first"))]
Layers = Annotated[
    str | None,
    Query(pattern=r"^\d{1,4}:\d{1,4}$", description="read only layers START:END of the chunk"),
]
_ERRORS = error_responses(400, 401, 404, 413, 507)
_BINARY_BODY = {
    "requestBody": {
        "required": True,
        "content": {OCTETS: {"schema": {"type": "string", "format": "binary"}}},
    }
}
_MSGPACK_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            MSGPACK: {
                "schema": {"type": "string", "format": "binary"},
                "description": "a msgpack map of chunk key -> chunk bytes",
            }
        },
    }
}


HEAD_READ_BYTES = 8 + MAX_HEADER_BYTES
"""Enough of a chunk to hold its prefix and any header."""


def _stored_as(request: Request, key: str) -> str:
    """The key the tiers hold the caller's chunk ``key`` under: in the caller's namespace."""
    return namespaced_key(identity_of(request.scope).tenant, key)


def _manager(request: Request) -> tuple[ServiceState, TierManager]:
    state: ServiceState = request.app.state.kvtier
    if state.manager is None:
        raise RouteError(404, "this server has no tiers configured (all of them are disabled)")
    return state, state.manager


def _tier_arg(manager: TierManager, tier: str | None) -> int:
    return 0 if tier is None else manager.tier_index(tier)


def _parse_layers(layers: str | None) -> tuple[int, int] | None:
    if layers is None:
        return None
    start, end = (int(x) for x in layers.split(":"))
    if start >= end:
        raise RouteError(400, f"layers {layers}: START must be below END")
    return start, end


def _verify(manager: TierManager, key: str, blob: Blob) -> ChunkHeader:
    try:
        return validate_chunk(blob, key, manager.fingerprint)
    except ChunkError as exc:
        raise RouteError(400, f"chunk {key}: {exc}", "invalid_chunk") from None


def _present(settled: Settled, where: str) -> PutReport:
    """The report of a PUT of a chunk stored already (nothing written)."""
    return PutReport(per_tier={settled.tier or "": PutResult(present=[where])})


def _put_failed(report: PutReport) -> RouteError:
    """507 where no tier had room; 503 ``descriptors_exhausted`` where a tier could not
    open a file for want of descriptors (nothing is full: retry)."""
    reasons = "; ".join(f"{k}: {why}" for k, why in report.failed.items())
    if any(NO_DESCRIPTORS in why for why in report.failed.values()):
        return RouteError(503, f"no tier could store the chunk ({reasons})",
                          "descriptors_exhausted")
    return RouteError(507, f"no tier could store the chunk ({reasons})")


@router.put(
    "/{key}",
    status_code=201,
    response_model=PutResponse,
    responses={200: {"model": PutResponse}, **_ERRORS},
    openapi_extra=_BINARY_BODY,
)
async def put_chunk(key: Key, request: Request, tier: str | None = None,
                    region: RegionArg = None, offset: OffsetArg = 0,
                    length: Annotated[int | None, Query(ge=1, description=(
                        "with region: the chunk's bytes in the region"))] = None,
                    priority: PriorityArg = IOPriority.WAITED, session: SessionArg = None,
                    place: PlaceArg = 0) -> Response:
    """Store one chunk (201), or confirm it is already stored (200). A body with a
    ``Content-Length`` streams into a reused staging buffer, is verified there and goes
    to the tier from it (the CPU tier copies it into its slot; disk writes it out). With
    ``region`` (a shared-memory region of the caller's, see ``POST /v1/regions``) there is
    no body: the chunk is ``length`` bytes at ``offset`` of the region, copied out of it
    before it is verified."""
    state, manager = _manager(request)
    start = _tier_arg(manager, tier)
    where = _stored_as(request, key)
    owner = None if session is None else ChunkInfo(0, tenant_session(identity_of(request.scope).tenant, session), place)
    if region is not None:
        if length is None:
            raise RouteError(400, "a PUT from a region names the chunk's length")
        if declared_length(request):
            raise RouteError(400, "a PUT from a region carries no body")
        limit = state.config.server.max_body_bytes
        if length > limit:
            raise RouteError(413, f"chunk of {length} bytes is over server.max_body_bytes ({limit})")
        tenant = identity_of(request.scope).tenant
        t0 = time.perf_counter()
        report = await run_in_threadpool(at_priority, priority, _put_from_region, state, manager,
                                         tenant, region, offset, length, key, where, start, owner)
        state.regions.moved("put", length)
        return _put_answer(state, request, report, key, where, length, t0)
    length = declared_length(request)
    t0 = time.perf_counter()
    if length is None:  # chunked upload: the body-limit middleware has it in one piece
        blob = await request.body()
        framed = bytearray(BIND_SLACK + len(blob))
        framed[BIND_SLACK:] = blob
        report = await run_in_threadpool(at_priority, priority, _verified_put, state, manager,
                                         key, where, memoryview(framed), start, owner)
    else:
        async with staged_body(request, manager.staging, length, front=BIND_SLACK) as body:
            t0 = time.perf_counter()
            report = await run_in_threadpool(
                at_priority, priority, _verified_put, state, manager, key, where,
                memoryview(body.numpy()), start, owner
            )
    return _put_answer(state, request, report, key, where,
                       length if length is not None else len(blob), t0)


def _put_answer(state: ServiceState, request: Request, report: PutReport, key: str, where: str,
                nbytes: int, t0: float) -> Response:
    """201 stored / 200 present (or the 507 of a failed put), metrics counted."""
    state.metrics.transfer.labels("put").observe(time.perf_counter() - t0)
    if not report.ok:
        raise _put_failed(report)
    stored = [name for name, res in report.per_tier.items() if where in res.stored]
    status = "stored" if stored else "present"
    if stored:
        state.metrics.transfer_bytes.labels("put").inc(nbytes)
        state.metrics.tenant_bytes.labels(identity_of(request.scope).tenant, "put").inc(nbytes)
    tiers = stored or [name for name, res in report.per_tier.items() if where in res.present]
    body_out = PutResponse(key=key, status=status, tiers=tiers)
    return Response(
        body_out.model_dump_json(), status_code=201 if stored else 200, media_type="application/json"
    )


def _put_from_region(state: ServiceState, manager: TierManager, tenant: str, region_id: str,
                     offset: int, length: int, key: str, where: str, start: int,
                     owner: ChunkInfo | None = None) -> PutReport:
    """Copy the chunk out of the region into memory only the server writes, then check it
    there: what the client writes into its region afterwards cannot change what was
    verified (worker thread). Where the tier lends its memory (the CPU arena) that memory
    is the chunk's slot, which becomes visible only once the checks passed; else a staging
    buffer the chunk is put from."""
    with state.regions.using(tenant, region_id) as region, state.key_locks.holding([where]):
        # A key no tier holds (under its lock) is written in place, its header named for
        # its namespace in front of its payload; one some tier holds is staged and compared
        # with the stored version first (one version per key).
        if not manager.lookup([where]).length:
            head, payload_at = _bound_head(region, offset, length, key, where)
            total = len(head) + length - payload_at

            def fill(slot: torch.Tensor) -> int:
                mem = memoryview(slot.numpy())[:total]
                mem[: len(head)] = head
                region.read_into(offset + payload_at, mem[len(head) :])
                try:
                    validate_chunk(mem, where, manager.fingerprint)
                except ChunkError as exc:
                    raise RouteError(400, f"chunk {key}: {exc}", "invalid_chunk") from None
                return total

            info = None if owner is None else replace(owner, nbytes=total)
            return manager.store([ChunkWrite(where, total, fill=fill, info=info)], start,
                                 reraise=(RouteError,))
        with state.regions.staging(length), manager.staging.borrowed(BIND_SLACK + length) as buf:
            mem = memoryview(buf.numpy())[: BIND_SLACK + length]
            region.read_into(offset, mem[BIND_SLACK:])
            return _verified_put(state, manager, key, where, mem, start, owner)


def _bound_head(region: Region, offset: int, length: int, key: str, where: str
                ) -> tuple[bytes, int]:
    """The prefix and header of the chunk at ``offset`` of the region, named for its
    namespace, and where its payload starts in the region (the payload itself is copied
    once, straight into the slot, and checked there)."""
    n = min(length, HEAD_READ_BYTES)
    buf = bytearray(BIND_SLACK + n)
    mem = memoryview(buf)
    region.read_into(offset, mem[BIND_SLACK:])
    try:
        header, payload_at = parse_header(mem[BIND_SLACK:])
        if payload_at + header.payload_nbytes != length:
            raise ChunkFormatError(f"it is {length} bytes, its header says "
                                   f"{payload_at + header.payload_nbytes}")
        ns = storage_namespace(where)
        start = BIND_SLACK
        if ns is not None:
            start, _ = bind_namespace(mem, BIND_SLACK, n, ns)
    except ChunkError as exc:
        raise RouteError(400, f"chunk {key}: {exc}", "invalid_chunk") from None
    return bytes(mem[start : BIND_SLACK + payload_at]), payload_at


def _bound(manager: TierManager, key: str, where: str, buf: memoryview, start: int,
           length: int, floor: int = 0) -> tuple[memoryview, ChunkHeader]:
    """The upload at ``buf[start:start + length]`` checked in full (a 400 stores nothing),
    then bound to the namespace it is stored in (its header rewritten in place, in front
    of the payload, never below ``floor``): the chunk and its new header."""
    _verify(manager, key, buf[start : start + length])
    ns = storage_namespace(where)
    if ns is None:
        return buf[start : start + length], parse_header(buf[start : start + length])[0]
    s, n = bind_namespace(buf, start, length, ns, floor)
    return buf[s : s + n], parse_header(buf[s : s + n])[0]


def _verified_put(state: ServiceState, manager: TierManager, key: str, where: str,
                  framed: memoryview, start: int, owner: ChunkInfo | None = None) -> PutReport:
    """Check the upload in full (a 400 stores nothing), bind it to its namespace, then put
    it under ``where`` unless that key holds it already (a 409 where it holds another
    version; worker thread: the checksums and the copy must not hold up the event loop).
    ``framed``: :data:`BIND_SLACK` free bytes, then the chunk; ``owner``: its session and
    place, for the tiers' eviction."""
    blob, header = _bound(manager, key, where, framed, BIND_SLACK, len(framed) - BIND_SLACK)
    with state.key_locks.holding([where]):
        settled = settle(manager, where, header)
        if settled.version is Version.SAME:
            return _present(settled, where)
        info = None if owner is None else {where: replace(owner, nbytes=len(blob))}
        return put_blobs(manager, {where: blob}, info, tier=start)


@router.post(
    "/{key}/derive",
    status_code=201,
    response_model=PutResponse,
    responses={200: {"model": PutResponse}, **error_responses(400, 401, 404, 409, 507)},
)
async def derive_chunk_route(key: Key, body: DeriveRequest, request: Request,
                             tier: str | None = None, priority: PriorityArg = IOPriority.WAITED,
                             session: SessionArg = None, place: PlaceArg = 0) -> Response:
    """Store under ``key`` a run of the tokens of the caller's stored chunk ``source``
    (every layer), cut inside the service: nothing is uploaded. 201 stored, 200 present
    (``key`` holds this very chunk), 409 ``chunk_exists`` where it holds another, as a PUT;
    404 where no exact copy of the source is stored (never stored, evicted, or kept only
    compressed: the caller uploads the chunk instead), 409 where the source is not KV to
    cut (a client's opaque bytes, a layer range), 400 where the tokens run past it."""
    state, manager = _manager(request)
    start = _tier_arg(manager, tier)
    where, source = _stored_as(request, key), _stored_as(request, body.source)
    tenant = identity_of(request.scope).tenant
    owner = None if session is None else ChunkInfo(0, tenant_session(tenant, session), place)
    t0 = time.perf_counter()
    try:
        tokens = TokenRange(body.first_token, body.tokens)
        done = await run_in_threadpool(at_priority, priority, _derived, state, manager, where,
                                       source, tokens, owner, start)
    except InvalidArgumentError as exc:
        raise RouteError(400, str(exc)) from None
    state.metrics.transfer.labels("derive").observe(time.perf_counter() - t0)
    if done is Derived.NO_SOURCE:
        raise RouteError(404, f"no exact copy of chunk {body.source} is stored")
    if done is Derived.NOT_KV:
        raise RouteError(409, f"chunk {body.source} is not KV to cut (opaque or a layer range)")
    if done is Derived.CONFLICT:
        raise RouteError(409, f"chunk {key} is stored already with other content; chunks are "
                         "immutable: DELETE it first to replace it", "chunk_exists")
    if done is Derived.FAILED:
        raise RouteError(507, f"no tier could store chunk {key}")
    tiers = manager.locate([where])[0]
    out = PutResponse(key=key, status=done.value, tiers=[] if tiers is None else [manager.tiers[tiers].name])
    return Response(out.model_dump_json(), status_code=201 if done is Derived.STORED else 200,
                    media_type="application/json")


def _derived(state: ServiceState, manager: TierManager, where: str, source: str,
             tokens: TokenRange, owner: ChunkInfo | None, start: int) -> Derived:
    """The derive, its source's lease and its new chunk held against the read budget
    while it runs (a 503 to retry where there is no room), as a PUT holds its body."""
    tenant = storage_namespace(where) or ""
    charge = derive_charge(state.replies, manager, source)
    with state.replies.holding(tenant, charge), state.key_locks.holding([where]):
        return derive_chunk(manager, where, source, tokens, owner, start)


@router.get(
    "/{key}",
    response_class=Response,
    responses={200: {"content": {OCTETS: {}}}, **_ERRORS},
)
async def get_chunk(key: Key, request: Request, layers: Layers = None,
                    region: RegionArg = None, offset: OffsetArg = 0, accept: AcceptCodecs = None,
                    room: Annotated[int | None, Query(ge=1, description=(
                        "with region: bytes the chunk may take there (default: to its end)"))] = None,
                    ) -> Response:
    """The chunk's bytes (verified), from the fastest tier holding it. A whole chunk is
    sent straight from the tier's memory under its lease (no copy into a response body);
    a layer range, or a chunk the fastest tier holding it failed to give, is read whole.
    With ``region`` (a shared-memory region of the caller's) the whole chunk is written
    into the region at ``offset`` instead (at most ``room`` bytes), and the answer is JSON
    with its length (413, nothing written, when it does not fit). A chunk of a codec the
    reader does not take (``X-KVTier-Accept-Codecs``) is not stored, for it."""
    state, manager = _manager(request)
    codecs = reader_codecs(accept)
    span = _parse_layers(layers)
    where = _stored_as(request, key)
    tenant = identity_of(request.scope).tenant
    t0 = time.perf_counter()
    if region is not None:
        if span is not None:
            raise RouteError(400, "a GET into a region is of the whole chunk (no layers)")
        length, tier = await run_in_threadpool(get_into_region, state, manager, tenant, region,
                                               offset, room, key, where, codecs)
        state.regions.moved("get", length)
        _count_get(state, tenant, length, t0)
        body = GetIntoRegionResponse(key=key, length=length, tier=tier)
        return Response(body.model_dump_json(), media_type="application/json",
                        headers={"X-KVTier-Tier": tier})
    reads = state.replies
    held = reads.reserve(tenant)  # grown to each read's size before the read
    try:
        if span is None:
            leased = await run_in_threadpool(lease_whole, reads, held, manager, where, codecs)
            if leased is Unlent.MISSING:
                raise RouteError(404, f"chunk {key} is not stored")
            if isinstance(leased, LeasedChunk):
                _count_get(state, tenant, leased.view.numel(), t0)
                return LeasedResponse(leased.view, leased.lease, {"X-KVTier-Tier": leased.tier},
                                      OCTETS, held, reads.write_timeout_s)
        blob, tier = await run_in_threadpool(read_copy, reads, held, manager, where, span,
                                             codecs)
        if blob is None:
            outside = "" if span is None else f" (or layers {layers} lie outside it)"
            raise RouteError(404, f"chunk {key} is not stored{outside}")
    except BaseException:
        held.release()
        raise
    _count_get(state, tenant, len(blob), t0)
    return PiecewiseResponse([blob], OCTETS, {"X-KVTier-Tier": tier or ""}, held,
                             reads.write_timeout_s)


def _count_get(state: ServiceState, tenant: str, nbytes: int, t0: float) -> None:
    state.metrics.transfer.labels("get").observe(time.perf_counter() - t0)
    state.metrics.transfer_bytes.labels("get").inc(nbytes)
    state.metrics.tenant_bytes.labels(tenant, "get").inc(nbytes)


@router.head("/{key}", response_class=Response, responses={404: {"description": "not stored"}})
async def head_chunk(key: Key, request: Request, accept: AcceptCodecs = None) -> Response:
    """200 with ``X-KVTier-Tier`` when the chunk is stored, 404 otherwise (no body)."""
    _, manager = _manager(request)
    loc = await run_in_threadpool(manager.lookup, [_stored_as(request, key)], reader_codecs(accept))
    if not loc.length:
        return Response(status_code=404)
    return Response(status_code=200, headers={"X-KVTier-Tier": manager.tiers[loc.tiers[0]].name})


@router.delete("/{key}", status_code=204, responses=_ERRORS)
async def delete_chunk(key: Key, request: Request) -> Response:
    """Remove the chunk from every tier (204), or 404 if no tier held it."""
    _, manager = _manager(request)
    if not await run_in_threadpool(manager.delete, [_stored_as(request, key)]):
        raise RouteError(404, f"chunk {key} is not stored")
    return Response(status_code=204)


def _check_keys(keys: list[str]) -> None:
    bad = [k for k in keys if not KEY_RE.fullmatch(k)]
    if bad:
        raise RouteError(400, f"not chunk keys: {bad[:5]} (pattern {KEY_PATTERN})")


@router.post("/lookup", response_model=LookupResponse, responses=_ERRORS)
async def lookup(body: LookupRequest, request: Request, accept: AcceptCodecs = None
                 ) -> dict[str, Any]:
    """The longest stored prefix of ``keys`` and the tier holding each of its keys; with
    ``each``, also whether each key is stored (a connector probing candidate tails). Tiers
    keeping chunks in a codec the reader does not take are not counted."""
    _, manager = _manager(request)
    _check_keys(body.keys)
    keys = [_stored_as(request, k) for k in body.keys]
    return await run_in_threadpool(_lookup, manager, keys, body.each, reader_codecs(accept))


def _lookup(manager: TierManager, keys: list[str], each: bool, codecs: frozenset[str] | None
            ) -> dict[str, Any]:
    """The lookup's answer, in one worker-thread hop (a connector waits on it in vLLM's
    scheduler loop)."""
    loc = manager.lookup(keys, codecs)
    names = [t.name for t in manager.tiers]
    out: dict[str, Any] = {"length": loc.length, "tiers": [names[i] for i in loc.tiers]}
    if each:
        located = manager.locate(keys, codecs)
        out["present"] = [t is not None for t in located]
        out["located"] = [None if t is None else names[t] for t in located]
    return out


@router.post("/prefetch", response_model=PrefetchResponse, responses=_ERRORS)
async def prefetch(body: LookupRequest, request: Request, accept: AcceptCodecs = None
                   ) -> dict[str, Any]:
    """Raise the stored prefix of ``keys`` into the fastest tier (each chunk a slower tier
    holds is read, verified and written there): a request that will read them is coming.
    A key named twice is read once; the reads are charged against the read budget a run
    at a time (503 where the first run finds no room)."""
    state, manager = _manager(request)
    _check_keys(body.keys)
    keys = [_stored_as(request, k) for k in body.keys]
    tenant = identity_of(request.scope).tenant
    return {"promoted": await run_in_threadpool(budgeted_prefetch, state.replies, manager,
                                                tenant, keys, reader_codecs(accept))}


@router.post(
    "/batch/get",
    response_class=Response,
    responses={
        200: {"content": {MSGPACK: {}}, "description": "msgpack list: chunk bytes or nil"},
        **_ERRORS,
    },
)
async def batch_get(body: BatchGetRequest, request: Request, accept: AcceptCodecs = None
                    ) -> Response:
    """Many chunks in one round trip: a msgpack list, in key order, of bytes or nil."""
    state, manager = _manager(request)
    codecs = reader_codecs(accept)
    _check_keys(body.keys)
    span = _parse_layers(f"{body.layers[0]}:{body.layers[1]}") if body.layers else None
    if span is not None and span[0] < 0:
        raise RouteError(400, "layers must be non-negative")
    t0 = time.perf_counter()
    unique = list(dict.fromkeys(body.keys))  # a key asked for twice is read (and held) once
    tenant = identity_of(request.scope).tenant
    held = state.replies.reserve(tenant)
    try:
        by_key, nbytes = await run_in_threadpool(
            read_batch, state.replies, held, manager, unique,
            [_stored_as(request, k) for k in unique], Counter(body.keys), span, codecs)
    except BaseException:
        held.release()
        raise
    blobs = [by_key[k] for k in body.keys]
    state.metrics.transfer.labels("get").observe(time.perf_counter() - t0)
    state.metrics.transfer_bytes.labels("get").inc(nbytes)
    state.metrics.tenant_bytes.labels(tenant, "get").inc(nbytes)
    return PiecewiseResponse(chunk_list_parts(blobs), MSGPACK, reservation=held,
                             write_timeout_s=state.replies.write_timeout_s)


@router.post("/batch/get-into-region", response_model=BatchGetIntoRegionResponse,
             responses=_ERRORS)
async def batch_get_into_region(body: BatchGetIntoRegionRequest, request: Request,
                                accept: AcceptCodecs = None) -> BatchGetIntoRegionResponse:
    """The stored prefix of ``keys`` written into the caller's shared-memory region in one
    round trip: the chunks one after another from ``offset`` (each at a page boundary),
    each verified as it is copied, until a key is not stored or the next chunk does not
    fit in ``room`` (413, nothing written, when the first one cannot). A restore reads a
    conversation's chunks this way; :mod:`kvtier.server.region_reads`."""
    state, manager = _manager(request)
    _check_keys(body.keys)
    tenant = identity_of(request.scope).tenant
    t0 = time.perf_counter()
    got = await run_in_threadpool(
        get_prefix_into_region, state, manager, tenant, body.region, body.offset, body.room,
        body.keys, [_stored_as(request, k) for k in body.keys], reader_codecs(accept))
    nbytes = sum(c.length for c in got.chunks)
    for c in got.chunks:
        state.regions.moved("get", c.length)
    state.metrics.transfer.labels("get").observe(time.perf_counter() - t0)
    state.metrics.transfer_bytes.labels("get").inc(nbytes)
    state.metrics.tenant_bytes.labels(tenant, "get").inc(nbytes)
    return BatchGetIntoRegionResponse(
        chunks=[RegionChunkResponse(key=c.key, offset=c.offset, length=c.length, tier=c.tier)
                for c in got.chunks],
        stopped=None if got.stopped is None else got.stopped.value)


def _unpacked_and_verified(manager: TierManager, raw: bytes | memoryview
                           ) -> tuple[dict[str, memoryview], dict[str, ChunkHeader]]:
    """The batch's chunks (views of ``raw``) and their headers, each verified in full; any
    problem is a 400 and nothing stored."""
    chunks = parse_chunk_map(memoryview(raw).cast("B"))
    _check_keys(list(chunks))
    headers = {key: _verify(manager, key, blob) for key, blob in chunks.items()}
    return chunks, headers


def _bound_batch(raw: memoryview, chunks: dict[str, memoryview], tenant: str
                 ) -> tuple[dict[str, memoryview], dict[str, ChunkHeader]]:
    """Each chunk of a batch (views of ``raw``) bound to the tenant's namespace: its header
    rewritten in front of its payload, over the batch's own framing, never over the chunk
    before it; copied where that room is too small."""
    base = np.frombuffer(raw, np.uint8).ctypes.data
    spans = sorted((np.frombuffer(v, np.uint8).ctypes.data - base, k) for k, v in chunks.items())
    out: dict[str, memoryview] = {}
    headers: dict[str, ChunkHeader] = {}
    floor = 0
    for start, k in spans:
        n = len(chunks[k])
        try:
            s, m = bind_namespace(raw, start, n, tenant, floor)
            view = raw[s : s + m]
        except ChunkFormatError:  # no room in front of it: a copy with room
            framed = memoryview(bytearray(BIND_SLACK + n))
            framed[BIND_SLACK:] = chunks[k]
            s, m = bind_namespace(framed, BIND_SLACK, n, tenant)
            view = framed[s : s + m]
        out[k], headers[k] = view, parse_header(view)[0]
        floor = start + n
    return out, headers


def _batch_put_new(state: ServiceState, manager: TierManager, tenant: str,
                   chunks: dict[str, memoryview], headers: dict[str, ChunkHeader], start: int
                   ) -> PutReport:
    """Put the batch's chunks not stored yet; those stored already are ``present``, those
    stored with other content failed with a ``conflict`` reason (one version per key)."""
    wheres = {namespaced_key(tenant, k): k for k in chunks}
    with state.key_locks.holding(wheres):
        new: dict[str, Blob] = {}
        same: dict[str, list[str]] = {}
        conflicts: dict[str, str] = {}
        for where, key in wheres.items():
            try:
                settled = settle(manager, where, headers[key])
            except RouteError as exc:
                conflicts[where] = f"conflict: {exc}"
                continue
            if settled.version is Version.SAME:
                same.setdefault(settled.tier or "", []).append(where)
            else:
                new[where] = chunks[key]
        report = put_blobs(manager, new, tier=start) if new else PutReport()
    for tier, keys in same.items():
        report.per_tier.setdefault(tier, PutResult()).present.extend(keys)
    report.failed.update(conflicts)
    return report


@router.post(
    "/batch/put", response_model=BatchPutResponse, responses=_ERRORS, openapi_extra=_MSGPACK_BODY
)
async def batch_put(request: Request, tier: str | None = None,
                    priority: PriorityArg = IOPriority.WAITED) -> dict[str, Any]:
    """Many chunks in one round trip (a msgpack map key -> bytes). Every chunk is verified
    first: one bad chunk fails the request with 400 and nothing is stored."""
    state, manager = _manager(request)
    start = _tier_arg(manager, tier)
    # The body streams into a staging buffer (no join of hundreds of MiB on the event loop);
    # parsing and checksumming run on a worker thread, and the chunks go to the tiers as
    # views of that buffer, while it is held.
    length = declared_length(request)
    tenant = identity_of(request.scope).tenant

    def verified_put(raw: memoryview) -> tuple[dict[str, memoryview], PutReport, float]:
        chunks, _ = _unpacked_and_verified(manager, raw)
        chunks, headers = _bound_batch(raw, chunks, tenant)
        t0 = time.perf_counter()
        report = at_priority(priority, _batch_put_new, state, manager, tenant, chunks, headers,
                             start)
        return chunks, report, time.perf_counter() - t0

    if length is None:  # chunked upload: the body-limit middleware has it in one piece
        body = memoryview(bytearray(await request.body()))  # writable: headers are rebound
        chunks, report, took = await run_in_threadpool(verified_put, body)
    else:
        async with staged_body(request, manager.staging, length) as body:
            chunks, report, took = await run_in_threadpool(verified_put, memoryview(body.numpy()))
    state.metrics.transfer.labels("put").observe(took)
    stored = sorted({logical_key(k) for res in report.per_tier.values() for k in res.stored})
    present = sorted(
        {logical_key(k) for res in report.per_tier.values() for k in res.present} - set(stored)
    )
    nbytes = sum(len(chunks[k]) for k in stored)
    state.metrics.transfer_bytes.labels("put").inc(nbytes)
    state.metrics.tenant_bytes.labels(tenant, "put").inc(nbytes)
    failed = {logical_key(k): why for k, why in report.failed.items()}
    if chunks and len(failed) == len(chunks):
        if all(why.startswith("conflict:") for why in failed.values()):
            raise RouteError(409, "every chunk is stored already with other content; chunks "
                             "are immutable: DELETE them first to replace them", "chunk_exists")
        raise _put_failed(report)
    return {"stored": stored, "present": present, "failed": failed}



