"""Over real HTTP: a chunk's session and place reach the service's tiers, so a sidecar's
session-aware eviction ranks a conversation's chunks as its own, as in-process tiers do."""

from __future__ import annotations

import httpx
import pytest

from kvtier.chunk_format import namespaced_key
from kvtier.client import ChunkOwner, Client
from kvtier.config import DEFAULT_TENANT
from kvtier.connectors.chunk_store import RemoteChunkStore
from kvtier.connectors.tiers.base import ChunkWrite
from kvtier.policies.eviction import ChunkInfo
from kvtier.server.state import ServiceState
from tests.http_server import running
from tests.server.test_server_chunks import _config, chunk, key


def _owner_in(state: ServiceState, k: str) -> tuple[object, int] | None:
    info = state.manager.tiers[0].chunk_info(namespaced_key(DEFAULT_TENANT, k))
    return None if info is None else (info.session, info.index)


@pytest.mark.parametrize("shm", [False, True])
def test_a_chunks_session_and_place_reach_the_service_tiers(tmp_path, shm) -> None:
    state = ServiceState.sidecar(_config(tmp_path, max_body_bytes=1 << 20))
    with running(state) as url, Client(url, shm=shm) as kv:
        kv.put_chunk(key(1), chunk(key(1)), owner=ChunkOwner("alice", 3))
        kv.put_chunk(key(2), chunk(key(2), seed=2))  # no owner: nothing said
        kv.put_chunk(key(3), chunk(key(3), seed=3), owner=ChunkOwner("bøb", 1))
        assert _owner_in(state, key(1)) == (f"{DEFAULT_TENANT}:alice", 3)
        assert _owner_in(state, key(2)) is None
        session, place = _owner_in(state, key(3))  # not printable ASCII: its digest
        assert place == 1 and len(str(session)) == len(DEFAULT_TENANT) + 1 + 64
        assert kv.get_chunk(key(1)) is not None  # stored and served as ever


def test_a_connector_through_the_service_saves_with_its_session(tmp_path) -> None:
    state = ServiceState.sidecar(_config(tmp_path, max_body_bytes=1 << 20))
    with running(state) as url:
        store = RemoteChunkStore(url, 1 << 16)
        try:
            blob = chunk(key(7), seed=7)
            write = ChunkWrite.of_blob(key(7), blob, ChunkInfo(len(blob), "conv-9", 4))
            assert store.put_from([write]) == {}
        finally:
            store.client.close()
        assert _owner_in(state, key(7)) == (f"{DEFAULT_TENANT}:conv-9", 4)


def test_a_bad_place_or_session_is_refused(tmp_path) -> None:
    state = ServiceState.sidecar(_config(tmp_path, max_body_bytes=1 << 20))
    with running(state) as url:
        body = chunk(key(4), seed=4)
        for params in ({"session": "a", "place": -1}, {"session": ""}, {"session": "x" * 257}):
            resp = httpx.put(f"{url}/v1/chunks/{key(4)}", params=params, content=body)
            assert resp.status_code == 422, params
        assert _owner_in(state, key(4)) is None
