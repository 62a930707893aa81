"""The in-place data path through KVTransfer: stores write CPU slots (or staging buffers a
disk tier writes from) in place, restores scatter from leased views (of the arena, or of
buffers disk reads landed in), and neither makes a chunk-sized Python allocation nor a new
buffer in steady state (a ``bytes``/``bytearray`` per chunk is what the blob path paid)."""

from __future__ import annotations

import tracemalloc

import pytest
import torch

from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.engine.model_runner import ModelRunner
from kvtier.gpu_pool.kernels import gather_blocks
from kvtier.make_model.writer import make_model
from kvtier.transfer.kv_transfer import KVTransfer
from tests import redis_servers

redis_server = redis_servers.redis_server  # shared fixture, used by name
CHUNK = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_model("tiny", tmp_path_factory.mktemp("m") / "tiny", seed=4).path


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n,), generator=g).tolist()


def _compute(runner, sid, tokens) -> None:
    runner.add_sequence(sid, tokens)
    runner.run([(sid, len(tokens))])
    runner.free_sequence(sid)


def _traced_round_trip(xfer, tokens):
    """Save ``tokens``, drop their blocks, load them back: (save report, load report, peak
    Python allocation of the store, of the restore), as tracemalloc sees them."""
    tracemalloc.start()
    try:
        saved = xfer.save(tokens)
        store_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        assert xfer.evict(tokens) > 0
        loaded = xfer.load(tokens, saved.tokens)
        load_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return saved, loaded, store_peak, load_peak


def _pool_kv(runner, tokens) -> torch.Tensor:
    blocks = runner.pool.manager.match_prefix(tokens, runner.fingerprint)
    return gather_blocks(runner.pool.storage.kv, blocks).clone()


def test_stores_and_restores_in_place_are_bit_exact_and_allocate_no_chunk(model_dir):
    runner = ModelRunner(model_dir, dtype="float32", device="cpu", num_blocks=256)
    chunk_bytes = runner.pool.storage.bytes_per_token * CHUNK
    tier = CPUTier(24 * (chunk_bytes + 4096), chunk_bytes + 4096)
    xfer = KVTransfer(runner, TierManager([tier], fingerprint=runner.fingerprint), CHUNK)
    try:
        warm, tokens = _tokens(4 * CHUNK, seed=1), _tokens(4 * CHUNK, seed=2)
        for seq in (warm, tokens):
            _compute(runner, str(len(seq)) + str(seq[0]), seq)
        xfer.save(warm)  # first use: imports, caches, the msgpack packer
        xfer.evict(warm)
        xfer.load(warm)
        before = _pool_kv(runner, tokens)

        saved, loaded, store_peak, load_peak = _traced_round_trip(xfer, tokens)
        assert (saved.tokens, saved.stored, loaded.from_tiers) == (4 * CHUNK, 4, 4 * CHUNK)
        assert tier.stats.puts == 8 and len(tier) == 8  # every chunk went in place
        assert torch.equal(_pool_kv(runner, tokens), before)
        assert store_peak < chunk_bytes // 2, f"store: {store_peak} B for {chunk_bytes}-B chunks"
        assert load_peak < chunk_bytes // 2, f"restore: {load_peak} B for {chunk_bytes}-B chunks"
    finally:
        xfer.close()
        tier.close()


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
def test_disk_stores_from_and_restores_into_reused_buffers(model_dir, tmp_path, o_direct):
    """The disk tier as the only tier: a store encodes each chunk in place into a staging
    buffer and writes the file from it; a restore reads each file straight into a staging
    buffer and scatters from it. Bit-exact, and in steady state neither a chunk-sized
    Python object nor a new buffer is made."""
    runner = ModelRunner(model_dir, dtype="float32", device="cpu", num_blocks=256)
    chunk_bytes = runner.pool.storage.bytes_per_token * CHUNK
    disk = DiskTier(tmp_path / "disk", o_direct=o_direct)
    manager = TierManager([disk], fingerprint=runner.fingerprint, staging=disk.staging)
    xfer = KVTransfer(runner, manager, CHUNK)
    try:
        warm, tokens = _tokens(4 * CHUNK, seed=3), _tokens(4 * CHUNK, seed=4)
        for seq in (warm, tokens):
            _compute(runner, str(len(seq)) + str(seq[0]), seq)
        assert xfer.save(warm).stored == 4
        xfer.evict(warm)
        assert xfer.load(warm).from_tiers == 4 * CHUNK
        before = _pool_kv(runner, tokens)
        buffers = disk.staging.allocations

        saved, loaded, store_peak, load_peak = _traced_round_trip(xfer, tokens)
        assert (saved.tokens, saved.stored, loaded.from_tiers) == (4 * CHUNK, 4, 4 * CHUNK)
        assert loaded.tier_hits == {"disk": 4} and disk.o_direct == o_direct
        assert torch.equal(_pool_kv(runner, tokens), before)
        assert disk.staging.allocations == buffers, "steady state made new buffers"
        assert store_peak < chunk_bytes // 2, f"store: {store_peak} B for {chunk_bytes}-B chunks"
        # (any one chunk-sized object would reach chunk_bytes; the rest is bookkeeping)
        assert load_peak < chunk_bytes, f"restore: {load_peak} B for {chunk_bytes}-B chunks"
    finally:
        xfer.close()
        manager.close()


