"""The connector's path for caches off the host (a GPU's; here strided CPU caches take it):
a chunk's blocks gathered and scattered with index kernels, bit for bit what block-by-block
copies give in every cache layout and dtype; a load scatters a chunk only once verified, so
a corrupt chunk's blocks are never written; lossy chunks decoded before the scatter."""

from __future__ import annotations

import pytest
import torch

from kvtier.chunk_format import max_chunk_bytes
from kvtier.connectors.chunk_store import LocalChunkStore
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.connectors.vllm_blocks import ChunkGrid, ChunkSpan, ChunkTransfer
from kvtier.connectors.vllm_device_blocks import (
    BlockMove,
    DeviceBlocks,
    decode_on_device,
    refuse_bad,
)
from kvtier.connectors.vllm_pieces import CacheLayer
from kvtier.connectors.vllm_worker import WorkerSide
from kvtier.kv_codecs import Codec
from tests.connectors.vllm_fakes import BLOCK, LAYERS, caches, strided

NUM_BLOCKS = 12
FP = b"vllm-v3|device-blocks-test"
GRID = ChunkGrid(BLOCK, 2, FP)


def _layers(kv: dict[str, torch.Tensor]) -> list[CacheLayer]:
    dim = 0 if next(iter(kv.values())).shape[0] == NUM_BLOCKS else 1
    return [CacheLayer.of(n, t, dim) for n, t in kv.items()]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("layout", ["blocks-first", "kv-first", "strided"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_gather_and_scatter_equal_block_by_block_copies(layout, dtype, backend):
    """Index kernels a layer, or one Triton launch over a table of the layers' addresses
    (under the interpreter here; CUDA in tests/cuda)."""
    kv = caches(NUM_BLOCKS, layout == "blocks-first", seed=1, dtype=dtype)
    if layout == "strided":
        kv = strided(kv)
    layers = _layers(kv)
    if layout == "strided" and backend == "triton":  # no contiguous halves: refused
        with pytest.raises(ValueError, match="contiguous halves"):
            DeviceBlocks.of(layers, backend)
        return
    device = DeviceBlocks.of(layers, backend)
    assert (device.table is not None) == (backend == "triton")
    ids = [7, 2, 9]
    got = device.gather(1, LAYERS, ids)
    want = torch.stack([torch.stack([_bits(layer.block(b)).reshape(2, -1) for b in ids], dim=1)
                        for layer in layers[1:]])  # [layers, 2, blocks, half]: K halves, then V
    assert torch.equal(got, want)

    dst = caches(NUM_BLOCKS, layout == "blocks-first", seed=2, dtype=dtype)
    if layout == "strided":
        dst = strided(dst)
    out_layers = _layers(dst)
    before = [_bits(layer.kv).clone() for layer in out_layers]
    # the chunk's blocks 0 and 2 into cache blocks 4 and 0; block 1 vLLM's own (left alone)
    DeviceBlocks.of(out_layers, backend).scatter(got, 1, BlockMove(((0, 4), (2, 0)), 3))
    for i, layer in enumerate(out_layers):
        for b in range(NUM_BLOCKS):
            block = _bits(layer.block(b))
            if i >= 1 and b == 4:
                assert torch.equal(block, _bits(layers[i].block(7)))
            elif i >= 1 and b == 0:
                assert torch.equal(block, _bits(layers[i].block(9)))
            else:
                assert torch.equal(block, before[i].select(layer.block_dim, b))


def _store(kv: dict[str, torch.Tensor], tmp_path, codec: Codec = Codec.NONE) -> LocalChunkStore:
    layer = next(iter(kv.values()))
    block = LAYERS * layer.numel() * layer.element_size() // NUM_BLOCKS
    slot = max_chunk_bytes(LAYERS, block * GRID.chunk_blocks)
    cpu = CPUTier(16 * slot, slot)
    cpu.codec = codec
    return LocalChunkStore(TierManager([cpu, DiskTier(tmp_path / "d")]))


def _transfer(keys: list[str], blocks: list[int | None]) -> list[ChunkTransfer]:
    spans = [ChunkSpan(k, tuple(blocks[2 * i : 2 * i + 2])) for i, k in enumerate(keys)]
    return [ChunkTransfer("r", spans)]


def test_caches_whose_blocks_are_not_two_contiguous_halves_take_the_index_kernels():
    kv = {n: t.transpose(-1, -2) for n, t in caches(NUM_BLOCKS, True, seed=3).items()}
    assert DeviceBlocks.of(_layers(kv)).table is None
    with pytest.raises(ValueError, match="contiguous halves"):
        DeviceBlocks.of(_layers(kv), "triton")


def test_a_corrupt_chunk_is_never_scattered_and_the_rest_load(tmp_path):
    src, dst = strided(caches(NUM_BLOCKS, False, seed=5)), strided(caches(NUM_BLOCKS, False, seed=6))
    before = {n: t.clone() for n, t in dst.items()}
    store = _store(src, tmp_path)
    keys = [k.key for k in GRID.keys(list(range(8 * BLOCK)))]
    writer, reader = WorkerSide(lambda: store, GRID), WorkerSide(lambda: store, GRID)
    writer.register(src, NUM_BLOCKS)
    reader.register(dst, NUM_BLOCKS)
    assert reader._device is not None  # the path under test
    writer.save(_transfer(keys[:3], [0, 1, 2, 3, 4, 5]))
    with store.manager.tiers[0].lease([keys[1]]) as (view,):
        view[-3] ^= 0xFF  # a flipped byte in the last layer of the second chunk
    reader.load(_transfer(keys, [4, 5, 6, 7, 8, 9, 10, 11]))  # the fourth was never stored
    assert reader.take_load_errors() == {6, 7, 10, 11}
    assert reader.stats.loaded_blocks == 4 and store.lookup(keys[1:2]) == 0  # dropped
    for name in src:
        assert torch.equal(dst[name][:, [4, 5, 8, 9]], src[name][:, [0, 1, 4, 5]])
        # the corrupt chunk's blocks were never written, not even its good layers
        assert torch.equal(dst[name][:, [6, 7, 10, 11]], before[name][:, [6, 7, 10, 11]])


@pytest.mark.parametrize("codec", [Codec.FP8, Codec.INT8, Codec.INT4])
def test_lossy_chunks_are_decoded_before_the_scatter(tmp_path, codec):
    src, dst = strided(caches(NUM_BLOCKS, True, seed=7)), strided(caches(NUM_BLOCKS, True, seed=8))
    exact = strided(caches(NUM_BLOCKS, True, seed=8))
    keys = [k.key for k in GRID.keys(list(range(4 * BLOCK)))]
    for kv, tier_codec in ((dst, codec), (exact, Codec.NONE)):
        store = _store(src, tmp_path / tier_codec.value, tier_codec)
        writer, reader = WorkerSide(lambda s=store: s, GRID), WorkerSide(lambda s=store: s, GRID)
        writer.register(src, NUM_BLOCKS)
        reader.register(kv, NUM_BLOCKS)
        writer.save(_transfer(keys, [0, 1, 2, 3]))
        reader.load(_transfer(keys, [None, 5, 6, 7]))
        assert reader.take_load_errors() == set() and reader.stats.loaded_blocks == 3
        store.manager.close()
    for name in src:
        assert torch.equal(exact[name][[5, 6, 7]], src[name][[1, 2, 3]])
        close = torch.allclose(dst[name][[5, 6, 7]].float(), src[name][[1, 2, 3]].float(),
                               atol=0.5, rtol=0.2)
        assert close and not torch.equal(dst[name][[5, 6, 7]], src[name][[1, 2, 3]])
        assert torch.equal(dst[name][4], caches(NUM_BLOCKS, True, seed=8)[name][4])  # vLLM's


def test_decode_on_the_device_matches_the_host_decode_and_refuses_foreign_bytes(tmp_path):
    src = caches(NUM_BLOCKS, True, seed=9, dtype=torch.bfloat16)
    store = _store(src, tmp_path, Codec.INT8)
    keys = [k.key for k in GRID.keys(list(range(4 * BLOCK)))]
    writer = WorkerSide(lambda: store, GRID)
    writer.register(src, NUM_BLOCKS)
    writer.save(_transfer(keys, [0, 1, 2, 3]))
    with store.get_into(keys) as (good, bad):
        assert good.header.lossy
        payload = bad.payload.clone()
        payload[: payload.numel() // LAYERS].fill_(0x80)  # -128: no encoder writes it
        statuses = torch.zeros(2, dtype=torch.int32)
        got = decode_on_device(good, good.payload.clone(), statuses[0:1])
        decode_on_device(bad, payload, statuses[1:2])
        assert torch.equal(got.view(good.header.shape), good.kv)
        errors = refuse_bad([good, bad], statuses)
        assert errors[0] is None and errors[1] is not None and bad.error is not None
