"""The data path from a pool on the device: pinned host slots, side-stream ordering, and
store/restore through the CPU and disk tiers, bit-exact, blocking and streamed layer by
layer, also while another sequence decodes in the same forward passes."""

from __future__ import annotations

import pytest
import torch

from kvtier.chunk_format import kv_payload_bytes, max_chunk_bytes
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.host_buffers import HostBuffer, StagingPool
from kvtier.connectors.tiers.manager import TierManager
from kvtier.engine.model_runner import ModelRunner
from kvtier.gpu_pool.kernels import gather_blocks
from kvtier.make_model.writer import make_model
from kvtier.transfer.kv_transfer import KVTransfer
from tests.cuda.conftest import sync


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("m") / "tiny", seed=3).path


def _runner(model_dir, device, blocks=256) -> ModelRunner:
    return ModelRunner(model_dir, dtype="bfloat16", device=device, num_blocks=blocks)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n,), generator=g).tolist()


def _compute(runner: ModelRunner, sid: str, tokens: list[int]) -> None:
    added = runner.add_sequence(sid, tokens)
    runner.run([(sid, max(len(tokens) - added.num_cached_tokens, 1))])
    runner.free_sequence(sid)


def _pool_kv(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    blocks = runner.pool.manager.match_prefix(tokens, runner.fingerprint)
    return gather_blocks(runner.pool.storage.kv, blocks).clone()


def _tier(kind: str, runner: ModelRunner, chunk_tokens: int, tmp_path):
    cfg = runner.config
    slot = max_chunk_bytes(cfg.num_hidden_layers, kv_payload_bytes(
        cfg.num_hidden_layers, chunk_tokens, cfg.num_key_value_heads, cfg.head_dim,
        runner.pool.storage.kv.element_size()))
    if kind == "cpu":
        return CPUTier(16 * slot, slot)
    return DiskTier(tmp_path / "disk", fsync=True)


def _transfer(runner, tier, chunk_tokens) -> KVTransfer:
    return KVTransfer(runner, TierManager([tier], fingerprint=runner.fingerprint,
                                          promote_on_hit=False), chunk_tokens)


def test_host_slots_are_pinned_on_cuda(device):
    cuda = device.type == "cuda"
    buf = HostBuffer(3 << 20)
    assert buf.pinned is cuda and buf.tensor.is_pinned() is cuda
    buf.close()
    staging = StagingPool()
    slot = staging.acquire(5 << 20)
    assert slot.is_pinned() is cuda and slot.data_ptr() % 4096 == 0
    staging.release(slot)
    assert staging.acquire(5 << 20).data_ptr() == slot.data_ptr()  # reused, not reallocated
    assert staging.allocations == 1
    tier = CPUTier(8 << 20, 1 << 20)
    assert tier.pinned is cuda
    tier.close()


def test_host_buffers_dropped_without_close_leave_no_registration(device):
    """A buffer dropped without ``close`` is unpinned with it: the next mapping, often at
    the same address, pins again, and no CUDA error is left for the next kernel to report
    (found on an H200: "part or all of the requested memory range is already mapped")."""
    cuda = device.type == "cuda"
    for _ in range(8):
        buf = HostBuffer(8 << 20)
        assert buf.pinned is cuda
        view = buf.tensor[: 1 << 20]
        del buf  # unpinned now; the view keeps the mapping alive and still usable
        view.fill_(3)
        assert int(view[-1]) == 3 and view.is_pinned() is False
        del view
    torch.ones(4, device=device).add_(1)  # a launch check would raise a pending error
    if cuda:
        torch.cuda.synchronize()


def test_pinned_slot_round_trip_on_a_side_stream(device):
    """A slot filled from the device on a side stream and read back on another: the bytes
    arrive once the recorded event says so, never before."""
    n = 8 << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    buf = HostBuffer(n)
    slot = buf.tensor[:n]
    back = torch.empty_like(src)
    if device.type == "cuda":
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            slot.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        done.synchronize()
        other = torch.cuda.Stream(device)
        with torch.cuda.stream(other):
            back.copy_(slot, non_blocking=True)
        torch.cuda.current_stream(device).wait_stream(other)
    else:
        slot.copy_(src)
        back.copy_(slot)
    assert torch.equal(back, src)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streamed"])
def test_store_and_restore_are_bit_exact(device, sizes, model_dir, tmp_path, kind, stream):
    runner = _runner(model_dir, device)
    tokens = _tokens(sizes.tokens, seed=1)
    _compute(runner, "a", tokens)
    before = _pool_kv(runner, tokens)
    tier = _tier(kind, runner, sizes.chunk_tokens, tmp_path)
    xfer = _transfer(runner, tier, sizes.chunk_tokens)
    saved = xfer.save(tokens)
    whole = len(tokens) - len(tokens) % runner.pool.block_size
    assert saved.tokens == whole and not saved.failed
    xfer.evict(tokens)
    assert runner.pool.manager.match_prefix(tokens, runner.fingerprint) == []
    runner.pool.storage.kv.fill_(float("nan"))  # a block the restore misses reads as NaN
    loaded = xfer.load(tokens, saved.tokens, stream=stream)
    assert loaded.tokens == whole and loaded.from_tiers == whole
    if loaded.pending is not None:
        loaded.pending.wait()
        runner.reap_layer_loads()
    after = _pool_kv(runner, tokens)  # on the current stream, right after the restore
    sync(device)
    assert torch.equal(after, before)
    xfer.close()
    tier.close()


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
def test_compressed_restore_decodes_on_the_device(device, sizes, model_dir, tmp_path, codec):
    """A compressed disk tier: the stored bytes cross to the device and are decoded in the
    scatter, giving exactly the KV the host decode of the same chunks gives (a host pool
    restoring them is the reference), within the codec's bound of the computed KV."""
    from kvtier.kv_codecs import ERROR_BOUND, Codec

    runner = _runner(model_dir, device)
    tokens = _tokens(sizes.tokens, seed=2)
    _compute(runner, "a", tokens)
    before = _pool_kv(runner, tokens)
    tier = _tier("disk", runner, sizes.chunk_tokens, tmp_path)
    tier.codec = Codec(codec)
    xfer = _transfer(runner, tier, sizes.chunk_tokens)
    xfer.restorer.device_copies = True  # the device route, also on the CPU dry run
    saved = xfer.save(tokens)
    assert saved.tokens and not saved.failed
    xfer.evict(tokens)
    runner.pool.storage.kv.fill_(float("nan"))
    loaded = xfer.load(tokens, saved.tokens)
    assert loaded.from_tiers == saved.tokens
    after = _pool_kv(runner, tokens[: saved.tokens])
    sync(device)
    host = _runner(model_dir, "cpu")
    host_xfer = _transfer(host, tier, sizes.chunk_tokens)
    assert host_xfer.load(tokens, saved.tokens).from_tiers == saved.tokens
    assert torch.equal(after.cpu(), _pool_kv(host, tokens[: saved.tokens]))
    exact = before[:, :, : saved.tokens].float().cpu()
    err = (after.float().cpu() - exact).abs()
    assert bool(torch.isfinite(after).all())
    assert float(err.max()) <= ERROR_BOUND[Codec(codec)] * float(exact.abs().max()) + 1e-6
    host_xfer.close()
    xfer.close()
    tier.close()


def test_a_corrupt_chunk_is_recomputed_with_every_later_one(device, sizes, model_dir, tmp_path):
    """The block path's failure rule on the device: one byte flipped in the last layer of
    the second stored chunk. The restore serves the first chunk only (the second fails its
    check where it landed; the third, intact, is not served either), and the next token's
    logits over the whole prompt equal those of a run that never offloaded."""
    runner = _runner(model_dir, device)
    tokens = _tokens(sizes.tokens, seed=5)
    _compute(runner, "a", tokens)
    tier = _tier("cpu", runner, sizes.chunk_tokens, tmp_path)
    xfer = _transfer(runner, tier, sizes.chunk_tokens)
    xfer.restorer.device_copies = True  # the device route, also on the CPU dry run
    saved = xfer.save(tokens)
    assert saved.stored >= 3
    with tier.lease([saved.keys[1]]) as (view,):
        view[-3] ^= 0xFF
    xfer.evict(tokens)
    loaded = xfer.load(tokens, saved.tokens, stream=False)
    assert loaded.from_tiers == sizes.chunk_tokens  # the first chunk only
    assert xfer.manager.lookup(saved.keys[1:2]).length == 0  # dropped from its tier
    prompt = tokens + _tokens(8, seed=6)
    added = runner.add_sequence("b", prompt)
    assert added.num_cached_tokens == sizes.chunk_tokens
    got = runner.run([("b", len(prompt) - added.num_cached_tokens)])
    fresh = _runner(model_dir, device)
    fresh.add_sequence("b", prompt)
    want = fresh.run([("b", len(prompt))])
    sync(device)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2)  # bf16: chunked vs whole prefill
    xfer.close()
    tier.close()


