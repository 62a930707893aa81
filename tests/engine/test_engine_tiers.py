"""Sessions leave the pool and come back through the tiers: bit-exact KV, the same replies
as never offloading, swap-out on preemption, and clear errors."""

from __future__ import annotations

import pytest
import torch

from kvtier.config import TiersConfig
from kvtier.connectors.tiers.blobs import get_blobs, put_blobs
from kvtier.engine.engine import Engine, UnknownSessionError
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import InvalidArgumentError
from kvtier.gpu_pool.kernels import gather_blocks
from kvtier.make_model.writer import make_model
from tests.engine_config import engine_config

GREEDY = SamplingParams(max_tokens=10)
SYSTEM = "You are a helpful assistant who answers about offloading KV caches. " * 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_model("tiny", tmp_path_factory.mktemp("m") / "tiny", seed=7).path


TIER_SETUPS = {
    "cpu": dict(cpu_bytes=64 << 20, disk_bytes=0),
    "disk": dict(cpu_bytes=0, disk_bytes=256 << 20),
    "cpu+disk": dict(cpu_bytes=64 << 20, disk_bytes=256 << 20),
}


def _engine(model_dir, tmp_path, tiers: dict | None, **kw) -> Engine:
    cfg = None
    if tiers is not None:
        cfg = TiersConfig(disk_dir=str(tmp_path / "chunks"), disk_fsync=False, **tiers)
    opts = dict(num_blocks=128, tiers=cfg, chunk_tokens=64, stream_restore=True)
    opts.update(kw)
    return Engine(model_dir, engine_config(**opts))


def _session_kv(engine: Engine, sid: str) -> torch.Tensor:
    ids = engine.sessions[sid].token_ids
    blocks = engine.runner.pool.manager.match_prefix(ids, engine.runner.fingerprint)
    return gather_blocks(engine.runner.pool.storage.kv, blocks).clone()


@pytest.mark.parametrize("setup", list(TIER_SETUPS))
def test_offload_then_resume_equals_never_offloading(model_dir, tmp_path, setup):
    plain = _engine(model_dir, tmp_path / "plain", None)
    plain.chat("s", "Tell me about the mountains and the weather there.", GREEDY, system=SYSTEM)
    expected = plain.chat("s", "And in winter?", GREEDY)

    eng = _engine(model_dir, tmp_path, TIER_SETUPS[setup])
    try:
        eng.chat("s", "Tell me about the mountains and the weather there.", GREEDY, system=SYSTEM)
        kv_before = _session_kv(eng, "s")
        off = eng.offload("s", TIER_SETUPS[setup]["cpu_bytes"] and "cpu" or "disk")
        assert off.stored_tokens == kv_before.shape[2] and off.freed_blocks > 0 and not off.failed
        assert _session_kv(eng, "s").shape[2] == 0  # nothing of it left in the pool
        restored = eng.restore("s")
        assert restored.from_tiers == off.stored_tokens
        assert torch.equal(_session_kv(eng, "s"), kv_before)  # bit-exact round trip
        eng.offload("s")  # and once more, so the resumed turn must restore by itself
        turn2 = eng.chat("s", "And in winter?", GREEDY)
    finally:
        eng.close()
    assert turn2.token_ids == expected.token_ids
    assert turn2.stats.restored_tokens == off.stored_tokens
    assert turn2.stats.reused_tokens >= off.stored_tokens
    assert turn2.stats.recomputed_tokens == expected.stats.recomputed_tokens


def test_many_sessions_sharing_a_system_prompt(model_dir, tmp_path):
    eng = _engine(model_dir, tmp_path, TIER_SETUPS["cpu+disk"], num_blocks=256)
    try:
        sids = [f"u{i}" for i in range(6)]
        eng.chat_many([(s, f"question number {i} about caches") for i, s in enumerate(sids)],
                      GREEDY, system=SYSTEM)
        before = {s: _session_kv(eng, s) for s in sids}
        results = [eng.offload(s) for s in sids]
        assert all(not r.failed for r in results)
        cpu = eng.tiers.tiers[0]
        # The system prompt's chunk is stored once, not once per session.
        keys = [eng.kv._keys(eng.sessions[s].token_ids[: results[i].stored_tokens])
                for i, s in enumerate(sids)]
        first = {k[0].key for k in keys}
        assert len(first) == 1
        distinct = {ck.key for ks in keys for ck in ks}
        assert len(cpu) == len(distinct)
        for s in reversed(sids):
            eng.restore(s)
            assert torch.equal(_session_kv(eng, s), before[s]), s
    finally:
        eng.close()


