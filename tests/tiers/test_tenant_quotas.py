"""Per-tenant byte quotas per tier: a tenant past its share pushes its own coldest chunks
down a tier (out of the last one), never another tenant's, and every chunk it still holds
reads back intact."""

from __future__ import annotations

import pytest
import torch

from kvtier.chunk_format import encode_chunk, namespaced_key, with_namespace
from kvtier.connectors.tiers.base import CHUNK_OVERHEAD_BYTES
from kvtier.connectors.tiers.blobs import get_blobs, get_each, put_blobs
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
CPU = SIZE + CHUNK_OVERHEAD_BYTES
"""What a chunk costs a quota in a CPU tier of SIZE-byte slots: its slot and index entry."""


def _cpu_disk(tmp_path, cpu_slots: int = 8) -> TierManager:
    cpu = CPUTier(cpu_slots * SIZE, SIZE)
    disk = DiskTier(tmp_path / "disk", 64 * SIZE, fsync=False)
    return TierManager([cpu, disk], fingerprint=FP)


def test_a_tenant_past_its_quota_pushes_its_own_coldest_chunks_down(tmp_path):
    m = _cpu_disk(tmp_path)
    m.quotas = {"alice": {"cpu": 3 * CPU}}
    try:
        bob = dict(_chunk("bob", 100 + i) for i in range(4))
        put_blobs(m, bob)
        alice = [_chunk("alice", i) for i in range(6)]
        for k, b in alice:
            assert put_blobs(m, {k: b}).ok
        cpu, disk = m.tiers
        assert cpu.occupancy(SIZE) == CPU
        assert cpu.namespace_held("alice")[0] == 3 * CPU
        assert cpu.namespace_held("bob")[0] == 4 * CPU  # bob's KV never made room for alice
        keys = [k for k, _ in alice]
        assert cpu.contains_prefix(keys[3:]) == 3  # the three newest stay in RAM
        assert disk.contains_prefix(keys[:3]) == 3  # the three oldest went down, not away
        assert m.stats.quota_evicted_bytes[("alice", "cpu")] == 3 * CPU
        assert m.tenant_bytes()[("alice", "disk")] == 3 * disk.occupancy(SIZE)
        got = get_each(m, keys)
        assert [b for b, _ in got] == [b for _, b in alice]  # every chunk reads back intact
    finally:
        m.close()


def test_recency_decides_which_of_the_tenants_chunks_go(tmp_path):
    m = _cpu_disk(tmp_path)
    m.quotas = {"alice": {"cpu": 2 * CPU}}
    try:
        (a, ab), (b, bb), (c, cb) = (_chunk("alice", i) for i in range(3))
        put_blobs(m, {a: ab, b: bb})
        get_blobs(m.tiers[0], [a])  # a is now alice's most recently used
        put_blobs(m, {c: cb})
        assert m.tiers[0].contains_prefix([a]) == 1 and m.tiers[0].contains_prefix([b]) == 0
        assert m.tiers[1].contains_prefix([b]) == 1
    finally:
        m.close()


def test_a_batch_bigger_than_the_whole_quota_is_refused_past_it(tmp_path):
    cpu = CPUTier(8 * SIZE, SIZE)
    m = TierManager([cpu], fingerprint=FP)
    m.quotas = {"alice": {"cpu": 2 * CPU}}
    try:
        chunks = dict(_chunk("alice", i) for i in range(3))
        report = put_blobs(m, chunks)
        assert len(report.failed) == 1
        assert "quota" in next(iter(report.failed.values()))
        assert cpu.namespace_held("alice")[0] == 2 * CPU
        again = put_blobs(m, dict(list(chunks.items())[:2]))  # present: no room made, none refused
        assert again.ok and cpu.namespace_held("alice")[0] == 2 * CPU
        assert m.stats.quota_evicted_bytes == {}
    finally:
        m.close()


def test_a_quota_does_not_touch_the_engines_own_chunks_or_unquoted_tenants(tmp_path):
    m = _cpu_disk(tmp_path, cpu_slots=16)
    m.quotas = {"alice": {"cpu": CPU}}
    try:
        bare = {f"{i:064x}": encode_chunk(f"{i:064x}", FP, torch.zeros(2, 2, 16, 1, 8))
                for i in range(200, 204)}
        put_blobs(m, bare)
        put_blobs(m, dict(_chunk("carol", i) for i in range(4)))
        put_blobs(m, dict(_chunk("alice", i) for i in range(2)))
        cpu = m.tiers[0]
        assert cpu.contains_prefix(list(bare)) == 4
        assert cpu.namespace_held("carol")[0] == 4 * CPU
        assert cpu.namespace_held("alice")[0] == CPU
        assert set(cpu.namespace_bytes()) == {"alice", "carol"}  # bare keys are no tenant's
    finally:
        m.close()


