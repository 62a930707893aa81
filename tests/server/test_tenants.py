"""Writers that cannot poison, and tenants whose chunks never meet.

The attack that worked before: forged chunks (valid checksums, the engine's own
fingerprint, zeroed KV) PUT over HTTP under the predictable keys of a session's prompt were
taken as "present" when the engine offloaded, then restored, and changed the reply. Now
every client's chunk lives in its tenant's namespace, the engine's in none a client can
reach, and tokens carry scopes."""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch

from kvtier.chunk_format import encode_chunk
from kvtier.client import Client, ServiceError
from kvtier.config import load_config
from kvtier.connectors.tiers.blobs import get_each, put_blobs
from kvtier.engine.engine import Engine
from kvtier.engine.sampling import SamplingParams
from kvtier.server.state import ServiceState
from tests import redis_servers
from tests.engine_config import engine_config
from tests.http_server import running
from tests.server import test_server_engine
from tests.server.test_server_chunks import chunk, key, served
from tests.server.test_server_engine import GREEDY, Q1, Q2, SYSTEM

model_dir = test_server_engine.model_dir  # the same tiny model, used by name


def test_forged_chunks_under_the_engines_keys_never_reach_a_turn(model_dir, tmp_path):
    plain = Engine(model_dir, engine_config(num_blocks=128, tiers=None))
    p = SamplingParams(max_tokens=8)
    plain.chat("s", Q1, p, system=SYSTEM)
    expected = plain.chat("s", Q2, p)
    plain.close()

    cfg = load_config(environ={}, overrides={
        "pool": {"num_blocks": 128}, "chunk_tokens": 64,
        "tiers": {"cpu_bytes": 16 << 20, "disk_dir": str(tmp_path / "chunks"),
                  "disk_bytes": 64 << 20, "disk_fsync": False}})
    state = ServiceState.with_engine(cfg, model_dir)
    eng = state.engine.engine
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q1}]
    with running(state) as url, Client(url) as kv:
        r1 = kv.chat(history, session_id="victim", **GREEDY)
        # The attacker computes the keys the engine will store the session under (they are
        # chained hashes of its tokens under the model's fingerprint, which the attacker
        # knows), and PUTs zeroed KV with valid checksums under every one of them.
        ids = eng.sessions["victim"].token_ids
        storage = eng.runner.pool.storage
        forged = {}
        for ck in eng.kv._keys(ids):
            shape = (storage.num_layers, 2, ck.end - ck.start, storage.num_kv_heads,
                     storage.head_dim)
            zeros = torch.zeros(shape, dtype=storage.kv.dtype)
            forged[ck.key] = encode_chunk(ck.key, eng.runner.fingerprint, zeros)
        assert len(forged) >= 2
        for k, blob in forged.items():
            assert kv.put_chunk(k, blob)["status"] == "stored"  # accepted: in its namespace
        off = kv.offload("victim", tier="disk")
        assert off["stored_tokens"] > 0 and off["bytes"] > 0  # the engine stored its own
        history += [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                    {"role": "user", "content": Q2}]
        r2 = kv.chat(history, session_id="victim", **GREEDY)
        assert r2["kvtier"]["restored_tokens"] == off["stored_tokens"]
        # The client's own chunks are still its own to read back, forged as they are.
        k0 = next(iter(forged))
        assert kv.get_chunk(k0) == served(forged[k0])
    state.close()
    assert r2["choices"][0]["message"]["content"] == expected.text


redis_server = redis_servers.redis_server  # shared fixture, used by name

TOKENS = [
    {"token": "alpha-writer-1", "tenant": "alpha", "scopes": ["read", "write"]},
    {"token": "alpha-reader-1", "tenant": "alpha", "scopes": ["read"]},
    {"token": "beta-writer-01", "tenant": "beta", "scopes": ["read", "write"]},
    {"token": "chat-only-0001", "tenant": "gamma", "scopes": ["chat"]},
]