def test_preempted_sequences_swap_out_instead_of_recomputing(model_dir, tmp_path):
    prompts = [[int(x) for x in torch.randint(10, 900, (70,), generator=torch.Generator().manual_seed(i))]
               for i in range(6)]
    alone = []
    for p in prompts:
        e = _engine(model_dir, tmp_path / "alone", None, num_blocks=64)
        alone.append(e.generate([p], SamplingParams(max_tokens=24))[0].output_ids)
    eng = _engine(model_dir, tmp_path, TIER_SETUPS["cpu"], num_blocks=26)
    try:
        reqs = eng.generate(prompts, SamplingParams(max_tokens=24))
        assert eng.scheduler.preemptions > 0
        assert sum(r.num_swapped_in_tokens for r in reqs) > 0
        assert [r.output_ids for r in reqs] == alone
    finally:
        eng.close()


def test_offload_errors_are_clear(model_dir, tmp_path):
    no_tiers = _engine(model_dir, tmp_path, None)
    no_tiers.chat("s", "hello", GREEDY)
    with pytest.raises(InvalidArgumentError, match="no lower tiers"):
        no_tiers.offload("s")
    eng = _engine(model_dir, tmp_path, TIER_SETUPS["cpu"])
    try:
        with pytest.raises(UnknownSessionError, match="unknown session 'nope'"):
            eng.offload("nope")
        eng.chat("s", "hello", GREEDY)
        with pytest.raises(InvalidArgumentError, match="unknown tier 'tape'"):
            eng.offload("s", "tape")
    finally:
        eng.close()


def test_offload_to_redis_then_resume_equals_never_offloading(model_dir, tmp_path, redis_server):
    """The same round trip through a real redis-server, then with Redis stopped: the turn
    falls back to recompute, the engine keeps serving, and the failure is counted."""
    plain = _engine(model_dir, tmp_path / "plain", None)
    plain.chat("r", "Tell me about the sea.", GREEDY, system=SYSTEM)
    expected = plain.chat("r", "And the tides?", GREEDY)
    tiers = dict(cpu_bytes=0, disk_bytes=0, redis_url=redis_server.url)
    eng = _engine(model_dir, tmp_path, tiers)
    try:
        eng.chat("r", "Tell me about the sea.", GREEDY, system=SYSTEM)
        off = eng.offload("r", "redis")
        assert off.tier == "redis" and off.stored_tokens > 0 and not off.failed
        turn2 = eng.chat("r", "And the tides?", GREEDY)
        assert turn2.token_ids == expected.token_ids
        assert turn2.stats.restored_tokens == off.stored_tokens
        # Redis goes away while the session is offloaded: recompute, keep serving.
        eng.offload("r", "redis")
        redis_server.stop()
        turn3 = eng.chat("r", "Thanks!", GREEDY)
        assert turn3.stats.restored_tokens == 0 and turn3.stats.finish_reason == "length"
        redis = eng.tiers.tiers[0]
        assert sum(redis.stats.errors.values()) > 0
    finally:
        eng.close()


from tests import redis_servers  # noqa: E402

redis_server = redis_servers.redis_server  # the real-server fixtures, used by name
redis_cluster = redis_servers.redis_cluster


def test_sessions_resume_on_another_engine_through_a_redis_cluster(model_dir, tmp_path,
                                                                    redis_cluster):
    """The scale-out path: a session offloaded by one engine resumes on another node's
    engine from a real 3-node Redis Cluster, with the reply of a never-offloaded run."""
    plain = _engine(model_dir, tmp_path / "plain", None)
    plain.chat("c", "Tell me about clusters.", GREEDY, system=SYSTEM)
    expected = plain.chat("c", "How many nodes?", GREEDY)
    tiers = dict(cpu_bytes=0, disk_bytes=0, redis_url=redis_cluster.url)
    node_a = _engine(model_dir, tmp_path / "a", tiers)
    node_b = _engine(model_dir, tmp_path / "b", tiers)
    try:
        node_a.chat("c", "Tell me about clusters.", GREEDY, system=SYSTEM)
        off = node_a.offload("c", "redis")
        assert off.stored_tokens > 0 and not off.failed
        node_b.sessions["c"] = node_a.sessions.pop("c")  # the session record moves nodes
        turn2 = node_b.chat("c", "How many nodes?", GREEDY)
        assert turn2.stats.restored_tokens == off.stored_tokens
        assert turn2.token_ids == expected.token_ids
    finally:
        node_a.close()
        node_b.close()