def test_cpu_evictions_are_demoted_to_disk_from_the_slot(model_dir, tmp_path):
    """A CPU arena of two slots over a disk tier: a session of two chunks fills it, a
    second session's store demotes the first one's chunks, written to disk from their
    slots before the slots are reused; a store larger than the arena keeps its own first
    chunks and sends the rest down. Every chunk restores bit-exact, from the tier it ended
    in."""
    runner = ModelRunner(model_dir, dtype="float32", device="cpu", num_blocks=256)
    slot = runner.pool.storage.bytes_per_token * CHUNK + 4096
    cpu, disk = CPUTier(2 * slot, slot), DiskTier(tmp_path / "disk")
    manager = TierManager([cpu, disk], fingerprint=runner.fingerprint)
    xfer = KVTransfer(runner, manager, CHUNK)
    try:
        first, second = _tokens(2 * CHUNK, seed=5), _tokens(2 * CHUNK, seed=6)
        for tokens in (first, second):
            _compute(runner, "s", tokens)
        before = {id(t): _pool_kv(runner, t) for t in (first, second)}
        assert xfer.save(first).stored == 2 and (len(cpu), len(disk)) == (2, 0)
        assert xfer.save(second).stored == 2
        assert (len(cpu), len(disk), manager.stats.demotions) == (2, 2, 2)
        for tokens, tier in ((first, "disk"), (second, "cpu")):
            xfer.evict(tokens)
            loaded = xfer.load(tokens)
            assert loaded.from_tiers == 2 * CHUNK and loaded.tier_hits == {tier: 2}
            assert torch.equal(_pool_kv(runner, tokens), before[id(tokens)])
        big = _tokens(3 * CHUNK, seed=7)
        _compute(runner, "t", big)
        assert xfer.save(big).stored == 3
        assert manager.stats.demotions == 4 and len(disk) == 5  # second's two, big's third
        keys = [ck.key for ck in xfer._keys(big)]
        assert manager.lookup(keys).tiers == [0, 0, 1]
    finally:
        xfer.close()
        manager.close()


