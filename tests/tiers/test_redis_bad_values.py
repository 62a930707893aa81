"""Values under chunk keys in a real Redis that are not what the tier stored: one grown
far past what its header says (SETRANGE), one of another Redis type (a list, a hash).
Each is a miss of its own key only (the other keys of the batch are served), costs no
buffer of its size, and is deleted, so the key is storable again; on a single server
(whole chunks read into staging buffers, and layer ranges) and on a Redis Cluster."""

from __future__ import annotations

import tracemalloc

import pytest
import redis
import torch

from kvtier.chunk_format import encode_chunk
from kvtier.connectors.tiers.blobs import get_blobs, put_blobs
from kvtier.connectors.tiers.host_buffers import StagingPool
from kvtier.connectors.tiers.redis_tier import RedisTier
from tests import redis_servers
from tests.redis_servers import RedisClusterProcs, RedisServer

redis_server = redis_servers.redis_server  # shared fixtures, used by name
redis_cluster = redis_servers.redis_cluster

pytestmark = pytest.mark.timeout(120)
FP = b"model-fp"
GROWN = 64 << 20
"""What a value is grown to (Redis holds it; the tier must not take a buffer of it)."""


def key(i: int) -> str:
    return f"{i:064x}"


def chunk(i: int) -> bytes:
    g = torch.Generator().manual_seed(i)
    return encode_chunk(key(i), FP, torch.randn(4, 2, 16, 2, 8, generator=g).to(torch.bfloat16))


def spoil(r: redis.Redis, prefix: str, how: str) -> None:
    """Make key(2)'s value bad in way ``how``."""
    name = prefix + key(2)
    if how == "grown":
        r.setrange(name, GROWN - 1, b"x")  # the header still says 4 KiB
    else:
        r.delete(name)
        if how == "list":
            r.rpush(name, b"a", b"b")
        else:
            r.hset(name, "field", b"value")


def whole(t: RedisTier, ids: list[int]) -> list[bytes | None]:
    with t.lease([key(i) for i in ids]) as views:
        return [None if v is None else bytes(v.numpy()) for v in views]


@pytest.mark.parametrize("how", ["grown", "list", "hash"])
def test_a_bad_value_is_one_miss_of_a_whole_chunk_batch(redis_server: RedisServer, how: str) -> None:
    staging = StagingPool()
    with RedisTier(redis_server.url, timeout_s=2.0, staging=staging) as t:
        assert put_blobs(t, {key(i): chunk(i) for i in (1, 2, 3)}).ok
        r = redis_server.client()
        spoil(r, "kvtier:", how)
        assert whole(t, [1, 2, 3]) == [chunk(1), None, chunk(3)]
        assert staging.idle_bytes <= 2 << 20 and staging.lent == 0  # nothing sized by it
        assert not r.exists("kvtier:" + key(2)) and t.stats.corrupt == 1
        assert put_blobs(t, {key(2): chunk(2)}).stored == [key(2)]  # storable again
        assert whole(t, [1, 2, 3]) == [chunk(1), chunk(2), chunk(3)]


@pytest.mark.parametrize("how", ["grown", "list"])
def test_a_bad_value_is_one_miss_of_a_layer_range_batch(redis_server: RedisServer, how: str) -> None:
    with RedisTier(redis_server.url, timeout_s=2.0) as t:
        assert put_blobs(t, {key(i): chunk(i) for i in (1, 2, 3)}).ok
        r = redis_server.client()
        spoil(r, "kvtier:", how)
        got = get_blobs(t, [key(1), key(2), key(3)], layers=(1, 3))
        assert got[0] is not None and got[1] is None and got[2] is not None
        assert not r.exists("kvtier:" + key(2))
        assert put_blobs(t, {key(2): chunk(2)}).stored == [key(2)]


@pytest.mark.parametrize("how", ["grown", "list"])
def test_a_bad_value_on_a_cluster_is_read_by_its_header(redis_cluster: RedisClusterProcs,
                                                        how: str) -> None:
    with RedisTier(redis_cluster.url, timeout_s=2.0, prefix=f"kvtier-bad-{how}:") as t:
        t.delete([key(i) for i in (1, 2, 3)])
        assert put_blobs(t, {key(i): chunk(i) for i in (1, 2, 3)}).ok
        r = redis.RedisCluster(host="127.0.0.1", port=redis_cluster.nodes[0].port)
        spoil(r, t.prefix, how)
        tracemalloc.start()
        try:
            assert whole(t, [1, 2, 3]) == [chunk(1), None, chunk(3)]
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < GROWN // 4  # the grown value was never fetched whole
        assert not r.exists(t.prefix + key(2))
        assert put_blobs(t, {key(2): chunk(2)}).stored == [key(2)]
        r.close()
