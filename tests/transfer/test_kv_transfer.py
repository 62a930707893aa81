"""Saving KV from the paged pool to the tiers and restoring it: bit-exact, deduplicated,
verified, and a resume over restored KV computes exactly what it computes over pooled KV."""

from __future__ import annotations

import pytest
import torch

from kvtier.chunk_format import encode_chunk
from kvtier.connectors.tiers.blobs import get_blobs, put_blobs
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.engine.model_runner import ModelRunner
from kvtier.gpu_pool.kernels import gather_blocks
from kvtier.make_model.writer import make_model
from kvtier.transfer.kv_transfer import KVTransfer

CHUNK = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_model("tiny", tmp_path_factory.mktemp("m") / "tiny", seed=2).path


def _runner(model_dir, blocks=96):
    return ModelRunner(model_dir, dtype="float32", device="cpu", num_blocks=blocks)


def _tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n,), generator=g).tolist()


def _chunk_bytes(runner) -> int:
    cfg = runner.config
    return 2 * cfg.num_hidden_layers * CHUNK * cfg.num_key_value_heads * cfg.head_dim * 4 + 512


def _compute(runner, sid, tokens):
    added = runner.add_sequence(sid, tokens)
    runner.run([(sid, max(len(tokens) - added.num_cached_tokens, 1))])
    runner.free_sequence(sid)


def _pool_kv(runner, tokens):
    blocks = runner.pool.manager.match_prefix(tokens, runner.fingerprint)
    return gather_blocks(runner.pool.storage.kv, blocks).clone()


def _transfer(runner, slots=32):
    tier = CPUTier(slots * _chunk_bytes(runner), _chunk_bytes(runner))
    return KVTransfer(runner, TierManager([tier], fingerprint=runner.fingerprint), CHUNK), tier


def _saved(model_dir, n: int, seed: int):
    """A runner with ``n`` random tokens computed and saved to a CPU tier."""
    runner = _runner(model_dir)
    tokens = _tokens(n, seed=seed)
    _compute(runner, "c", tokens)
    xfer, tier = _transfer(runner)
    return runner, tokens, xfer, tier, xfer.save(tokens)


def test_save_evict_load_is_bit_exact(model_dir):
    runner = _runner(model_dir)
    tokens = _tokens(200)  # 3 chunks of 64 + a tail of 8 (whole blocks of 16: 192 tokens)
    _compute(runner, "a", tokens)
    before = _pool_kv(runner, tokens)
    xfer, tier = _transfer(runner)
    saved = xfer.save(tokens)
    assert saved.tokens == 192 and saved.stored == 3 and not saved.failed and len(tier) == 3
    assert xfer.evict(tokens) == 12
    assert runner.pool.manager.match_prefix(tokens, runner.fingerprint) == []
    loaded = xfer.load(tokens, saved.tokens)
    assert (loaded.tokens, loaded.from_tiers, loaded.from_pool) == (192, 192, 0)
    assert torch.equal(_pool_kv(runner, tokens), before)


class _CountingManager(TierManager):
    lookups = 0

    def lookup(self, keys):
        self.lookups += 1
        return super().lookup(keys)


def test_a_planned_restore_reads_what_its_lookup_saw(model_dir):
    runner = _runner(model_dir)
    tokens = _tokens(200, seed=9)
    _compute(runner, "p", tokens)
    before, head = _pool_kv(runner, tokens), _pool_kv(runner, tokens[:128])
    tier = CPUTier(32 * _chunk_bytes(runner), _chunk_bytes(runner))
    manager = _CountingManager([tier], fingerprint=runner.fingerprint)
    xfer = KVTransfer(runner, manager, CHUNK)
    assert xfer.save(tokens).tokens == 192
    xfer.evict(tokens)
    found = xfer.stored_prefix(tokens, 192)
    assert found.cached == 0 and found.chunks == [(64, "cpu")] * 3
    seen = manager.lookups
    # the plan loads two of the three chunks; the load asks no tier again
    loaded = xfer.load(tokens, 128, found=found)
    assert loaded.tokens == 128 and manager.lookups == seen
    assert torch.equal(_pool_kv(runner, tokens[:128]), head)
    # the rest, looked up afresh (the pool changed since): the whole prefix, bit-exact
    assert xfer.load(tokens, 192).tokens == 192 and manager.lookups == seen + 1
    assert torch.equal(_pool_kv(runner, tokens), before)


def test_tail_chunk_restores_exactly(model_dir):
    runner = _runner(model_dir)
    tokens = _tokens(90, seed=3)  # one chunk + a tail of 16 tokens (80 in whole blocks)
    _compute(runner, "t", tokens)
    before = _pool_kv(runner, tokens)
    xfer, tier = _transfer(runner)
    assert xfer.save(tokens).tokens == 80
    xfer.evict(tokens)
    assert xfer.load(tokens, 80).tokens == 80
    assert torch.equal(_pool_kv(runner, tokens), before)


