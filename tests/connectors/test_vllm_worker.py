"""The vLLM connector's worker side against real tiers (in-process, and a running
``kvtier serve`` over loopback HTTP), with vLLM's cache tensors faked: chunks of blocks
saved and loaded back bit-exact in both cache layouts, one copy and one checksum pass per
block each way, no chunk-sized allocation, blocks vLLM holds left alone, every rank its own
part, saves off the forward path, and a bad chunk a load error with every later chunk of
its request (recomputed by vLLM), never wrong KV."""

from __future__ import annotations

import os
import time
import tracemalloc

import numpy as np
import pytest
import torch
import xxhash

from kvtier.chunk_format import max_chunk_bytes
from kvtier.config import KVTierConfig
from kvtier.connectors.chunk_store import REGION_ALIGN, LocalChunkStore, RemoteChunkStore
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.connectors.vllm_blocks import ChunkGrid, ChunkSpan, ChunkTransfer, Rank
from kvtier.connectors.vllm_worker import WorkerSide, rank_fingerprint
from kvtier.server.state import ServiceState
from tests.connectors.vllm_fakes import BLOCK, LAYERS, caches
from tests.http_server import running

FP = b"vllm-v3|test-model|fp16|bs16"
NUM_BLOCKS = 12
GRID = ChunkGrid(BLOCK, 2, FP)  # chunks of two blocks


def _chunk_bytes(kv: dict[str, torch.Tensor]) -> int:
    layer = next(iter(kv.values()))
    block = LAYERS * layer.numel() * layer.element_size() // NUM_BLOCKS
    return max_chunk_bytes(LAYERS, block * GRID.chunk_blocks)


def _local(kv: dict[str, torch.Tensor], tmp_path, cpu_chunks: int = 16) -> LocalChunkStore:
    slot = _chunk_bytes(kv)
    return LocalChunkStore(TierManager([CPUTier(cpu_chunks * slot, slot), DiskTier(tmp_path / "d")]))


def _worker(store, kv: dict[str, torch.Tensor], fp: bytes = FP, rank: Rank = Rank(),
            background: bool = False, idle_saves: bool = False,
            device_copies: bool | None = None) -> WorkerSide:
    worker = WorkerSide(lambda: store, ChunkGrid(BLOCK, GRID.chunk_blocks, fp), rank, background,
                        idle_saves, device_copies=device_copies)
    worker.register(kv, NUM_BLOCKS)
    return worker


def _block(kv: dict[str, torch.Tensor], block_id: int) -> list[torch.Tensor]:
    """Block ``block_id`` of every layer (a copy)."""
    dim = 0 if next(iter(kv.values())).shape[0] == NUM_BLOCKS else 1
    return [t.select(dim, block_id).clone() for t in kv.values()]


def _keys(blocks: int) -> list[str]:
    """Chunk keys of ``blocks`` blocks of tokens: full chunks, then a tail."""
    return [k.key for k in GRID.keys(list(range(blocks * BLOCK)))]


def _transfer(keys: list[str], blocks: list[int], skip: int = 0) -> list[ChunkTransfer]:
    """``blocks`` cut into the chunks of ``keys`` (two blocks each, the last maybe one)."""
    per = GRID.chunk_blocks
    ids: list[int | None] = [None if i < skip else b for i, b in enumerate(blocks)]
    spans = [ChunkSpan(k, tuple(ids[i * per : (i + 1) * per])) for i, k in enumerate(keys)]
    return [ChunkTransfer("r", spans)]