@pytest.fixture
def tenants(tmp_path):
    cfg = load_config(environ={}, overrides={
        "tiers": {"cpu_bytes": 8 << 20, "disk_dir": str(tmp_path / "c"), "disk_bytes": 64 << 20,
                  "disk_fsync": False},
        "server": {"auth_token": "the-admin-token", "tokens": TOKENS}})
    with running(ServiceState.sidecar(cfg)) as url:
        yield url


def test_tenants_never_see_or_overwrite_each_others_chunks(tenants):
    url = tenants
    mine, theirs = chunk(key(1), seed=1), chunk(key(1), seed=2)
    with Client(url, token="alpha-writer-1") as a, Client(url, token="beta-writer-01") as b:
        assert a.put_chunk(key(1), mine)["status"] == "stored"
        assert not b.has_chunk(key(1)) and b.lookup([key(1)]).length == 0
        assert b.get_chunk(key(1)) is None  # a 404
        assert b.put_chunk(key(1), theirs)["status"] == "stored"  # not "present": its own
        assert a.get_chunk(key(1)) == served(mine, "alpha")
        assert b.get_chunk(key(1)) == served(theirs, "beta")
        assert b.delete_chunk(key(1)) and a.get_chunk(key(1)) == served(mine, "alpha")
        got = b.put_chunks({key(2): chunk(key(2))})
        assert got["stored"] == [key(2)] and a.get_chunks([key(2)]) == [None]
        assert b.get_chunks([key(2)]) == [served(chunk(key(2)), "beta")]