def test_background_offload_overlaps_serving_and_caps_bytes_in_flight(model_dir, tmp_path):
    """Offloads copy the KV out at once and store it on worker threads while other sessions
    keep being served; the copies in flight never exceed the cap; the blocks are freed when
    the store is done; a session resumed meanwhile keeps its blocks."""
    plain = _engine(model_dir, tmp_path / "plain", None, num_blocks=256)
    expected = {}
    for i in range(4):
        plain.chat(f"s{i}", f"first turn of session {i}", GREEDY, system=SYSTEM)
        expected[f"s{i}"] = plain.chat(f"s{i}", "second turn", GREEDY).token_ids
    eng = _engine(model_dir, tmp_path, TIER_SETUPS["cpu+disk"], num_blocks=256,
                  max_inflight_bytes=1)  # every store waits for the one before it
    try:
        for i in range(4):
            eng.chat(f"s{i}", f"first turn of session {i}", GREEDY, system=SYSTEM)
        futures = {f"s{i}": eng.offload(f"s{i}", "disk", wait=False) for i in (1, 2)}
        got = {"s3": eng.chat("s3", "second turn", GREEDY).token_ids}  # serving goes on
        # A session resumed while its offload is in flight keeps its blocks.
        futures["s0"] = eng.offload("s0", "disk", wait=False)
        got["s0"] = eng.chat("s0", "second turn", GREEDY).token_ids
        eng.transfers.drain()
        results = {sid: f.result(timeout=30) for sid, f in futures.items()}
        assert results["s0"].freed_blocks == 0  # resumed before its store finished
        eng.step()  # settles finished offloads
        assert all(not r.failed and r.stored_tokens > 0 for r in results.values())
        assert eng.transfers.peak_inflight_bytes <= max(
            eng.runner.pool.storage.bytes_per_token * r.stored_tokens for r in results.values()
        )
        assert eng.sessions["s1"].offloaded and eng.sessions["s2"].offloaded
        for sid in ("s1", "s2"):
            turn = eng.chat(sid, "second turn", GREEDY)
            assert turn.stats.restored_tokens > 0
            got[sid] = turn.token_ids
        assert got == expected
    finally:
        eng.close()


@pytest.mark.parametrize("route", ["host", "device"])
@pytest.mark.parametrize("stream", [True, False])
def test_a_flipped_byte_in_chunk_k_recomputes_it_and_every_later_chunk(
    model_dir, tmp_path, stream, route
):
    """The block path's failure rule through the engine: one byte flipped in the last layer
    of the session's second chunk. The first chunk is restored; the second fails its check
    (on the host, or where the bytes land on the device: ``route``), and it and every later
    chunk are recomputed, though the third is intact. A streamed restore has already
    published them when the bad layer turns up, so the engine takes them back out (a lost
    restore); a blocking one ends at that chunk before publishing anything of it. The
    reply is the reply of a run that never offloaded."""
    from kvtier.chunk_format import parse_header

    plain = _engine(model_dir, tmp_path / "plain", None)
    plain.chat("s", "Tell me about the mountains and the weather there.", GREEDY, system=SYSTEM)
    expected = plain.chat("s", "And in winter?", GREEDY)
    eng = _engine(model_dir, tmp_path, TIER_SETUPS["cpu"], stream_restore=stream,
                  chunk_tokens=32)
    eng.kv.restorer.device_copies = route == "device"
    try:
        eng.chat("s", "Tell me about the mountains and the weather there.", GREEDY, system=SYSTEM)
        off = eng.offload("s", "cpu")
        assert off.stored_tokens >= 3 * 32  # a chunk after the corrupt one is stored
        cpu = eng.tiers.tiers[0]
        keys = eng.kv._keys(eng.sessions["s"].token_ids[: 3 * 32])
        blob = bytearray(get_blobs(cpu, [keys[1].key])[0])
        header, _ = parse_header(blob)
        blob[len(blob) - header.layer_nbytes + 7] ^= 0xFF  # the last layer
        cpu.delete([keys[1].key])
        put_blobs(cpu, {keys[1].key: bytes(blob)})
        turn2 = eng.chat("s", "And in winter?", GREEDY)
        if not stream:  # a streamed restore counts what it published before the loss
            assert turn2.stats.restored_tokens == 32  # the first chunk only
        assert get_blobs(cpu, [keys[2].key])[0] is not None  # intact, only not served
        assert eng.kv.lost_restores == (1 if stream else 0)
        assert eng.runner.layer_loads == []
        eng.runner.pool.block_pool.check_invariants()
    finally:
        eng.close()
    assert turn2.token_ids == expected.token_ids