def test_resume_over_restored_kv_equals_resume_over_pooled_kv(model_dir):
    history, turn = _tokens(160, seed=4), _tokens(23, seed=5)
    # Reference: the history computed in the pool, then the new turn on top.
    ref = _runner(model_dir)
    _compute(ref, "h", history)
    ref.add_sequence("r", history + turn)
    assert ref.pool.sequence("r").num_computed_tokens == 160
    expected = ref.run([("r", 23)])
    # Restored: the history saved, dropped from the pool, loaded back, then the same turn.
    run = _runner(model_dir)
    _compute(run, "h", history)
    xfer, _ = _transfer(run)
    xfer.save(history)
    xfer.evict(history)
    assert xfer.load(history + turn, 160).tokens == 160
    run.add_sequence("r", history + turn)
    assert run.pool.sequence("r").num_computed_tokens == 160
    assert torch.equal(run.run([("r", 23)]), expected)


def test_shared_prefix_is_stored_once(model_dir):
    runner = _runner(model_dir, blocks=128)
    system = _tokens(128, seed=6)
    a, b = system + _tokens(64, seed=7), system + _tokens(64, seed=8)
    _compute(runner, "a", a)
    _compute(runner, "b", b)
    xfer, tier = _transfer(runner)
    ra, rb = xfer.save(a), xfer.save(b)
    assert (ra.stored, rb.stored, rb.already) == (3, 1, 2)
    assert len(tier) == 4


def test_other_models_chunks_are_never_loaded(model_dir):
    runner = _runner(model_dir)
    tokens = _tokens(64, seed=9)
    _compute(runner, "x", tokens)
    xfer, tier = _transfer(runner)
    key = xfer._keys(tokens)[0].key
    # A chunk under the right key but computed by another model (forged or colliding).
    put_blobs(tier, {key: encode_chunk(key, b"another-model", torch.zeros(2, 2, 64, 2, 16))})
    xfer.evict(tokens)
    assert xfer.load(tokens).tokens == 0
    assert xfer.manager.stats.rejected == {"mismatch": 1}
    # A whole chunk of another model is a miss that deletes nothing: in a shared tier it
    # may be another engine's (which engine may write under which key is the namespaces'
    # job, not a reader's).
    assert len(tier) == 1
    assert xfer.load(tokens).tokens == 0 and xfer.manager.stats.rejected == {"mismatch": 2}


def test_a_corrupt_chunk_is_a_miss_and_the_prefix_before_it_loads(model_dir):
    runner, tokens, xfer, tier, saved = _saved(model_dir, 192, seed=10)
    third = saved.keys[2]
    blob = bytearray(get_blobs(tier, [third])[0])
    blob[-5] ^= 0xFF
    tier.delete([third])
    put_blobs(tier, {third: bytes(blob)})
    xfer.evict(tokens)
    loaded = xfer.load(tokens)
    assert loaded.tokens == 128  # the two good chunks; the corrupt one is recomputed
    assert tier.stats.corrupt == 1  # the tier verified, deleted and counted it
    assert xfer.manager.lookup(saved.keys).length == 2


def _corrupt_layer(tier, key: str, layer: int) -> None:
    """Flip a byte inside ``layer`` of a stored chunk (its checksum then fails)."""
    from kvtier.chunk_format import parse_header

    blob = bytearray(get_blobs(tier, [key])[0])
    header, _ = parse_header(blob)
    offset = len(blob) - header.payload_nbytes + layer * header.layer_nbytes
    blob[offset + 3] ^= 0xFF
    tier.delete([key])
    put_blobs(tier, {key: bytes(blob)})


def test_streamed_load_is_bit_exact_and_releases_its_blocks(model_dir):
    runner = _runner(model_dir)
    tokens = _tokens(200, seed=11)
    _compute(runner, "a", tokens)
    before = _pool_kv(runner, tokens)
    xfer, _ = _transfer(runner)
    xfer.save(tokens)
    xfer.evict(tokens)
    free_before = runner.pool.block_pool.num_free
    loaded = xfer.load(tokens, stream=True)
    assert loaded.pending is not None and loaded.tokens == 192
    assert runner.layer_loads == [loaded.pending]
    loaded.pending.wait()
    runner.reap_layer_loads()
    assert runner.layer_loads == []
    assert torch.equal(_pool_kv(runner, tokens), before)
    # The temporary holder is gone: the restored blocks are cached, not in use.
    assert runner.pool.block_pool.num_free == free_before
    assert all(runner.pool.block_pool.ref_count(b) == 0 for b in xfer.pool_blocks(tokens))
    xfer.close()