def test_a_store_waits_for_the_kv_written_before_it(device, sizes, model_dir, tmp_path):
    """The store's gather runs on a side stream: it must see every write the current stream
    queued before the store was asked for, however long that stream is still busy."""
    runner = _runner(model_dir, device)
    tokens = _tokens(sizes.tokens, seed=2)
    _compute(runner, "a", tokens)
    blocks = runner.pool.manager.match_prefix(tokens, runner.fingerprint)
    kv = runner.pool.storage.kv
    ids = torch.tensor(blocks, device=device)
    if device.type == "cuda":
        torch.cuda._sleep(200_000_000)  # the current stream stays busy for a while
    kv.index_fill_(1, ids, 7.0)  # queued behind the sleep
    tier = _tier("cpu", runner, sizes.chunk_tokens, tmp_path)
    xfer = _transfer(runner, tier, sizes.chunk_tokens)
    saved = xfer.save(tokens)
    xfer.evict(tokens)
    kv.fill_(0.0)
    loaded = xfer.load(tokens, saved.tokens, stream=False)
    restored = _pool_kv(runner, tokens)
    sync(device)
    assert loaded.tokens == saved.tokens > 0
    assert bool((restored == 7.0).all())
    xfer.close()
    tier.close()


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_streamed_restore_under_a_concurrent_decode(device, sizes, model_dir, tmp_path, kind):
    """Session B's KV streams in layer by layer while session A decodes: the forward passes
    that carry both (A's decode step, B's new turn over its restored history) compute what
    they compute with B's history still in the pool."""
    history, turn = _tokens(sizes.tokens, seed=3), _tokens(17, seed=4)
    a_prompt = _tokens(40, seed=5)

    def decode_a_and_resume_b(runner: ModelRunner, restore) -> list[torch.Tensor]:
        runner.add_sequence("A", a_prompt)
        out = [runner.run([("A", len(a_prompt))])[0]]
        a_tokens = list(a_prompt)
        restore()
        runner.add_sequence("B", history + turn)
        assert runner.pool.sequence("B").num_computed_tokens == len(history) - len(history) % 16
        b_new = len(history) + len(turn) - runner.pool.sequence("B").num_computed_tokens
        for step in range(4):
            a_tokens.append(int(out[-1].argmax()))
            runner.append_tokens("A", a_tokens[-1:])
            batch = [("A", 1)] + ([("B", b_new)] if step == 0 else [])
            logits = runner.run(batch)
            out.append(logits[0])
            if step == 0:
                out.append(logits[1])
        runner.free_sequence("A")
        runner.free_sequence("B")
        return out

    ref = _runner(model_dir, device)
    _compute(ref, "h", history)
    expected = decode_a_and_resume_b(ref, lambda: None)

    run = _runner(model_dir, device)
    _compute(run, "h", history)
    tier = _tier(kind, run, sizes.chunk_tokens, tmp_path)
    xfer = _transfer(run, tier, sizes.chunk_tokens)
    saved = xfer.save(history)
    xfer.evict(history)
    pending = []

    def restore():
        loaded = xfer.load(history + turn, saved.tokens, stream=True)
        assert loaded.tokens == saved.tokens
        pending.append(loaded.pending)

    got = decode_a_and_resume_b(run, restore)
    sync(device)
    assert pending and pending[0] is not None  # it did stream
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    xfer.close()
    tier.close()
