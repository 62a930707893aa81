"""The vLLM connector over tiers that keep chunks compressed (issue 33), with vLLM's cache
tensors faked: a load of a chunk a tier keeps as fp8, int8 or int4 gives exactly the
codec's decode of the blocks saved (no other values), in-process and through a running
``kvtier serve``; a connector that takes exact KV only (``accept_codecs: [none]``) is
never given a lossy chunk: its lookups do not count them and its loads are errors
(recomputed), its blocks untouched."""

from __future__ import annotations

import pytest
import torch

from kvtier.chunk_format import parse_header
from kvtier.config import KVTierConfig
from kvtier.connectors.chunk_store import LocalChunkStore, RemoteChunkStore, open_store
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.connectors.vllm_blocks import ChunkGrid, ChunkSpan, ChunkTransfer
from kvtier.connectors.vllm_worker import WorkerSide
from kvtier.errors import ConfigError
from kvtier.kv_codecs import Codec, decode, encode
from kvtier.server.state import ServiceState
from tests.connectors.test_vllm_worker import _sidecar_config
from tests.connectors.vllm_fakes import BLOCK, LAYERS, caches
from tests.http_server import running

FP = b"vllm-v3|test-model|fp16|bs16"
NUM_BLOCKS = 12
CHUNK_BLOCKS = 2
GRID = ChunkGrid(BLOCK, CHUNK_BLOCKS, FP)


def _chunk_bytes(kv: dict[str, torch.Tensor]) -> int:
    from kvtier.chunk_format import max_chunk_bytes

    layer = next(iter(kv.values()))
    block = LAYERS * layer.numel() * layer.element_size() // NUM_BLOCKS
    return max_chunk_bytes(LAYERS, block * CHUNK_BLOCKS)


def _worker(store, kv: dict[str, torch.Tensor], accept: frozenset[str] | None = None) -> WorkerSide:
    worker = WorkerSide(lambda: store, GRID, accept_codecs=accept)
    worker.register(kv, NUM_BLOCKS)
    return worker


def _keys(blocks: int) -> list[str]:
    return [k.key for k in GRID.keys(list(range(blocks * BLOCK)))]


def _transfer(keys: list[str], blocks: list[int]) -> list[ChunkTransfer]:
    spans = [ChunkSpan(k, tuple(blocks[i * CHUNK_BLOCKS : (i + 1) * CHUNK_BLOCKS]))
             for i, k in enumerate(keys)]
    return [ChunkTransfer("r", spans)]


