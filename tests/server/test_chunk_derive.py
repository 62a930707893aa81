"""Over real HTTP: ``POST /v1/chunks/{key}/derive`` cuts a run of a stored chunk's tokens
into a chunk of its own inside the service (nothing uploaded): exactly those tokens'
KV, checksummed, with its session; only from the caller's own tenant's chunks, only
where an exact copy is stored; refused clearly otherwise."""

from __future__ import annotations

import httpx
import pytest
import torch

from kvtier.chunk_format import chunk_view, encode_chunk, namespaced_key
from kvtier.client import ChunkOwner, Client
from kvtier.config import DEFAULT_TENANT, load_config
from kvtier.connectors.chunk_store import RemoteChunkStore
from kvtier.connectors.tiers.derived import TokenRange
from kvtier.policies.eviction import ChunkInfo
from kvtier.server.state import ServiceState
from tests.http_server import running
from tests.server.test_server_chunks import FP, _config, key
from tests.server.test_tenants import TOKENS


def kv_of(seed: int) -> torch.Tensor:
    return torch.randn(4, 2, 16, 2, 8, generator=torch.Generator().manual_seed(seed)).to(torch.float16)


def kv_in(blob: bytes) -> torch.Tensor:
    return chunk_view(torch.frombuffer(bytearray(blob), dtype=torch.uint8))[1]


@pytest.mark.parametrize("shm", [False, True])
def test_a_derived_chunk_is_the_sources_tokens_exactly(tmp_path, shm) -> None:
    state = ServiceState.sidecar(_config(tmp_path, max_body_bytes=1 << 20))
    kv = kv_of(1)
    with running(state) as url, Client(url, shm=shm) as c:
        c.put_chunk(key(1), encode_chunk(key(1), FP, kv))
        got = c.derive_chunk(key(2), key(1), 4, 8, ChunkOwner("alice", 5))
        assert got == {"key": key(2), "status": "stored", "tiers": ["cpu"]}
        assert torch.equal(kv_in(c.get_chunk(key(2))), kv[:, :, 4:12])
        info = state.manager.tiers[0].chunk_info(namespaced_key(DEFAULT_TENANT, key(2)))
        assert (info.session, info.index) == (f"{DEFAULT_TENANT}:alice", 5)
        assert c.derive_chunk(key(2), key(1), 4, 8)["status"] == "present"
        assert c.derive_chunk(key(3), key(9), 0, 8) is None  # no such source: the caller uploads
        assert not c.has_chunk(key(3))
        resp = httpx.post(f"{url}/v1/chunks/{key(3)}/derive",
                          json={"source": key(1), "first_token": 10, "tokens": 8})
        assert resp.status_code == 400 and "holds 16" in resp.json()["error"]["message"]
        for bad in ({"source": key(1), "first_token": -1, "tokens": 8},
                    {"source": key(1), "first_token": 0, "tokens": 0},
                    {"source": "no/such", "first_token": 0, "tokens": 1}):
            assert httpx.post(f"{url}/v1/chunks/{key(3)}/derive", json=bad).status_code == 422
        assert not c.has_chunk(key(3))


def test_a_connector_store_derives_through_the_service(tmp_path) -> None:
    state = ServiceState.sidecar(_config(tmp_path, max_body_bytes=1 << 20))
    kv = kv_of(2)
    with running(state) as url:
        store = RemoteChunkStore(url, 1 << 16, shm=True)
        try:
            Client(url).put_chunk(key(1), encode_chunk(key(1), FP, kv))
            assert store.derive(key(2), key(1), TokenRange(0, 4), ChunkInfo(0, "conv", 2))
            assert not store.derive(key(3), key(8), TokenRange(0, 4))
            with store.get_into([key(2)]) as lent:
                lent[0].verify()
                assert torch.equal(lent[0].kv, kv[:, :, :4])
        finally:
            store.client.close()


def test_a_tenant_cannot_cut_another_tenants_chunk(tmp_path) -> None:
    cfg = load_config(environ={}, overrides={
        "tiers": {"cpu_bytes": 8 << 20, "disk_dir": str(tmp_path / "c"), "disk_bytes": 64 << 20,
                  "disk_fsync": False},
        "server": {"auth_token": "the-admin-token", "tokens": TOKENS}})
    with running(ServiceState.sidecar(cfg)) as url, \
            Client(url, token="alpha-writer-1") as a, Client(url, token="beta-writer-01") as b, \
            Client(url, token="alpha-reader-1") as reader:
        a.put_chunk(key(1), encode_chunk(key(1), FP, kv_of(3)))
        assert b.derive_chunk(key(2), key(1), 0, 4) is None  # beta holds no such chunk
        assert not b.has_chunk(key(2)) and not a.has_chunk(key(2))
        with pytest.raises(Exception, match="403|scope"):
            reader.derive_chunk(key(2), key(1), 0, 4)  # a read-only token stores nothing
        assert a.derive_chunk(key(2), key(1), 0, 4)["status"] == "stored"
        assert not b.has_chunk(key(2))


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_a_derive_onto_a_key_holding_another_chunk_is_refused_as_a_put_is(tmp_path, tier) -> None:
    """One version per key: a derive onto a key that holds another chunk (in any tier) is
    409 ``chunk_exists`` and leaves it as it was; onto one holding the same chunk, present."""
    state = ServiceState.sidecar(_config(tmp_path, max_body_bytes=1 << 20))
    kv = kv_of(4)
    with running(state) as url, Client(url) as c:
        c.put_chunk(key(1), encode_chunk(key(1), FP, kv))
        other = kv_of(5)[:, :, :8].contiguous()
        c.put_chunk(key(2), encode_chunk(key(2), FP, other), tier=tier)
        resp = httpx.post(f"{url}/v1/chunks/{key(2)}/derive",
                          json={"source": key(1), "first_token": 0, "tokens": 8})
        assert resp.status_code == 409 and resp.json()["error"]["type"] == "chunk_exists"
        assert torch.equal(kv_in(c.get_chunk(key(2))), other)  # left as it was
        c.put_chunk(key(3), encode_chunk(key(3), FP, kv[:, :, 0:8].contiguous()), tier=tier)
        assert c.derive_chunk(key(3), key(1), 0, 8)["status"] == "present"
