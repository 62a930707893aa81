"""Per-tenant byte quotas per tier: a tenant past its share pushes its own coldest chunks
down a tier (out of the last one), never another tenant's, and every chunk it still holds
reads back intact."""

from __future__ import annotations

import pytest
import torch

from kvtier.chunk_format import encode_chunk, namespaced_key, with_namespace
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.connectors.tiers.redis_tier import RedisTier
from tests import redis_servers
from tests.redis_servers import RedisServer

redis_server = redis_servers.redis_server  # shared fixture, used by name

FP = b"f" * 16


def _chunk(tenant: str, i: int) -> tuple[str, bytes]:
    """A tenant's chunk as the service stores it: under its namespace, naming it."""
    key = f"{i:064x}"
    kv = torch.full((2, 2, 16, 1, 8), float(i))
    return namespaced_key(tenant, key), with_namespace(encode_chunk(key, FP, kv), tenant)


SIZE = len(_chunk("alice", 0)[1])
assert all(len(_chunk(t, 0)[1]) == SIZE for t in ("a", "bob", "carol", "mallory"))


def _cpu_disk(tmp_path, cpu_slots: int = 8) -> TierManager:
    cpu = CPUTier(cpu_slots * SIZE, SIZE)
    disk = DiskTier(tmp_path / "disk", 64 * SIZE, fsync=False)
    return TierManager([cpu, disk], fingerprint=FP)


def test_a_tenant_past_its_quota_pushes_its_own_coldest_chunks_down(tmp_path):
    m = _cpu_disk(tmp_path)
    m.quotas = {"alice": {"cpu": 3 * SIZE}}
    try:
        bob = dict(_chunk("bob", 100 + i) for i in range(4))
        m.put(bob)
        alice = [_chunk("alice", i) for i in range(6)]
        for k, b in alice:
            assert m.put({k: b}).ok
        cpu, disk = m.tiers
        assert cpu.namespace_held("alice")[0] == 3 * SIZE
        assert cpu.namespace_held("bob")[0] == 4 * SIZE  # bob's KV never made room for alice
        keys = [k for k, _ in alice]
        assert cpu.contains_prefix(keys[3:]) == 3  # the three newest stay in RAM
        assert disk.contains_prefix(keys[:3]) == 3  # the three oldest went down, not away
        assert m.stats.quota_evicted_bytes[("alice", "cpu")] == 3 * SIZE
        assert m.tenant_bytes()[("alice", "disk")] == 3 * SIZE
        got = m.get_each(keys)
        assert [b for b, _ in got] == [b for _, b in alice]  # every chunk reads back intact
    finally:
        m.close()


def test_recency_decides_which_of_the_tenants_chunks_go(tmp_path):
    m = _cpu_disk(tmp_path)
    m.quotas = {"alice": {"cpu": 2 * SIZE}}
    try:
        (a, ab), (b, bb), (c, cb) = (_chunk("alice", i) for i in range(3))
        m.put({a: ab, b: bb})
        m.tiers[0].get([a])  # a is now alice's most recently used
        m.put({c: cb})
        assert m.tiers[0].contains_prefix([a]) == 1 and m.tiers[0].contains_prefix([b]) == 0
        assert m.tiers[1].contains_prefix([b]) == 1
    finally:
        m.close()


def test_a_batch_bigger_than_the_whole_quota_is_refused_past_it(tmp_path):
    cpu = CPUTier(8 * SIZE, SIZE)
    m = TierManager([cpu], fingerprint=FP)
    m.quotas = {"alice": {"cpu": 2 * SIZE}}
    try:
        chunks = dict(_chunk("alice", i) for i in range(3))
        report = m.put(chunks)
        assert len(report.failed) == 1
        assert "quota" in next(iter(report.failed.values()))
        assert cpu.namespace_held("alice")[0] == 2 * SIZE
        again = m.put(dict(list(chunks.items())[:2]))  # present: no room made, none refused
        assert again.ok and cpu.namespace_held("alice")[0] == 2 * SIZE
        assert m.stats.quota_evicted_bytes == {}
    finally:
        m.close()


def test_a_quota_does_not_touch_the_engines_own_chunks_or_unquoted_tenants(tmp_path):
    m = _cpu_disk(tmp_path, cpu_slots=16)
    m.quotas = {"alice": {"cpu": SIZE}}
    try:
        bare = {f"{i:064x}": encode_chunk(f"{i:064x}", FP, torch.zeros(2, 2, 16, 1, 8))
                for i in range(200, 204)}
        m.put(bare)
        m.put(dict(_chunk("carol", i) for i in range(4)))
        m.put(dict(_chunk("alice", i) for i in range(2)))
        cpu = m.tiers[0]
        assert cpu.contains_prefix(list(bare)) == 4
        assert cpu.namespace_held("carol")[0] == 4 * SIZE
        assert cpu.namespace_held("alice")[0] == SIZE
        assert set(cpu.namespace_bytes()) == {"alice", "carol"}  # bare keys are no tenant's
    finally:
        m.close()


@pytest.mark.timeout(60)
def test_redis_quota_deletes_the_tenants_coldest_chunks(redis_server: RedisServer):
    tier = RedisTier(redis_server.url, prefix="quota:", timeout_s=2.0)
    m = TierManager([tier], fingerprint=FP)
    m.quotas = {"alice": {"redis": 2 * SIZE}}
    try:
        m.put(dict(_chunk("bob", 100 + i) for i in range(3)))
        alice = [_chunk("alice", i) for i in range(4)]
        for k, b in alice:
            assert m.put({k: b}).ok
        keys = [k for k, _ in alice]
        got = m.get_each(keys)
        assert [b is None for b, _ in got] == [True, True, False, False]
        assert [b for b, _ in got[2:]] == [b for _, b in alice[2:]]
        assert tier.namespace_held("alice")[0] == 2 * SIZE
        assert tier.namespace_held("bob")[0] == 3 * SIZE
        assert redis_server.client().exists(*(f"quota:{k}" for k, _ in alice[:2])) == 0
    finally:
        m.close()