def test_forward_over_a_streaming_restore_equals_forward_over_pooled_kv(model_dir):
    history, turn = _tokens(192, seed=12), _tokens(17, seed=13)
    ref = _runner(model_dir)
    _compute(ref, "h", history)
    ref.add_sequence("r", history + turn)
    expected = ref.run([("r", 17)])
    run = _runner(model_dir)
    _compute(run, "h", history)
    xfer, _ = _transfer(run)
    xfer.save(history)
    xfer.evict(history)
    loaded = xfer.load(history + turn, 192, stream=True)
    assert loaded.pending is not None
    run.add_sequence("r", history + turn)  # scheduled at once, over blocks still loading
    assert run.pool.sequence("r").num_computed_tokens == 192
    assert torch.equal(run.run([("r", 17)]), expected)  # waited for each layer
    xfer.close()


def test_a_chunk_corrupt_in_a_later_layer_ends_a_blocking_load_at_that_chunk(model_dir):
    """A blocking load reads every layer at once and verifies it before publishing: the
    chunk with a bad last layer ends the restore there, and nothing published is lost."""
    runner, tokens, xfer, tier, saved = _saved(model_dir, 192, seed=14)
    _corrupt_layer(tier, saved.keys[1], runner.config.num_hidden_layers - 1)
    xfer.evict(tokens)
    loaded = xfer.load(tokens)
    assert loaded.tokens == 64  # the first chunk; the rest is recomputed
    assert runner.pool.manager.match_prefix(tokens, runner.fingerprint) == (
        runner.pool.manager.match_prefix(tokens[:64], runner.fingerprint)
    )
    assert len(runner.pool.manager.match_prefix(tokens, runner.fingerprint)) == 4
    assert xfer.lost_restores == 0
    # Checked group by group right before its scatter (a lent chunk): the failed check
    # drops the chunk from its tier, as a chunk that fails up front is.
    assert saved.keys[1] not in tier and saved.keys[0] in tier
    assert xfer.manager.stats.rejected == {"corrupt": 1}


def test_a_streamed_chunk_lost_mid_forward_stops_the_forward_and_is_uncached(model_dir):
    from kvtier.transfer.layer_load import LayerLoadError

    runner, tokens, xfer, tier, saved = _saved(model_dir, 192, seed=15)
    _corrupt_layer(tier, saved.keys[2], 1)
    xfer.evict(tokens)
    loaded = xfer.load(tokens + [5, 6], stream=True)
    assert loaded.tokens == 192  # published before the bad layer was read
    runner.add_sequence("r", tokens + [5, 6])
    with pytest.raises(LayerLoadError, match="layer 1"):
        runner.run([("r", 2)])
    lost = runner.take_poisoned_blocks()
    assert len(lost) == 4 and lost <= set(runner.pool.sequence("r").block_ids)
    runner.free_sequence("r")
    runner.reap_layer_loads(wait=True)
    assert runner.layer_loads == []
    # Only the two good chunks are still found; the lost one is gone from the prefix cache.
    assert len(runner.pool.manager.match_prefix(tokens, runner.fingerprint)) == 8
    assert xfer.lost_restores == 1
    xfer.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_chunk_of_another_shape_under_a_right_key_is_a_miss_not_a_crash(model_dir, stream):
    """A chunk that is valid, keyed right and of this model's fingerprint, but holds KV of
    another shape (one layer short: a buggy or foreign writer) is never scattered: its header
    comes with the lease, so a restore, blocking or streamed, ends before it. Nothing
    raises, nothing is lost after being published."""
    from kvtier.chunk_format import encode_chunk

    runner, tokens, xfer, tier, saved = _saved(model_dir, 192, seed=16)
    layers = runner.config.num_hidden_layers
    kv = torch.zeros(layers - 1, 2, 64, runner.config.num_key_value_heads, runner.config.head_dim)
    bad = encode_chunk(saved.keys[1], runner.fingerprint, kv.to(runner.pool.storage.kv.dtype))
    tier.delete([saved.keys[1]])
    assert put_blobs(tier, {saved.keys[1]: bad}).stored == [saved.keys[1]]
    xfer.evict(tokens)
    loaded = xfer.load(tokens, stream=stream)
    if loaded.pending is not None:
        loaded.pending.wait()
        assert loaded.pending.error is None
    assert loaded.tokens == 64 and loaded.from_tiers == 64 and xfer.lost_restores == 0
    runner.reap_layer_loads(wait=True)
    assert len(runner.pool.manager.match_prefix(tokens, runner.fingerprint)) == 4
    xfer.close()
