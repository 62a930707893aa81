"""What a reader budgets before it reads: the stack answers each stored chunk's size from
the tiers' indexes without reading it, a prefetch reads a key named twice once, and the
staging pool keeps no more idle buffers than the cap its owner ties to its budgets."""

from __future__ import annotations

import torch

from kvtier.chunk_format import encode_chunk
from kvtier.connectors.tiers.blobs import put_blobs
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.host_buffers import StagingPool
from kvtier.connectors.tiers.manager import TierManager

MiB = 1 << 20


def _blob(i: int, tokens: int) -> tuple[str, bytes]:
    key = f"{i:032x}"
    kv = torch.randn(4, 2, tokens, 2, 8, generator=torch.Generator().manual_seed(i))
    return key, encode_chunk(key, b"fp", kv.to(torch.float16))


def _stack(tmp_path) -> TierManager:
    return TierManager([CPUTier(4 * MiB, 256 << 10),
                        DiskTier(tmp_path / "d", 64 * MiB, fsync=False)], fingerprint=b"fp")


def test_sizes_come_from_the_index_of_the_tier_holding_each_key(tmp_path):
    manager = _stack(tmp_path)
    cpu, disk = manager.tiers
    try:
        (k1, b1), (k2, b2), (k3, _) = _blob(1, 64), _blob(2, 4096), _blob(3, 16)
        put_blobs(manager, {k1: b1})
        put_blobs(manager, {k2: b2}, tier="disk")
        reads = disk.stats.gets
        where = manager.locate([k1, k2, k3])
        assert where == [0, 1, None]
        assert manager.sizes([k1, k2, k3], where) == [len(b1), len(b2), None]
        assert disk.stats.gets == reads  # nothing was read to answer
    finally:
        manager.close()


def test_a_prefetch_reads_a_key_named_twice_once(tmp_path):
    manager = _stack(tmp_path)
    cpu, disk = manager.tiers
    try:
        k, b = _blob(1, 256)
        put_blobs(manager, {k: b}, tier="disk")
        reads = disk.stats.gets
        assert manager.prefetch([k] * 8) == 1
        assert disk.stats.gets == reads + 1
        assert manager.locate([k]) == [0]
    finally:
        manager.close()


def test_the_staging_pool_keeps_idle_no_more_than_its_cap():
    pool = StagingPool(max_idle_bytes=1 << 30, pin=False)
    bufs = [pool.acquire(2 * MiB) for _ in range(3)]
    assert pool.lent_bytes == pool.peak_lent_bytes == 6 * MiB
    for buf in bufs:
        pool.release(buf)
    assert pool.idle_bytes == 6 * MiB and pool.lent_bytes == 0
    pool.cap_idle(3 * MiB)  # what was kept past the new cap is freed now
    assert pool.idle_bytes == 2 * MiB and pool.max_idle_bytes == 3 * MiB
    more = [pool.acquire(2 * MiB) for _ in range(3)]
    assert pool.allocations == 5  # the one idle buffer was reused
    for buf in more:
        pool.release(buf)
    assert pool.idle_bytes <= 3 * MiB and pool.peak_lent_bytes == 6 * MiB
    pool.close()
