"""The vLLM connector's worker side against real tiers (in-process, and a running
``kvtier serve`` over loopback HTTP), with vLLM's cache tensors faked: blocks saved and
loaded back bit-exact in both cache layouts, one copy and one checksum pass per block
each way, no chunk-sized allocation, and every bad block a load error (recomputed by
vLLM), never wrong KV."""

from __future__ import annotations

import tracemalloc

import pytest
import torch
import xxhash

from kvtier.chunk_format import max_chunk_bytes
from kvtier.config import KVTierConfig
from kvtier.connectors.chunk_store import LocalChunkStore, RemoteChunkStore
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.connectors.vllm_blocks import BlockTransfer, block_keys
from kvtier.connectors.vllm_worker import WorkerSide
from kvtier.server.state import ServiceState
from tests.connectors.vllm_fakes import BLOCK, LAYERS, caches
from tests.http_server import running

FP = b"vllm-v2|test-model|fp16|bs16"
NUM_BLOCKS = 12


def _chunk_bytes(kv: dict[str, torch.Tensor]) -> int:
    layer = next(iter(kv.values()))
    return max_chunk_bytes(LAYERS, LAYERS * layer.numel() * layer.element_size() // NUM_BLOCKS)


def _local(kv: dict[str, torch.Tensor], tmp_path, cpu_chunks: int = 16) -> LocalChunkStore:
    slot = _chunk_bytes(kv)
    return LocalChunkStore(TierManager([CPUTier(cpu_chunks * slot, slot), DiskTier(tmp_path / "d")]))


def _worker(store, kv: dict[str, torch.Tensor], fp: bytes = FP) -> WorkerSide:
    worker = WorkerSide(lambda: store, BLOCK, fp)
    worker.register(kv, NUM_BLOCKS)
    return worker


def _block(kv: dict[str, torch.Tensor], block_id: int) -> list[torch.Tensor]:
    """Block ``block_id`` of every layer (a copy)."""
    dim = 0 if next(iter(kv.values())).shape[0] == NUM_BLOCKS else 1
    return [t.select(dim, block_id).clone() for t in kv.values()]


def _transfer(keys: list[str], blocks: list[int]) -> list[BlockTransfer]:
    return [BlockTransfer("r", blocks, keys)]


def _strided(kv: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same caches as views into wider tensors: not contiguous (copied by torch, as a
    device cache is, not numpy)."""
    out = {}
    for name, t in kv.items():
        wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 8, dtype=t.dtype)
        out[name] = wide[..., : t.shape[-1]]
        out[name].copy_(t)
    return out


@pytest.mark.parametrize(("blocks_first", "strided"), [(True, False), (False, False), (False, True)])
def test_blocks_saved_and_loaded_back_are_bit_exact(tmp_path, blocks_first, strided):
    src = caches(NUM_BLOCKS, blocks_first, seed=1)
    dst = caches(NUM_BLOCKS, blocks_first, seed=2)
    if strided:
        src, dst = _strided(src), _strided(dst)
    store = _local(src, tmp_path, cpu_chunks=2)  # two in RAM, the third on disk
    keys = block_keys(list(range(3 * BLOCK)), BLOCK, FP)
    writer, reader = _worker(store, src), _worker(store, dst)
    writer.save(_transfer(keys, [4, 1, 7]))
    assert writer.stats.saved_blocks == 3 and store.lookup(keys) == 3
    reader.load(_transfer(keys, [0, 9, 3]))
    assert reader.take_load_errors() == set() and reader.stats.loaded_blocks == 3
    for s, d in ((4, 0), (1, 9), (7, 3)):
        for a, b in zip(_block(src, s), _block(dst, d), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("fused", [True, False])
def test_one_copy_and_one_checksum_pass_per_block_each_way(tmp_path, monkeypatch, fused):
    """Fused: each block gathered and hashed in one native call; the blocks checked and
    scattered in one native call per restore worker (the kernel hashes each layer once, as
    it copies); else numpy copies and one xxh3 per layer each way. Either way nothing
    chunk-sized is allocated and no staging buffer is used (chunks go straight into slots)."""
    from kvtier.gpu_pool.kernels import host_native

    if fused:
        assert host_native.AVAILABLE  # built at install (setup.py); CI has a compiler
    else:
        monkeypatch.setattr(host_native, "AVAILABLE", False)
    big = {"heads": 8, "dim": 128}  # chunks of 200 KB: far above the Python objects a step makes
    src, dst = caches(NUM_BLOCKS, True, seed=3, **big), caches(NUM_BLOCKS, True, seed=4, **big)
    store = _local(src, tmp_path)
    keys = block_keys(list(range(8 * BLOCK)), BLOCK, FP)
    writer, reader = _worker(store, src), _worker(store, dst)
    writer.save(_transfer(keys[:1], [0]))  # warm the arena
    calls = {"xxh3": 0, "gather": 0, "scatter": 0}
    layer_bytes = _block(src, 0)[0].numel() * 2

    def counting(name, fn, counts=lambda *a: True):
        def wrapped(*args):
            calls[name] += bool(counts(*args))
            return fn(*args)
        return wrapped

    # passes over KV (a header's own checksum is tens of bytes)
    monkeypatch.setattr(xxhash, "xxh3_64_intdigest", counting(
        "xxh3", xxhash.xxh3_64_intdigest, lambda data: len(memoryview(data).cast("B")) >= layer_bytes))
    if fused:
        class Native:  # the compiled kernels, counted
            gather_hash = staticmethod(counting("gather", host_native._native.gather_hash))
            verify_scatter = staticmethod(counting("scatter", host_native._native.verify_scatter))

        monkeypatch.setattr(host_native, "_native", Native)
    chunk = _chunk_bytes(src)
    tracemalloc.start()
    try:
        writer.save(_transfer(keys[1:], list(range(1, 8))))
        save_peak = tracemalloc.get_traced_memory()[1]
        saved, calls = dict(calls), {k: 0 for k in calls}
        tracemalloc.reset_peak()
        reader.load(_transfer(keys[1:], list(range(1, 8))))
        load_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    if fused:  # native passes only: copy and checksum together
        assert saved == {"xxh3": 0, "gather": 7, "scatter": 0}  # one per block
        assert calls == {"xxh3": 0, "gather": 0, "scatter": 2}  # one per restore worker
    else:  # each layer of each block hashed once as it is gathered, checked once before use
        assert saved == {"xxh3": 7 * LAYERS, "gather": 0, "scatter": 0}
        assert calls == {"xxh3": 7 * LAYERS, "gather": 0, "scatter": 0}
    assert save_peak < chunk and load_peak < chunk  # no chunk-sized object on either way
    assert store.manager.staging.allocations == 0  # every chunk went straight into a slot
    assert reader.take_load_errors() == set()
    for b in range(1, 8):
        for x, y in zip(_block(src, b), _block(dst, b), strict=True):
            assert torch.equal(x, y)


def test_a_corrupt_missing_or_foreign_block_is_a_load_error_and_the_rest_load(tmp_path):
    src, dst = caches(NUM_BLOCKS, False, seed=5), caches(NUM_BLOCKS, False, seed=6)
    before = [t.clone() for t in dst.values()]
    store = _local(src, tmp_path)
    keys = block_keys(list(range(4 * BLOCK)), BLOCK, FP)
    _worker(store, src).save(_transfer(keys[:3], [0, 1, 2]))
    cpu = store.manager.tiers[0]
    with cpu.lease([keys[1]]) as (view,):
        view[-3] ^= 0xFF  # a flipped byte in the last layer of the second block's chunk
    reader = _worker(store, dst)
    reader.load(_transfer(keys, [5, 6, 7, 8]))  # the fourth was never stored
    assert reader.take_load_errors() == {6, 8}
    assert reader.stats.loaded_blocks == 2 and store.lookup(keys[1:2]) == 0  # dropped
    for s, d in ((0, 5), (2, 7)):
        for a, b in zip(_block(src, s), _block(dst, d), strict=True):
            assert torch.equal(a, b)
    other = _worker(store, caches(NUM_BLOCKS, False), fp=b"another model")
    other.load(_transfer(keys[:1], [4]))  # the same key written under another fingerprint
    assert other.take_load_errors() == {4}
    assert all(torch.equal(t[:, 8], b[:, 8]) for t, b in zip(dst.values(), before, strict=True))


def test_a_store_that_fails_is_a_load_error_of_every_block_not_loaded(tmp_path):
    src = caches(NUM_BLOCKS, True, seed=7)
    store = _local(src, tmp_path)
    keys = block_keys(list(range(2 * BLOCK)), BLOCK, FP)
    _worker(store, src).save(_transfer(keys, [0, 1]))
    store.manager.close()  # every tier closed: reads fail
    reader = _worker(store, caches(NUM_BLOCKS, True))
    reader.load(_transfer(keys, [2, 3]))
    assert reader.take_load_errors() == {2, 3}


def test_cache_tensors_without_a_block_dimension_are_refused():
    worker = WorkerSide(lambda: None, BLOCK, FP)
    with pytest.raises(ValueError, match="no block dimension"):
        worker.register({"l": torch.zeros(3, 3, BLOCK, 2, 8)}, NUM_BLOCKS)


@pytest.mark.parametrize("shm", [False, True])
def test_blocks_round_trip_through_a_running_kvtier_serve(tmp_path, shm):
    cfg = KVTierConfig()
    cfg.tiers.cpu_bytes = 16 << 20
    cfg.tiers.disk_dir = None
    cfg.server.shm_dir = str(tmp_path / "shm")
    src, dst = caches(NUM_BLOCKS, True, seed=8), caches(NUM_BLOCKS, True, seed=9)
    keys = block_keys(list(range(3 * BLOCK)), BLOCK, FP)
    with running(ServiceState.sidecar(cfg)) as url:
        store = RemoteChunkStore(url, _chunk_bytes(src), shm=shm)
        try:
            _worker(store, src).save(_transfer(keys, [2, 3, 4]))
            assert store.lookup(keys) == 3
            reader = _worker(store, dst)
            reader.load(_transfer(keys + ["00" * 32], [5, 6, 7, 8]))
            assert reader.take_load_errors() == {8} and reader.stats.loaded_blocks == 3
        finally:
            store.close()
    for s, d in ((2, 5), (3, 6), (4, 7)):
        for a, b in zip(_block(src, s), _block(dst, d), strict=True):
            assert torch.equal(a, b)