def test_a_large_store_is_put_in_batches_while_the_next_is_encoded(model_dir, tmp_path, monkeypatch):
    """A store of many chunks to a tier that lends no memory goes out in batches, each put
    on the putter thread while the next batch is encoded: every chunk lands (bit-exact on
    restore), and never more than about two batches of staging buffers are out at once
    (a whole-session store used to hold one buffer per chunk until the end)."""
    import kvtier.transfer.staged_puts as staged_puts

    runner = ModelRunner(model_dir, dtype="float32", device="cpu", num_blocks=256)
    chunk_bytes = runner.pool.storage.bytes_per_token * CHUNK
    monkeypatch.setattr(staged_puts, "PUT_BATCH_BYTES", 2 * chunk_bytes)
    disk = DiskTier(tmp_path / "disk", fsync=False)
    manager = TierManager([disk], fingerprint=runner.fingerprint, staging=disk.staging)
    xfer = KVTransfer(runner, manager, CHUNK)
    out_at_put: list[int] = []
    store = disk.store_in_place

    def counting_store(writes):
        out_at_put.append(len(disk.staging._out))
        return store(writes)

    monkeypatch.setattr(disk, "store_in_place", counting_store)
    try:
        tokens = _tokens(8 * CHUNK, seed=5)
        _compute(runner, "s", tokens)
        before = _pool_kv(runner, tokens)
        saved = xfer.save(tokens)
        assert (saved.tokens, saved.stored, saved.failed) == (8 * CHUNK, 8, {})
        assert len(out_at_put) == 4  # four batches of two chunks
        assert max(out_at_put) <= 5  # the batch being put, the next one, one being encoded
        assert disk.staging._out == {}  # every buffer went back
        assert xfer.evict(tokens) > 0
        assert xfer.load(tokens, saved.tokens).from_tiers == 8 * CHUNK
        assert torch.equal(_pool_kv(runner, tokens), before)
    finally:
        xfer.close()
        manager.close()


def test_redis_stores_from_and_restores_into_reused_buffers(model_dir, redis_server):
    """Redis as the only tier: a store sends each chunk from its staging buffer (redis-py's
    Python packer, no copy of the value), a restore reads each value straight into a
    staging buffer (``recv_into``). Bit-exact, and in steady state neither a chunk-sized
    Python object nor a new buffer is made (redis-py's own parsers build every reply as a
    fresh ``bytes``). Chunks of 2 MiB: the tier's asyncio client (its lookups) reads with a
    fixed 256 KiB ``recv`` buffer, which tracemalloc sees whatever the chunk size."""
    from kvtier.connectors.tiers.redis_tier import RedisTier

    chunk = 4096
    runner = ModelRunner(model_dir, dtype="float32", device="cpu", num_blocks=2 * 4 * chunk // 16)
    chunk_bytes = runner.pool.storage.bytes_per_token * chunk
    tier = RedisTier(redis_server.url, timeout_s=5.0)
    manager = TierManager([tier], fingerprint=runner.fingerprint, staging=tier.staging)
    xfer = KVTransfer(runner, manager, chunk)
    try:
        warm, tokens = _tokens(2 * chunk, seed=6), _tokens(2 * chunk, seed=7)
        for seq in (warm, tokens):  # held in the pool as computed (their KV: whatever it is)
            sid = str(seq[0])
            runner.pool.add_sequence(sid, seq, runner.fingerprint)
            runner.pool.storage.kv.view(-1)[:].uniform_()  # any bits, the same on the way back
            runner.pool.mark_computed(sid, len(seq))
            runner.pool.free_sequence(sid)
        assert xfer.save(warm).stored == 2
        xfer.evict(warm)
        assert xfer.load(warm).from_tiers == 2 * chunk
        before = _pool_kv(runner, tokens)
        buffers = tier.staging.allocations

        saved, loaded, store_peak, load_peak = _traced_round_trip(xfer, tokens)
        assert (saved.tokens, saved.stored, loaded.from_tiers) == (2 * chunk, 2, 2 * chunk)
        assert loaded.tier_hits == {"redis": 2}
        assert torch.equal(_pool_kv(runner, tokens), before)
        assert tier.staging.allocations == buffers, "steady state made new buffers"
        assert tier.staging.lent == 0
        assert store_peak < chunk_bytes // 2, f"store: {store_peak} B for {chunk_bytes}-B chunks"
        assert load_peak < chunk_bytes // 2, f"restore: {load_peak} B for {chunk_bytes}-B chunks"
    finally:
        xfer.close()
        manager.close()