def _blocks(kv: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Blocks ``ids`` of every layer as the connector's chunk holds them:
    ``[layers, 2, tokens, 1, rest]`` (the cache layout is blocks-second, token-major)."""
    per_layer = [torch.cat([t[:, b].reshape(2, BLOCK, -1) for b in ids], dim=1) for t in kv.values()]
    return torch.stack(per_layer).unsqueeze(3)


def _decoded(kv: torch.Tensor, codec: Codec) -> torch.Tensor:
    """What the codec gives back for ``kv``, each layer encoded apart (as a chunk's are)."""
    return torch.cat([decode(encode(kv[i : i + 1], codec), codec, tuple(kv[i : i + 1].shape), kv.dtype)
                      for i in range(kv.shape[0])])


def _compressing(tmp_path, codec: Codec) -> LocalChunkStore:
    disk = DiskTier(tmp_path / "d", fsync=False)
    disk.codec = codec
    return LocalChunkStore(TierManager([disk]))


@pytest.mark.parametrize("codec", [Codec.FP8, Codec.INT8, Codec.INT4])
def test_a_load_gives_exactly_the_codecs_decode_of_what_was_saved(tmp_path, codec):
    src, dst = caches(NUM_BLOCKS, False, seed=1), caches(NUM_BLOCKS, False, seed=2)
    store = _compressing(tmp_path, codec)
    keys = _keys(4)
    _worker(store, src).save(_transfer(keys, [4, 1, 7, 2]))
    tier = store.manager.tiers[0]
    with tier.lease([keys[0]]) as (view,):
        assert parse_header(memoryview(view.numpy()))[0].codec == codec.value  # kept compressed
    reader = _worker(store, dst)
    reader.load(_transfer(keys, [0, 9, 3, 5]))
    assert reader.take_load_errors() == set() and reader.stats.loaded_blocks == 4
    for saved, loaded in (([4, 1], [0, 9]), ([7, 2], [3, 5])):
        want = _decoded(_blocks(src, saved), codec)
        assert torch.equal(_blocks(dst, loaded), want)
        assert not torch.equal(want, _blocks(src, saved))  # lossy: the test sees the codec
    assert store.manager.stats.codec_reads[codec.value] == 2


def test_a_connector_that_takes_exact_kv_never_loads_a_lossy_chunk(tmp_path):
    src, dst = caches(NUM_BLOCKS, False, seed=3), caches(NUM_BLOCKS, False, seed=4)
    before = [t.clone() for t in dst.values()]
    store = _compressing(tmp_path, Codec.INT8)
    keys = _keys(2)
    _worker(store, src).save(_transfer(keys, [0, 1]))
    assert store.lookup(keys) == 1
    exact = _worker(store, dst, accept=frozenset({"none"}))  # the store would lend it
    exact.load(_transfer(keys, [5, 6]))
    assert exact.take_load_errors() == {5, 6} and exact.stats.loaded_blocks == 0
    assert all(torch.equal(a, b) for a, b in zip(dst.values(), before, strict=True))
    store.manager.accept_codecs = frozenset({"none"})  # the stack's readers take exact KV only
    assert store.lookup(keys) == 0 and store.locate(keys) == [None]
    with store.get_into(keys) as lent:
        assert lent == [None]
    assert store.manager.tiers[0].contains_each(keys) == [True]  # left where it is


def _sidecar(tmp_path, codec: str) -> KVTierConfig:
    """A sidecar keeping every chunk on disk, compressed by ``codec`` (no RAM tier)."""
    cfg = _sidecar_config(tmp_path)
    cfg.tiers.cpu_bytes = 0
    cfg.tiers.disk_dir = str(tmp_path / "disk")
    cfg.tiers.disk_fsync = False
    cfg.tiers.disk_codec = codec
    return cfg


@pytest.mark.parametrize("shm", [False, True])
def test_through_kvtier_serve_each_reader_gets_the_codecs_it_takes(tmp_path, shm):
    src, dst = caches(NUM_BLOCKS, False, seed=5), caches(NUM_BLOCKS, False, seed=6)
    before = [t.clone() for t in dst.values()]
    keys = _keys(4)
    with running(ServiceState.sidecar(_sidecar(tmp_path, "int4"))) as url:
        lossy = RemoteChunkStore(url, _chunk_bytes(src), shm=shm)
        exact = RemoteChunkStore(url, _chunk_bytes(src), shm=shm, accept_codecs=frozenset({"none"}))
        try:
            _worker(lossy, src).save(_transfer(keys, [4, 1, 7, 2]))
            assert lossy.lookup(keys) == 2 and lossy.present(keys) == [True, True]
            assert exact.lookup(keys) == 0 and exact.locate(keys) == [None, None]
            assert exact.prefetch(keys) == 0 and not exact.client.has_chunk(keys[0])
            refused = _worker(exact, dst)
            refused.load(_transfer(keys, [0, 9, 3, 5]))
            assert refused.take_load_errors() == {0, 9, 3, 5}
            assert all(torch.equal(a, b) for a, b in zip(dst.values(), before, strict=True))
            reader = _worker(lossy, dst)
            reader.load(_transfer(keys, [0, 9, 3, 5]))
            assert reader.take_load_errors() == set() and reader.stats.loaded_blocks == 4
            assert lossy.client.shm == shm
        finally:
            lossy.close()
            exact.close()
    for saved, loaded in (([4, 1], [0, 9]), ([7, 2], [3, 5])):
        assert torch.equal(_blocks(dst, loaded), _decoded(_blocks(src, saved), Codec.INT4))


def test_the_accept_codecs_option_is_checked_and_lossy_tiers_open(tmp_path):
    slot = 1 << 20
    tiers = {"cpu_bytes": 0, "disk_dir": str(tmp_path / "d"), "disk_codec": "fp8"}
    with pytest.raises(ConfigError, match="accept_codecs"):
        open_store({"tiers": tiers, "accept_codecs": ["fp8", "zstd"]}, slot)
    with pytest.raises(ConfigError, match="accept_codecs"):
        open_store({"tiers": tiers, "accept_codecs": []}, slot)
    store = open_store({"tiers": tiers, "accept_codecs": "none,fp8"}, slot)
    assert isinstance(store, LocalChunkStore)
    assert store.manager.tiers[0].codec is Codec.FP8
    assert store.manager.codecs == {"none", "fp8"}


def test_auto_codecs_are_resolved_for_the_connectors_chunks(tmp_path, monkeypatch):
    """``<tier>_codec: auto`` in the connector's own tiers: resolved by the policy for the
    connector's chunks within the configuration's budget (the default allows int8 only,
    and the RAM tier stays lossless), by the calibrated links where a profile says them;
    the tiers then keep chunks in that codec. A server's tiers (``url``) are its own."""
    from kvtier.connectors.chunk_store import with_auto_codecs
    from kvtier.connectors.tiers.codec_setup import CodecContext
    from tests.policies.test_codec_choice import cost

    ctx = CodecContext((LAYERS, 2, 256, 1, 192), torch.bfloat16, max_error=0.0)
    tiers = {"cpu_bytes": 8 << 20, "cpu_codec": "auto", "disk_dir": str(tmp_path / "d"),
             "disk_fsync": False, "disk_codec": "auto"}
    options = with_auto_codecs({"tiers": tiers, "shm": True}, ctx)
    assert options["tiers"] == {**tiers, "cpu_codec": "none", "disk_codec": "int8"}
    assert options["shm"] is True and tiers["disk_codec"] == "auto"  # a copy
    store = open_store(options, 1 << 20)
    assert [t.codec for t in store.manager.tiers] == [Codec.NONE, Codec.INT8]

    config = tmp_path / "kvtier.yaml"
    config.write_text("policy:\n  max_kv_error: 0.2\n")
    assert with_auto_codecs({"tiers": tiers, "config": str(config)}, ctx)["tiers"]["disk_codec"] == "int4"
    monkeypatch.setenv("KVTIER_POLICY__MAX_KV_ERROR", "0")
    assert with_auto_codecs({"tiers": tiers}, ctx)["tiers"]["disk_codec"] == "none"
    monkeypatch.delenv("KVTIER_POLICY__MAX_KV_ERROR")
    fast = CodecContext(ctx.chunk_shape, ctx.dtype, 0.0, cost(disk_Bps=1e13))
    assert with_auto_codecs({"tiers": tiers}, fast)["tiers"]["disk_codec"] == "none"  # faster than a decode

    assert with_auto_codecs({"tiers": tiers}, None)["tiers"]["disk_codec"] == "auto"  # an fp8 cache
    remote = {"url": "http://127.0.0.1:1", "tiers": tiers}
    assert with_auto_codecs(remote, ctx) == remote
