"""The CPU tier's in-place data path through KVTransfer: stores write slots in place,
restores scatter from leased views, and neither makes a chunk-sized Python allocation in
steady state (a ``bytes``/``bytearray`` per chunk is what the blob path paid)."""

from __future__ import annotations

import tracemalloc

import pytest
import torch

from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.engine.model_runner import ModelRunner
from kvtier.gpu_pool.kernels import gather_blocks
from kvtier.make_model.writer import make_model
from kvtier.transfer.kv_transfer import KVTransfer

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
        assert (saved.tokens, saved.stored, loaded.from_tiers) == (4 * CHUNK, 4, 4 * CHUNK)
        assert tier.stats.puts == 8 and len(tier) == 8  # every chunk went in place
        assert torch.equal(_pool_kv(runner, tokens), before)
        assert store_peak < chunk_bytes // 2, f"store: {store_peak} B for {chunk_bytes}-B chunks"
        assert load_peak < chunk_bytes // 2, f"restore: {load_peak} B for {chunk_bytes}-B chunks"
    finally:
        xfer.close()
        tier.close()