def test_a_restore_lost_during_a_step_abandons_the_step_and_recomputes(model_dir, tmp_path):
    """The scheduler's side of a lost streamed restore: the forward is waiting for layer 1
    when the loader gives up on the chunk; the step is abandoned, the request over those
    blocks is recomputed, and the reply is unchanged."""
    import threading
    import time

    from kvtier.engine.scheduler import RequestState
    from kvtier.transfer.layer_load import LayerLoad

    first = "Tell me about the mountains and the weather there."
    plain = _engine(model_dir, tmp_path / "plain", None)
    plain.chat("s", first, GREEDY, system=SYSTEM)
    expected = plain.chat("s", "And in winter?", GREEDY)

    eng = _engine(model_dir, tmp_path, None)
    eng.chat("s", first, GREEDY, system=SYSTEM)
    history = eng.sessions["s"].token_ids
    blocks = eng.runner.pool.manager.match_prefix(history, eng.runner.fingerprint)
    turn = eng.begin_turn("s", "And in winter?", GREEDY)
    load = LayerLoad(eng.runner.config.num_hidden_layers, [blocks[2:]])
    load.layer_loaded(0)
    eng.runner.add_layer_load(load)

    def lose_it_once_running() -> None:
        while turn.request.state is not RequestState.RUNNING:
            time.sleep(0.001)
        load.poison(0, "tier went away")
        load.finish()

    t = threading.Thread(target=lose_it_once_running)
    t.start()
    eng.run_until_done([turn.request])
    t.join()
    result = eng.finish_turn(turn)
    assert turn.request.num_preemptions == 1
    assert eng.runner.layer_loads == []
    assert result.token_ids == expected.token_ids
    eng.runner.pool.block_pool.check_invariants()


def test_a_session_leaving_for_a_faster_tier_is_written_there_though_a_deeper_copy_exists(
        model_dir, tmp_path):
    """The policy picked the CPU tier for a session whose chunks only the disk holds: a
    restore from the CPU beats one from disk, so the offload writes them there too (the
    policy simulator's raise rule), and the KV still round-trips bit-exact."""
    eng = _engine(model_dir, tmp_path, TIER_SETUPS["cpu+disk"])
    try:
        eng.chat("s", "Tell me about the mountains and the weather there.", GREEDY, system=SYSTEM)
        kv_before = _session_kv(eng, "s")
        off = eng.offload("s", "disk")
        keys = [k.key for k in eng.kv._keys(eng.sessions["s"].token_ids[: off.stored_tokens])]
        cpu, disk = eng.kv.manager.tiers
        assert disk.contains_prefix(keys) == len(keys)
        cpu.delete(keys)  # whatever a restore promoted: only the disk holds the session
        eng.restore("s")
        assert cpu.contains_prefix(keys) == 0
        again = eng.offload("s", "cpu")
        assert not again.failed and again.freed_blocks > 0
        assert cpu.contains_prefix(keys) == len(keys)  # raised to the tier the policy chose
        eng.restore("s")
        assert torch.equal(_session_kv(eng, "s"), kv_before)
    finally:
        eng.close()


@pytest.mark.parametrize(("medium", "codec"), [("disk", "int8"), ("disk", "int4"),
                                              ("redis", "fp8")])
def test_offload_to_a_compressed_tier_and_resume(model_dir, tmp_path, request, medium, codec):
    """A session offloaded to a tier that keeps its KV encoded comes back decoded, every
    value within the codec's bound of its vector's largest, and the next turn uses it; the
    chunks at rest are smaller than the KV and checksummed."""
    if medium == "disk":
        tiers = dict(cpu_bytes=0, disk_bytes=256 << 20, disk_codec=codec)
    else:
        url = request.getfixturevalue("redis_server").url
        tiers = dict(cpu_bytes=0, disk_bytes=0, redis_url=url, redis_codec=codec)
    eng = _engine(model_dir, tmp_path, tiers)
    try:
        eng.chat("s", "Tell me about the mountains and the weather there.", GREEDY, system=SYSTEM)
        kv_before = _session_kv(eng, "s")
        off = eng.offload("s", medium)
        assert off.stored_tokens == kv_before.shape[2] and not off.failed
        tier = eng.tiers.tiers[eng.tiers.tier_index(medium)]
        assert 0 < tier.used_bytes < kv_before.numel() * kv_before.element_size() * 0.6
        restored = eng.restore("s")
        assert restored.from_tiers == off.stored_tokens
        kv_after = _session_kv(eng, "s")
        assert kv_after.shape == kv_before.shape and not torch.equal(kv_after, kv_before)
        bound = {"int8": 1 / 127, "fp8": 1 / 16, "int4": 1 / 7}[codec]
        amax = kv_before.float().abs().amax(dim=(-3, -1), keepdim=True)  # per block, K/V, head
        assert torch.all((kv_after.float() - kv_before.float()).abs() <= amax * bound + 1e-6)
        eng.offload("s")
        turn2 = eng.chat("s", "And in winter?", GREEDY)
        assert turn2.stats.restored_tokens == off.stored_tokens
    finally:
        eng.close()