@pytest.mark.parametrize(("blocks_first", "device"), [(True, False), (False, False), (False, True)])
def test_blocks_saved_and_loaded_back_are_bit_exact(tmp_path, blocks_first, device):
    """``device``: the copies a GPU's caches take (Triton under the interpreter here)."""
    src = caches(NUM_BLOCKS, blocks_first, seed=1)
    dst = caches(NUM_BLOCKS, blocks_first, seed=2)
    store = _local(src, tmp_path, cpu_chunks=2)  # two in RAM, the third (a tail) on disk
    keys = _keys(5)
    writer, reader = _worker(store, src, device_copies=device), _worker(store, dst, device_copies=device)
    writer.save(_transfer(keys, [4, 1, 7, 2, 10]))
    assert writer.stats.saved_blocks == 5 and store.lookup(keys) == 3
    reader.load(_transfer(keys, [0, 9, 3, 5, 11]))
    assert reader.take_load_errors() == set() and reader.stats.loaded_blocks == 5
    for s, d in ((4, 0), (1, 9), (7, 3), (2, 5), (10, 11)):
        for a, b in zip(_block(src, s), _block(dst, d), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("fused", [True, False])
def test_one_copy_and_one_checksum_pass_per_block_each_way(tmp_path, monkeypatch, fused):
    """Fused: each block gathered and hashed in one native call; the blocks checked and
    scattered in one native call per restore worker (the kernel hashes each layer once, as
    it copies); else numpy copies and one xxh3 per layer each way. Either way nothing
    chunk-sized is allocated and no staging buffer is used (chunks go straight into slots)."""
    from kvtier import layer_sums
    from kvtier.gpu_pool.kernels import host_native

    if fused:
        assert host_native.AVAILABLE  # built at install (setup.py); CI has a compiler
    else:  # neither native kernel: the xxhash package's checksums, counted
        monkeypatch.setattr(host_native, "AVAILABLE", False)
        monkeypatch.setattr(layer_sums, "_native", None)
    big = {"heads": 8, "dim": 128}  # chunks of 200 KB: far above the Python objects a step makes
    src, dst = caches(NUM_BLOCKS, True, seed=3, **big), caches(NUM_BLOCKS, True, seed=4, **big)
    store = _local(src, tmp_path)
    keys = _keys(8)
    writer, reader = _worker(store, src), _worker(store, dst)
    writer.save(_transfer(keys[:1], [0, 1]))  # warm the arena
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
        writer.save(_transfer(keys[1:], list(range(2, 8))))
        save_peak = tracemalloc.get_traced_memory()[1]
        saved, calls = dict(calls), {k: 0 for k in calls}
        tracemalloc.reset_peak()
        reader.load(_transfer(keys[1:], list(range(2, 8))))
        load_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    if fused:  # native passes only: copy and checksum together
        assert saved == {"xxh3": 0, "gather": 3, "scatter": 0}  # one per chunk
        assert calls == {"xxh3": 0, "gather": 0, "scatter": 2}  # one per restore worker
    else:  # each layer of each chunk hashed once as it is gathered, checked once before use
        assert saved == {"xxh3": 3 * LAYERS, "gather": 0, "scatter": 0}
        assert calls == {"xxh3": 3 * LAYERS, "gather": 0, "scatter": 0}
    assert save_peak < chunk and load_peak < chunk  # no chunk-sized object on either way
    assert store.manager.staging.allocations == 0  # every chunk went straight into a slot
    assert reader.take_load_errors() == set()
    for b in range(2, 8):
        for x, y in zip(_block(src, b), _block(dst, b), strict=True):
            assert torch.equal(x, y)


def test_a_corrupt_missing_or_foreign_chunk_is_a_load_error_with_every_later_one(tmp_path):
    src, dst = caches(NUM_BLOCKS, False, seed=5), caches(NUM_BLOCKS, False, seed=6)
    before = [t.clone() for t in dst.values()]
    store = _local(src, tmp_path)
    keys = _keys(8)
    _worker(store, src).save(_transfer(keys[:3], [0, 1, 2, 3, 4, 5]))
    cpu = store.manager.tiers[0]
    with cpu.lease([keys[1]]) as (view,):
        view[-3] ^= 0xFF  # a flipped byte in the last layer of the second chunk
    reader = _worker(store, dst)
    reader.load(_transfer(keys, [4, 5, 6, 7, 8, 9, 10, 11]))  # the fourth was never stored
    # the second chunk fails: it and every later one are recomputed, the third too
    assert reader.take_load_errors() == {6, 7, 8, 9, 10, 11}
    assert reader.stats.loaded_blocks == 2 and store.lookup(keys[1:2]) == 0  # dropped
    assert store.lookup(keys[2:3]) == 1  # the third chunk is intact, only not served
    for s, d in ((0, 4), (1, 5)):
        for a, b in zip(_block(src, s), _block(dst, d), strict=True):
            assert torch.equal(a, b)
    reader.load(_transfer(keys[2:4], [8, 9, 10, 11]))  # from the third chunk on: it loads
    assert reader.take_load_errors() == {10, 11} and reader.stats.loaded_blocks == 4
    other = _worker(store, caches(NUM_BLOCKS, False), fp=b"another model")
    other.load(_transfer(keys[:1], [2, 3]))  # the same key written under another fingerprint
    assert other.take_load_errors() == {2, 3}
    for block in (10, 11):  # never written: the missing chunk (the corrupt one is, up to its bad layer)
        assert all(torch.equal(t[:, block], b[:, block]) for t, b in zip(dst.values(), before, strict=True))


def test_a_store_that_fails_is_a_load_error_of_every_block_not_loaded(tmp_path):
    src = caches(NUM_BLOCKS, True, seed=7)
    store = _local(src, tmp_path)
    keys = _keys(3)
    _worker(store, src).save(_transfer(keys, [0, 1, 2]))
    store.manager.close()  # every tier closed: reads fail
    reader = _worker(store, caches(NUM_BLOCKS, True))
    reader.load(_transfer(keys, [3, 4, 5], skip=1))
    assert reader.take_load_errors() == {4, 5}  # block 3 was vLLM's already


def test_cache_tensors_without_a_block_dimension_are_refused():
    worker = WorkerSide(lambda: None, GRID)
    with pytest.raises(ValueError, match="no block dimension"):
        worker.register({"l": torch.zeros(3, 3, BLOCK, 2, 8)}, NUM_BLOCKS)


def _sidecar_config(tmp_path) -> KVTierConfig:
    """A sidecar's: a 16 MiB CPU tier, no disk, shared-memory regions in the test's own
    directory."""
    cfg = KVTierConfig()
    cfg.tiers.cpu_bytes = 16 << 20
    cfg.tiers.disk_dir = None
    cfg.server.shm_dir = str(tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    return cfg


@pytest.mark.parametrize("shm", [False, True])
def test_blocks_round_trip_through_a_running_kvtier_serve(tmp_path, shm):
    cfg = _sidecar_config(tmp_path)
    src, dst = caches(NUM_BLOCKS, True, seed=8), caches(NUM_BLOCKS, True, seed=9)
    keys = _keys(3)
    with running(ServiceState.sidecar(cfg)) as url:
        store = RemoteChunkStore(url, _chunk_bytes(src), shm=shm)
        try:
            _worker(store, src).save(_transfer(keys, [2, 3, 4]))
            assert store.lookup(keys) == 2 and store.present([keys[1], "ab" * 16]) == [True, False]
            assert store.prefetch(keys) == 0  # in the server's fastest tier already
            reader = _worker(store, dst)
            reader.load([ChunkTransfer("r", [ChunkSpan(keys[0], (5, 6)), ChunkSpan(keys[1], (7,)),
                                             ChunkSpan("00" * 32, (8, 9))])])
            assert reader.take_load_errors() == {8, 9} and reader.stats.loaded_blocks == 3
            assert store.client.shm == shm  # the region was used, not fallen back from
        finally:
            store.close()
    for s, d in ((2, 5), (3, 6), (4, 7)):
        for a, b in zip(_block(src, s), _block(dst, d), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("region_chunks", [8, 2])
def test_through_a_region_chunks_are_filled_and_lent_in_place(tmp_path, region_chunks):
    """With ``shm`` a save gathers straight into the worker thread's region and a load
    scatters straight out of it: no staging buffer is made (beyond the region's share
    of a read, ``region_chunks``, read in one request: the rest come through staging
    buffers); every block
    bit-exact, a missing chunk ends the prefix."""
    cfg = _sidecar_config(tmp_path)
    src, dst = caches(NUM_BLOCKS, True, seed=12), caches(NUM_BLOCKS, True, seed=13)
    keys = _keys(10)  # five chunks: four stored, then one that is not
    with running(ServiceState.sidecar(cfg)) as url:
        store = RemoteChunkStore(url, _chunk_bytes(src), shm=True)
        try:
            _worker(store, src).save(_transfer(keys[:4], list(range(8))))
            size = len(store.client.get_chunk(keys[0]))  # room for exactly region_chunks:
            store.region_bytes = (region_chunks - 1) * -(-size // REGION_ALIGN) * REGION_ALIGN + size
            assert store.staging.allocations == 0 and store.client.shm
            with store.get_into(keys) as lent:
                assert [c is not None for c in lent] == [True] * 4 + [False]
                region = store.client._local.link  # noqa: SLF001
                base = np.frombuffer(region._mem, np.uint8).ctypes.data  # noqa: SLF001
                inside = [base <= c.buf.data_ptr() < base + region.size for c in lent[:4]]
                assert inside == [i < region_chunks for i in range(4)]
                for c in lent[:4]:  # the reads past the region's share left its chunks intact
                    c.verify()
            assert store.staging.allocations == max(0, len(keys) - region_chunks)  # the rest
            with store.get_into([keys[0], keys[4], keys[1]]) as lent:
                assert lent[0] is not None and lent[1:] == [None, None]
            reader = _worker(store, dst)
            reader.load(_transfer(keys[:4], [8, 9, 10, 11, 4, 5, 6, 7]))
            assert reader.take_load_errors() == set() and reader.stats.loaded_blocks == 8
        finally:
            store.close()
    for s, d in ((0, 8), (1, 9), (2, 10), (3, 11), (4, 4), (5, 5), (6, 6), (7, 7)):
        for a, b in zip(_block(src, s), _block(dst, d), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("fused", [True, False])
def test_a_load_leaves_the_blocks_vllm_computed_alone(tmp_path, monkeypatch, fused):
    from kvtier.gpu_pool.kernels import host_native

    if not fused:
        monkeypatch.setattr(host_native, "AVAILABLE", False)
    src, dst = caches(NUM_BLOCKS, False, seed=10), caches(NUM_BLOCKS, False, seed=11)
    before = [t.clone() for t in dst.values()]
    store = _local(src, tmp_path)
    keys = _keys(4)
    _worker(store, src).save(_transfer(keys, [0, 1, 2, 3]))
    reader = _worker(store, dst)
    reader.load(_transfer(keys, [4, 5, 6, 7], skip=1))  # vLLM holds block 4 already
    assert reader.take_load_errors() == set() and reader.stats.loaded_blocks == 3
    assert all(torch.equal(t[:, 4], b[:, 4]) for t, b in zip(dst.values(), before, strict=True))
    for s, d in ((1, 5), (2, 6), (3, 7)):
        for a, b in zip(_block(src, s), _block(dst, d), strict=True):
            assert torch.equal(a, b)


def test_each_rank_restores_its_own_part():
    """TP 2 x PP 2: four workers hold different KV for the same tokens (their heads, their
    layers); each stores its part under the chunk's key and its rank, and each restores its
    own, never another's, even where a part was copied under another rank's key."""
    store = LocalChunkStore(TierManager([CPUTier(64 << 20, 1 << 20)]))
    keys = _keys(4)
    world = [caches(NUM_BLOCKS, True, seed=20 + r) for r in range(4)]
    for r, kv in enumerate(world):
        _worker(store, kv, rank=Rank(r, 4)).save(_transfer(keys, [0, 1, 2, 3]))
    for r in range(4):
        dst = caches(NUM_BLOCKS, True, seed=99)
        reader = _worker(store, dst, rank=Rank(r, 4))
        reader.load(_transfer(keys, [4, 5, 6, 7]))
        assert reader.take_load_errors() == set()
        for s, d in ((0, 4), (3, 7)):
            for a, b in zip(_block(world[r], s), _block(dst, d), strict=True):
                assert torch.equal(a, b)
    rank0, rank1 = (ChunkGrid.rank_key(keys[0], Rank(r, 4)) for r in (0, 1))
    assert rank0 != rank1 and keys[0] not in (rank0, rank1)
    store.manager.delete([rank1])
    impostor = _worker(store, world[0], rank=Rank(1, 4))  # rank 0's KV under rank 1's keys
    impostor.fingerprint = rank_fingerprint(FP, Rank(0, 4))  # and rank 0's header
    impostor.save(_transfer(keys[:1], [0, 1]))
    assert store.present([rank1]) == [True]
    reader = _worker(store, caches(NUM_BLOCKS, True), rank=Rank(1, 4))
    reader.load(_transfer(keys[:1], [8, 9]))
    assert reader.take_load_errors() == {8, 9}  # its header names rank 0: refused


class _GatedStore(LocalChunkStore):
    """The in-process store, whose stores (or, with ``reads``, whose reads) wait until the
    test opens the gate (a slow medium)."""

    def __init__(self, manager: TierManager, reads: bool = False) -> None:
        super().__init__(manager)
        import threading

        self.gate = threading.Event()
        self.reads = reads

    def put_from(self, writes):
        assert self.reads or self.gate.wait(30)
        return super().put_from(writes)

    def get_into(self, keys):
        assert not self.reads or self.gate.wait(30)
        return super().get_into(keys)


def test_saves_run_off_the_forward_path_and_hold_a_finished_requests_blocks(tmp_path):
    src = caches(NUM_BLOCKS, True, seed=30)
    slot = _chunk_bytes(src)
    store = _GatedStore(TierManager([CPUTier(16 * slot, slot)]))
    keys = _keys(4)
    worker = _worker(store, src, background=True)
    try:
        worker.save([ChunkTransfer("a", _transfer(keys, [0, 1, 2, 3])[0].chunks)])
        assert store.lookup(keys) == 0  # vLLM went on; the save waits on the medium
        assert worker.finished({"a", "b"}) == set()  # "a"'s blocks stay; "b" saved nothing
        store.gate.set()
        worker.wait_saves()  # a preemption: pending saves land first
        assert store.lookup(keys) == 2 and worker.stats.saved_blocks == 4
        # at normal priority unless asked (save_priority: idle -> Linux SCHED_IDLE)
        policy = []
        worker.saves.submit([], lambda: policy.append(os.sched_getscheduler(0)))
        worker.wait_saves()
        idle = _worker(store, src, background=True, idle_saves=True)
        idle.saves.submit([], lambda: policy.append(os.sched_getscheduler(0)))
        idle.wait_saves()
        idle.close()
        assert policy == [os.SCHED_OTHER, os.SCHED_IDLE]
        assert worker.saves.holds == 0
        assert worker.finished(set()) == {"a"}  # reported once, when its save landed
        assert worker.finished({"a"}) == set()
        assert worker.saves.holds == 1 and worker.saves.hold_s > 0  # held from its finish on
    finally:
        store.gate.set()
        worker.close()


def test_in_process_tiers_for_several_ranks_live_in_a_private_sidecar(tmp_path):
    """Several ranks (processes of their own in vLLM) share in-process tiers through the
    kvtier serve the connector starts for them: two ranks save their parts through it and
    restore them, bit-exact; the server wants its own token."""
    import httpx

    from kvtier.connectors import private_sidecar
    from kvtier.connectors.chunk_store import open_store

    src = [caches(NUM_BLOCKS, True, seed=40 + r) for r in range(2)]
    options = {"tiers": {"cpu_bytes": 16 << 20, "disk_dir": str(tmp_path / "d"), "disk_fsync": False}}
    address = private_sidecar.start(options, _chunk_bytes(src[0]))
    assert httpx.post(f"{address.url}/v1/chunks/lookup", json={"keys": ["ab" * 8]}).status_code == 401
    keys = _keys(4)
    stores = [open_store({**options, **address.options()}, _chunk_bytes(src[0])) for _ in range(2)]
    try:
        for r, store in enumerate(stores):
            _worker(store, src[r], rank=Rank(r, 2)).save(_transfer(keys, [0, 1, 2, 3]))
        for r, store in enumerate(stores):
            dst = caches(NUM_BLOCKS, True, seed=99)
            reader = _worker(store, dst, rank=Rank(r, 2))
            reader.load(_transfer(keys, [4, 5, 6, 7]))
            assert reader.take_load_errors() == set()
            for a, b in zip(_block(src[r], 2), _block(dst, 6), strict=True):
                assert torch.equal(a, b)
        # the chunks crossed shared memory, not HTTP bodies: every store kept its region
        assert all(store.client.shm for store in stores)
        headers = {"Authorization": f"Bearer {address.token}"}
        stats = httpx.get(f"{address.url}/v1/stats", headers=headers).json()["regions"]
        assert stats["transfers"]["put"] >= len(stores) and stats["transfers"]["get"] >= len(stores)
        paths = [r["path"] for r in httpx.get(f"{address.url}/v1/regions", headers=headers).json()]
        assert len(paths) == 2 and all(p.startswith(private_sidecar.MEMORY_DIR) for p in paths)
    finally:
        for store in stores:
            store.close()
        private_sidecar.stop(address)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{address.url}/healthz", timeout=2)  # stopped
    assert not any(os.path.exists(p) for p in paths)  # its regions went with it


def test_regions_of_a_killed_private_sidecar_are_removed_by_the_next(tmp_path):
    """A vLLM killed outright (SIGKILL) takes its private sidecar's cleanup with it; the
    regions it leaves in memory are removed when the next private sidecar starts."""
    import signal

    import httpx

    from kvtier.chunk_format import encode_chunk
    from kvtier.client import Client
    from kvtier.connectors import private_sidecar

    options = {"tiers": {"cpu_bytes": 4 << 20, "disk_dir": None}}
    first = private_sidecar.start(options, 1 << 16)
    with Client(first.url, token=first.token, shm=True) as kv:
        key = _keys(1)[0]
        kv.put_chunk(key, encode_chunk(key, b"fp", torch.zeros(2, 2, 4, 1, 8)))
        assert kv.shm
        (region,) = httpx.get(f"{first.url}/v1/regions",
                              headers={"Authorization": f"Bearer {first.token}"}).json()
        proc = private_sidecar._running.pop(first.url).proc
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert os.path.exists(region["path"])  # left behind
    second = private_sidecar.start(options, 1 << 16)
    try:
        assert not os.path.exists(region["path"])
    finally:
        private_sidecar.stop(second)


def test_private_sidecar_starts_whatever_its_token_looks_like(tmp_path, monkeypatch):
    """The token is random: one in 64 starts with ``-``, which argparse took for an option
    (the server refused to start, vLLM with it). It travels in the environment, never in
    argv where ``ps`` shows it to every user."""
    import httpx

    from kvtier.connectors import private_sidecar

    token = "-" + "x" * 31
    monkeypatch.setattr(private_sidecar.secrets, "token_urlsafe", lambda _n: token)
    options = {"tiers": {"cpu_bytes": 4 << 20, "disk_dir": None}}
    address = private_sidecar.start(options, 1 << 16)
    try:
        assert address.token == token
        proc = private_sidecar._running[address.url].proc
        assert token not in " ".join(proc.args)
        headers = {"Authorization": f"Bearer {token}"}
        assert httpx.post(f"{address.url}/v1/chunks/lookup", json={"keys": ["ab" * 8]},
                          headers=headers).status_code == 200
    finally:
        private_sidecar.stop(address)


def test_async_loads_run_off_the_forward_path_and_report_each_request_once(tmp_path):
    """vLLM's async-load protocol: the step's loads go to the loading thread; a request is
    reported finished (with the blocks it could not load, in the same pass) only once its
    load is over, loaded or failed, and exactly once."""
    src, dst = caches(NUM_BLOCKS, False, seed=40), caches(NUM_BLOCKS, False, seed=41)
    slot = _chunk_bytes(src)
    store = _GatedStore(TierManager([CPUTier(16 * slot, slot)]), reads=True)
    keys = _keys(6)
    _worker(store, src).save(_transfer(keys[:2], [0, 1, 2, 3]))  # the third is never stored
    reader = WorkerSide(lambda: store, GRID, async_loads=True)
    reader.register(dst, NUM_BLOCKS)
    try:
        good = ChunkTransfer("good", _transfer(keys[:2], [4, 5, 6, 7])[0].chunks)
        bad = ChunkTransfer("bad", _transfer(keys[2:], [8, 9])[0].chunks)
        reader.load_async([good, bad])
        assert reader.stats.loaded_blocks == 0  # vLLM's step went on: nothing read yet
        assert reader.finished_loading() == set() and reader.take_load_errors() == set()
        held_s = 0.3
        time.sleep(held_s)  # the store holds the loading thread, not vLLM's step
        store.gate.set()
        done: set[str] = set()
        for _ in range(200):
            done |= reader.finished_loading()
            if done == {"good", "bad"}:
                break
            time.sleep(0.02)
        assert done == {"good", "bad"}
        assert reader.take_load_errors() == {8, 9}  # reported with "bad", recomputed
        assert reader.finished_loading() == set()  # once
        for s, d in ((0, 4), (1, 5), (2, 6), (3, 7)):
            for a, b in zip(_block(src, s), _block(dst, d), strict=True):
                assert torch.equal(a, b)
        # the wait was the loading thread's time, not the step's (whatever else the cores do)
        assert reader.stats.async_load_s >= held_s > reader.stats.load_s
    finally:
        store.gate.set()
        reader.close()


def test_an_async_load_waits_for_the_saves_it_reads(tmp_path):
    """A returning request loads the reply its previous turn's last save writes: the load
    runs after that save, on the loading thread, never before it."""
    src = caches(NUM_BLOCKS, True, seed=42)
    slot = _chunk_bytes(src)
    store = _GatedStore(TierManager([CPUTier(16 * slot, slot)]))
    keys = _keys(2)
    worker = WorkerSide(lambda: store, GRID, background=True, async_loads=True)
    worker.register(src, NUM_BLOCKS)
    try:
        worker.save([ChunkTransfer("turn1", _transfer(keys, [0, 1])[0].chunks)])
        worker.load_async([ChunkTransfer("turn2", _transfer(keys, [2, 3])[0].chunks)],
                          after_saves=True)
        time.sleep(0.2)
        assert worker.finished_loading() == set()  # still waiting for the save
        store.gate.set()
        for _ in range(200):
            if worker.finished_loading() == {"turn2"}:
                break
            time.sleep(0.02)
        else:
            raise AssertionError("the load never finished")
        assert worker.take_load_errors() == set()
        for s, d in ((0, 2), (1, 3)):
            for a, b in zip(_block(src, s), _block(src, d), strict=True):
                assert torch.equal(a, b)
    finally:
        store.gate.set()
        worker.close()


def test_the_connectors_own_tiers_keep_free_slots_unless_told_otherwise(tmp_path):
    """vLLM holds a finished request's blocks until its saves land: the connector's
    in-process CPU arena keeps 5 % of its slots free (a save never waits for a demotion);
    ``tiers.cpu_free_reserve`` sets it, 0 turns it off."""
    from kvtier.connectors.chunk_store import open_store

    slot = 1 << 20
    tiers = {"cpu_bytes": 40 * slot, "disk_dir": str(tmp_path / "a"), "disk_fsync": False}
    default = open_store({"tiers": tiers}, slot)
    off = open_store({"tiers": {**tiers, "disk_dir": str(tmp_path / "b"), "cpu_free_reserve": 0}}, slot)
    assert default.manager.tiers[0].reserve_units == 2 and off.manager.tiers[0].reserve_units == 0


def test_the_connectors_own_disk_tier_bypasses_the_page_cache_unless_told_otherwise(tmp_path):
    """The CPU arena is the RAM cache above the disk: the connector's own disk tier writes
    and reads with O_DIRECT (the page cache would copy every demoted byte again);
    ``tiers.disk_o_direct: false`` turns it off. The private sidecar gets the same."""
    from kvtier.connectors import private_sidecar
    from kvtier.connectors.chunk_store import open_store

    slot = 1 << 20
    tiers = {"cpu_bytes": 4 * slot, "disk_dir": str(tmp_path / "a"), "disk_fsync": False}
    direct = open_store({"tiers": tiers}, slot).manager.tiers[1]
    buffered = open_store({"tiers": {**tiers, "disk_dir": str(tmp_path / "b"),
                                     "disk_o_direct": False}}, slot).manager.tiers[1]
    assert direct.name == "disk" and direct.o_direct and not buffered.o_direct
    env = private_sidecar._env({"tiers": tiers}, slot, str(tmp_path), "t")
    assert env["KVTIER_TIERS__DISK_O_DIRECT"] == "True"
    assert env["KVTIER_TIERS__CPU_FREE_RESERVE"] == "0.05"
    told = private_sidecar._env({"tiers": {**tiers, "disk_o_direct": False}}, slot, str(tmp_path), "t")
    assert told["KVTIER_TIERS__DISK_O_DIRECT"] == "False"
    from_file = private_sidecar._env({"config": "kvtier.yaml"}, slot, str(tmp_path), "t")
    assert "KVTIER_TIERS__DISK_O_DIRECT" not in from_file  # a config file is taken as written


def _yielding_worker(tmp_path, seed: int) -> tuple[WorkerSide, LocalChunkStore, list[str]]:
    """A worker whose background saves yield to prefill steps, over a store of its own,
    and the keys of a four-block prompt's two chunks."""
    src = caches(NUM_BLOCKS, True, seed=seed)
    store = _local(src, tmp_path)
    worker = WorkerSide(lambda: store, GRID, background=True, saves_yield=True)
    worker.register(src, NUM_BLOCKS)
    return worker, store, _keys(4)


def test_saves_that_yield_wait_out_a_prefill_step_and_no_longer_than_the_bound(tmp_path, monkeypatch):
    """``saves_yield_to_prefill``: a chunk is written only once the prefill step running
    when its save came ends; a decode step does not hold it; a prefill that never ends
    holds it no longer than the bound, which for a running request's save is long (nobody
    waits for it) and once vLLM holds a finished request's blocks for it short; whoever
    drains the saves does not wait for a step."""
    from kvtier.connectors import vllm_saves

    worker, store, keys = _yielding_worker(tmp_path, seed=31)
    try:
        worker.saves.step_started(prefill=True)
        worker.save([ChunkTransfer("a", _transfer(keys, [0, 1, 2, 3])[0].chunks)])
        time.sleep(0.3)
        assert store.lookup(keys) == 0  # the prefill runs: nothing written yet
        worker.saves.step_ended()
        worker.wait_saves()
        assert store.lookup(keys) == 2 and worker.stats.saved_blocks == 4

        worker.saves.step_started(prefill=False)  # a decode step: saves go on
        more = _keys(8)[2:4]
        worker.save([ChunkTransfer("b", _transfer(more, [4, 5, 6, 7])[0].chunks)])
        deadline = time.monotonic() + 30
        while store.lookup(_keys(8)) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.lookup(_keys(8)) == 4
        worker.saves.step_ended()

        monkeypatch.setattr(vllm_saves, "MAX_YIELD_S", 0.2)
        worker.saves.step_started(prefill=True)  # and it never ends
        last = _keys(10)[4:5]
        worker.save([ChunkTransfer("c", _transfer(last, [8, 9])[0].chunks)])
        time.sleep(0.6)
        assert store.lookup(_keys(10)) == 4  # "c" runs: nobody waits for its save
        t0 = time.monotonic()
        assert worker.finished({"c"}) == set()  # now vLLM holds its blocks for it
        while store.lookup(_keys(10)) < 5 and time.monotonic() < t0 + 30:
            time.sleep(0.01)
        assert store.lookup(_keys(10)) == 5 and time.monotonic() - t0 < 10  # the bound, not the step
        assert worker.finished(set()) == {"c"}

        monkeypatch.setattr(vllm_saves, "MAX_RUNNING_YIELD_S", 0.3)  # a running request's bound
        t0 = time.monotonic()
        worker.save([ChunkTransfer("e", _transfer(_keys(12)[5:6], [10, 11])[0].chunks)])
        while store.lookup(_keys(12)) < 6 and time.monotonic() < t0 + 30:
            time.sleep(0.01)
        assert store.lookup(_keys(12)) == 6 and time.monotonic() - t0 < 10

        monkeypatch.setattr(vllm_saves, "MAX_RUNNING_YIELD_S", 60.0)
        worker.saves.step_started(prefill=True)
        t0 = time.monotonic()
        worker.save([ChunkTransfer("d", _transfer(_keys(14)[6:7], [0, 1])[0].chunks)])
        worker.wait_saves()  # a preemption drains: it does not wait for the step
        assert store.lookup(_keys(14)) == 7 and time.monotonic() - t0 < 30
    finally:
        worker.saves.step_ended()
        worker.close()


def test_a_yielding_save_starts_no_chunk_in_the_gap_between_steps(tmp_path, monkeypatch):
    """vLLM starts its next step milliseconds after the last one ended, often another
    prefill: a save that waited out a prefill does not start a chunk in that gap; it
    waits on through the next prefill, starts with a decode step, or once vLLM has been
    idle for ``STEP_GAP_S``."""
    from kvtier.connectors import vllm_saves

    monkeypatch.setattr(vllm_saves, "STEP_GAP_S", 0.5)
    worker, store, keys = _yielding_worker(tmp_path, seed=37)

    def stored_within(n: int, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while store.lookup(keys) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return store.lookup(keys) >= n

    try:
        worker.saves.step_started(prefill=True)
        worker.save([ChunkTransfer("a", _transfer(keys, [0, 1, 2, 3])[0].chunks)])
        worker.saves.step_ended()
        worker.saves.step_started(prefill=True)  # the next prefill, at once
        assert not stored_within(1, 0.7)  # longer than the gap: the step runs
        worker.saves.step_ended()
        t0 = time.monotonic()
        assert not stored_within(1, 0.2)  # in the gap: nothing starts
        worker.saves.step_started(prefill=False)  # a decode step: the save goes
        assert stored_within(2, 30) and time.monotonic() - t0 < 10
        worker.saves.step_ended()

        worker.saves.step_started(prefill=True)
        more = _keys(8)[2:4]
        keys = _keys(8)
        worker.save([ChunkTransfer("b", _transfer(more, [4, 5, 6, 7])[0].chunks)])
        worker.saves.step_ended()
        t0 = time.monotonic()
        assert stored_within(4, 30)  # vLLM went idle: after the gap
        assert time.monotonic() - t0 >= 0.4
    finally:
        worker.close()


class _DyingStore(LocalChunkStore):
    """The in-process store whose medium goes away after ``puts`` stores (a sidecar that
    dies mid-save)."""

    def __init__(self, manager: TierManager, puts: int) -> None:
        super().__init__(manager)
        self.puts = puts

    def put_from(self, writes):
        if self.puts <= 0:
            raise ConnectionError("the store went away")
        self.puts -= 1
        return super().put_from(writes)


def test_a_save_cut_short_counts_the_chunks_it_stored_and_frees_the_blocks(tmp_path):
    """Chunk by chunk (saves yielding to prefill), a store lost after the first chunk: that
    chunk is stored and counted, the rest are not, and the request's blocks are let go."""
    src = caches(NUM_BLOCKS, True, seed=32)
    slot = _chunk_bytes(src)
    store = _DyingStore(TierManager([CPUTier(16 * slot, slot)]), puts=1)
    keys = _keys(6)
    worker = WorkerSide(lambda: store, GRID, background=True, saves_yield=True)
    worker.register(src, NUM_BLOCKS)
    try:
        worker.save([ChunkTransfer("a", _transfer(keys, [0, 1, 2, 3, 4, 5])[0].chunks)])
        worker.wait_saves()
        assert store.present(keys) == [True, False, False]
        assert worker.stats.saved_blocks == 2
        assert worker.finished({"a"}) == {"a"}
    finally:
        worker.close()


def test_saves_yield_to_prefill_by_default_where_the_cache_is_on_the_host(tmp_path):
    """Unset, the option follows where vLLM's cache lies: a host cache's prefill shares
    its cores with the saves (they yield), a device cache's does not; set, it is as set,
    and saves made in vLLM's own thread (not in the background) never wait."""
    src = caches(NUM_BLOCKS, True, seed=32)
    store = _local(src, tmp_path)
    for given, background, expected in [(None, True, True), (False, True, False),
                                        (True, True, True), (None, False, False)]:
        worker = WorkerSide(lambda: store, GRID, background=background, saves_yield=given)
        worker.register(src, NUM_BLOCKS)
        assert worker.saves.yield_to_prefill is expected
        worker.close()


def test_a_yielding_save_goes_on_from_a_step_that_computes_nothing(tmp_path, monkeypatch):
    """vLLM holding a finished request's blocks for its saves steps with nothing to compute,
    about every millisecond, to hear whether they landed: such a step is vLLM idle, and the
    gap after it no step's end. (A save that took it for a decode step found it over when
    it woke and waited out the gap after it, again and again, until the hold's bound.)"""
    from kvtier.connectors import vllm_saves

    monkeypatch.setattr(vllm_saves, "STEP_GAP_S", 5.0)
    monkeypatch.setattr(vllm_saves, "MAX_YIELD_S", 60.0)
    worker, store, keys = _yielding_worker(tmp_path, seed=41)
    try:
        worker.saves.step_started(prefill=True)
        worker.save([ChunkTransfer("a", _transfer(keys, [0, 1, 2, 3])[0].chunks)])
        worker.saves.step_ended()
        time.sleep(0.3)
        assert store.lookup(keys) == 0  # in the gap after a prefill: nothing starts
        t0 = time.monotonic()
        worker.saves.step_started(prefill=False, idle=True)
        worker.saves.step_ended()  # over before the save looks
        while store.lookup(keys) < 2 and time.monotonic() < t0 + 30:
            time.sleep(0.01)
        assert store.lookup(keys) == 2 and time.monotonic() - t0 < 4  # not the gap's 5 s
    finally:
        worker.close()