@pytest.mark.timeout(60)
def test_redis_quota_deletes_the_tenants_coldest_chunks(redis_server: RedisServer):
    tier = RedisTier(redis_server.url, prefix="quota:", timeout_s=2.0)
    m = TierManager([tier], fingerprint=FP)
    m.quotas = {"alice": {"redis": 2 * tier.occupancy(SIZE)}}
    try:
        put_blobs(m, dict(_chunk("bob", 100 + i) for i in range(3)))
        alice = [_chunk("alice", i) for i in range(4)]
        for k, b in alice:
            assert put_blobs(m, {k: b}).ok
        keys = [k for k, _ in alice]
        got = get_each(m, keys)
        assert [b is None for b, _ in got] == [True, True, False, False]
        assert [b for b, _ in got[2:]] == [b for _, b in alice[2:]]
        assert tier.namespace_held("alice")[0] == 2 * tier.occupancy(SIZE)
        assert tier.namespace_held("bob")[0] == 3 * tier.occupancy(SIZE)
        assert redis_server.client().exists(*(f"quota:{k}" for k, _ in alice[:2])) == 0
    finally:
        m.close()


# ------------------------------------------------------------------ the property
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

POLICIES = ["lru", "slru", "lfu", "arc", "cost-aware", "session-aware"]
TENANTS = ["alice", "bob", "mallory"]


def _sized_chunk(tenant: str, i: int, tokens: int) -> tuple[str, bytes]:
    key = f"{i:064x}"
    kv = torch.full((2, 2, tokens, 1, 8), float(i % 97))
    return namespaced_key(tenant, key), with_namespace(encode_chunk(key, FP, kv), tenant)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    policy=st.sampled_from(POLICIES),
    with_disk=st.booleans(),
    shares=st.lists(st.integers(1, 4), min_size=3, max_size=3),
    ops=st.lists(st.tuples(st.sampled_from(TENANTS), st.integers(1, 64), st.integers(1, 3)),
                 min_size=1, max_size=40),
)
def test_no_tenant_filling_its_share_ever_evicts_another_tenants_kv(
        tmp_path_factory, policy, with_disk, shares, ops):
    """Tenants with quotas that add up to no more than a tier holds, storing chunks of any
    size in any order under any eviction policy: a put by one tenant never removes a chunk
    of another from any tier (only its own coldest move down or out)."""
    slot = len(_sized_chunk("mallory", 0, 64)[1])
    charge = slot + CHUNK_OVERHEAD_BYTES  # a CPU chunk costs a slot, whatever its size
    slots = sum(shares)
    cpu = CPUTier(slots * slot, slot, eviction=policy)
    tiers: list = [cpu]
    disk_share = 4096 * 2 + CHUNK_OVERHEAD_BYTES  # one of the largest chunks, as files go
    if with_disk:
        tiers.append(DiskTier(tmp_path_factory.mktemp("quota-disk"), sum(shares) * disk_share,
                              fsync=False, eviction=policy))
    m = TierManager(tiers, fingerprint=FP)
    m.quotas = {t: {"cpu": n * charge, "disk": n * disk_share} for t, n in zip(TENANTS, shares, strict=True)}
    try:
        held: dict[str, set[str]] = {t: set() for t in TENANTS}  # keys each tenant put
        counter = 0
        for tenant, tokens, count in ops:
            batch = {}
            for _ in range(count):
                k, b = _sized_chunk(tenant, counter, tokens)
                batch[k] = b
                counter += 1
            before = {t: {tier.name: {k for k in held[t] if tier.contains_prefix([k])}
                          for tier in m.tiers} for t in TENANTS if t != tenant}
            put_blobs(m, batch)
            held[tenant].update(batch)
            for other, where in before.items():
                for tier in m.tiers:
                    kept = {k for k in where[tier.name] if tier.contains_prefix([k])}
                    assert kept == where[tier.name], (
                        f"{tenant}'s put removed {other}'s chunks from {tier.name} ({policy})")
        for t in TENANTS:  # and every tenant is within its quota everywhere
            for tier in m.tiers:
                assert tier.namespace_held(t)[0] <= m.quotas[t][tier.name]
    finally:
        m.close()