def test_scopes_limit_what_a_token_may_do(tenants):
    url = tenants
    with Client(url, token="alpha-writer-1") as a:
        a.put_chunk(key(1), chunk(key(1)))
    with Client(url, token="alpha-reader-1") as r:
        assert r.get_chunk(key(1)) == served(chunk(key(1)), "alpha")  # the same tenant's
        with pytest.raises(ServiceError) as err:
            r.put_chunk(key(3), chunk(key(3)))
        assert err.value.status == 403 and "'write' scope" in err.value.message
    headers = {"Authorization": "Bearer chat-only-0001"}
    assert httpx.get(f"{url}/v1/chunks/{key(1)}", headers=headers).status_code == 403
    assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 200
    for token, status in (("alpha-writer-1", 403), ("the-admin-token", 200)):
        r = httpx.get(f"{url}/v1/stats", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == status
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer the-admin-token"})
    assert 'kvtier_tenant_transfer_bytes_total{direction="put",tenant="alpha"}' in metrics.text


def test_a_tenant_name_or_token_that_cannot_be_used_is_a_config_error():
    from kvtier.errors import ConfigError

    for bad in ({"token": "short", "tenant": "a"}, {"token": "long-enough", "tenant": "a.b"},
                {"token": "long-enough", "tenant": "a", "scopes": ["root"]}):
        with pytest.raises(ConfigError):
            load_config(environ={}, overrides={"server": {"tokens": [bad]}})


def test_quotas_hold_per_tenant_and_show_in_stats_and_metrics(tmp_path):
    """Quotas charge what a chunk takes: a whole CPU slot (64 KiB here) however small the
    chunk, whole disk blocks, and an index entry each."""
    from kvtier.connectors.tiers.base import CHUNK_OVERHEAD_BYTES

    size = len(served(chunk(key(0)), "alpha"))  # as stored: naming its tenant
    assert size == len(served(chunk(key(0)), "beta"))
    slot = 64 << 10
    cpu_charge = slot + CHUNK_OVERHEAD_BYTES
    disk_charge = -(-size // 4096) * 4096 + CHUNK_OVERHEAD_BYTES
    cfg = load_config(environ={}, overrides={
        "tiers": {"cpu_bytes": 64 << 20, "disk_dir": str(tmp_path / "c"), "disk_bytes": 64 << 20,
                  "disk_fsync": False},
        "server": {"auth_token": "the-admin-token", "tokens": TOKENS, "chunk_slot_bytes": slot,
                   "quotas": {"alpha": {"cpu": 2 * cpu_charge}}}})
    with running(ServiceState.sidecar(cfg)) as url:
        with Client(url, token="alpha-writer-1") as a, Client(url, token="beta-writer-01") as b:
            for i in range(5):
                assert a.put_chunk(key(i), chunk(key(i), seed=i))["status"] == "stored"
                assert b.put_chunk(key(i), chunk(key(i), seed=10 + i))["status"] == "stored"
            assert [a.get_chunk(key(i)) for i in range(5)] == [
                served(chunk(key(i), seed=i), "alpha") for i in range(5)]
            assert [b.get_chunk(key(i)) for i in range(5)] == [
                served(chunk(key(i), seed=10 + i), "beta") for i in range(5)]
        with Client(url, token="the-admin-token") as admin:
            rows = {(r["tenant"], r["tier"]): r for r in admin.stats()["tenants"]}
            assert rows[("alpha", "cpu")]["bytes"] <= 2 * cpu_charge
            assert rows[("alpha", "cpu")]["quota_bytes"] == 2 * cpu_charge
            assert rows[("alpha", "cpu")]["quota_evicted_bytes"] >= 3 * cpu_charge
            assert rows[("alpha", "disk")]["bytes"] >= 3 * disk_charge  # pushed down, not lost
            assert rows[("beta", "cpu")]["bytes"] == 5 * cpu_charge  # never made room for alpha
            text = admin.metrics()
        assert f'kvtier_tenant_quota_bytes{{tenant="alpha",tier="cpu"}} {float(2 * cpu_charge)}' in text
        assert 'kvtier_tenant_stored_bytes{tenant="beta",tier="cpu"}' in text


def test_a_chunk_copied_into_another_tenants_name_is_never_served_to_it(tmp_path):
    """The namespace is inside the checksummed header: alice's chunk file copied to bob's
    file name (or her Redis value to his key) is a miss for bob, never alice's KV, and a
    header edited to name bob fails its checksum."""
    disk = tmp_path / "c"
    cfg = load_config(environ={}, overrides={
        "tiers": {"cpu_bytes": 0, "disk_dir": str(disk), "disk_bytes": 64 << 20,
                  "disk_fsync": False},
        "server": {"auth_token": "the-admin-token", "tokens": TOKENS}})
    blob = chunk(key(1), seed=1)
    with running(ServiceState.sidecar(cfg)) as url, Client(url, token="alpha-writer-1") as a:
        assert a.put_chunk(key(1), blob)["status"] == "stored"
    (alpha_file,) = disk.rglob(f"alpha.{key(1)}.kvc")
    shutil.copy(alpha_file, alpha_file.with_name(f"beta.{key(1)}.kvc"))
    forged = bytearray(alpha_file.read_bytes())
    at = forged.index(b"alpha")  # the namespace, renamed in place: same length
    forged[at : at + 5] = b"gamma"
    (alpha_file.with_name(f"gamma.{key(1)}.kvc")).write_bytes(forged)
    with running(ServiceState.sidecar(cfg)) as url:  # a restart rebuilds the index from files
        with Client(url, token="beta-writer-01") as b:
            assert b.get_chunk(key(1)) is None
            assert b.put_chunk(key(1), chunk(key(1), seed=2))["status"] == "stored"
            assert b.get_chunk(key(1)) == served(chunk(key(1), seed=2), "beta")
        with Client(url, token="alpha-writer-1") as a:
            assert a.get_chunk(key(1)) == served(blob, "alpha")


def test_a_chunk_naming_another_tenant_is_refused_by_every_tier(tmp_path, redis_server):
    import redis

    from kvtier.chunk_format import namespaced_key
    from kvtier.connectors.tiers.cpu_tier import CPUTier
    from kvtier.connectors.tiers.disk_tier import DiskTier
    from kvtier.connectors.tiers.manager import TierManager
    from kvtier.connectors.tiers.redis_tier import RedisTier

    alices = served(chunk(key(1)), "alice")
    bobs_key = namespaced_key("bob", key(1))
    for tier in (CPUTier(1 << 20, 64 << 10), DiskTier(tmp_path / "d", fsync=False),
                 RedisTier(redis_server.url)):
        try:  # every tier checks what it admits: refused outright
            res = put_blobs(tier, {bobs_key: alices})
            assert res.stored == [] and "another tenant" in res.failed[bobs_key], tier.name
            assert not tier.contains_prefix([bobs_key])
        finally:
            tier.close()
    # A Redis value can be written by anyone who reaches the server: checked on read, a miss.
    manager = TierManager([RedisTier(redis_server.url)])
    try:
        raw = redis.Redis.from_url(redis_server.url)
        raw.set(manager.tiers[0].prefix + bobs_key, alices)
        raw.close()
        assert get_each(manager, [bobs_key]) == [(None, None)]
        with manager.lease_chunks([bobs_key]) as (lent,):
            assert lent is None
    finally:
        manager.close()


def test_a_chat_tenants_sessions_are_stored_in_and_charged_to_its_namespace(model_dir, tmp_path):
    """A chat-only tenant's offloaded sessions live in its own namespace, count against its
    quota and push its own chunks down, never another tenant's (before: stored under the
    engine's keys, charged to no one, and able to evict a quota-protected tenant's KV)."""
    cfg = load_config(environ={}, overrides={
        "pool": {"num_blocks": 128}, "chunk_tokens": 64,
        "tiers": {"cpu_bytes": 8 << 20, "cpu_eviction": "lru", "disk_dir": str(tmp_path / "c"),
                  "disk_bytes": 64 << 20, "disk_fsync": False},
        "server": {"auth_token": "the-admin-token", "tokens": TOKENS}})
    state = ServiceState.with_engine(cfg, model_dir)
    slot = state.manager.tiers[0].slot_bytes
    charge = state.manager.tiers[0].occupancy(1)
    cfg.server.quotas = {"gamma": {"cpu": 2 * charge}}
    state.manager.quotas = {"gamma": {"cpu": 2 * charge}}
    slots = (8 << 20) // slot
    with running(state) as url:
        fp = state.engine.engine.runner.fingerprint  # engine mode: chunks of its model only
        with Client(url, token="alpha-writer-1") as a:  # alpha fills the rest of the RAM tier
            mine = {key(i): encode_chunk(key(i), fp, torch.randn(2, 2, 16, 2, 16))
                    for i in range(slots - 2)}
            for k, b in mine.items():
                assert a.put_chunk(k, b)["status"] == "stored"
        with Client(url, token="chat-only-0001") as g, Client(url, token="the-admin-token") as admin:
            for n in range(3):  # gamma's sessions leave the pool for the RAM tier
                history = [{"role": "system", "content": SYSTEM * (n + 1)},
                           {"role": "user", "content": Q1}]
                g.chat(history, session_id=f"s{n}", **GREEDY)
                admin.offload(f"gamma:s{n}", tier="cpu")
            rows = {(r["tenant"], r["tier"]): r for r in admin.stats()["tenants"]}
        assert 0 < rows[("gamma", "cpu")]["bytes"] <= 2 * charge  # charged, within its quota
        assert rows[("gamma", "disk")]["bytes"] > 0  # the rest pushed down, not lost
        with Client(url, token="alpha-writer-1") as a:
            for k, b in mine.items():  # alpha's chunks all still in RAM
                r = a.http.get(f"/v1/chunks/{k}")
                assert r.headers["X-KVTier-Tier"] == "cpu" and r.content == served(b, "alpha")
        eng = state.engine.engine
        stored = {k for t in state.manager.tiers for k in t.namespace_bytes()}
        assert "gamma" in stored and eng.kv_namespace("gamma:s0") == "gamma"
        assert eng.kv_namespace("s0") is None  # a session of no tenant: the engine's keys
