"""kvtier's vLLM connector worker with vLLM's caches on the device: chunks of blocks
gathered from GPU memory into the CPU arena's (pinned) slots on the background save thread
(after the step's forward pass: a CUDA event) and scattered back from them, bit-exact, in
both cache layouts, before the forward pass or on the loading thread (``async_loads``)."""

from __future__ import annotations

import time

import pytest
import torch

from kvtier.chunk_format import max_chunk_bytes
from kvtier.connectors.chunk_store import LocalChunkStore
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.connectors.vllm_blocks import ChunkGrid, ChunkSpan, ChunkTransfer
from kvtier.connectors.vllm_worker import WorkerSide

BLOCK, LAYERS, BLOCKS = 16, 4, 24
FP = b"vllm-v2|cuda-test"


@pytest.mark.parametrize("async_loads", [False, True], ids=["loads", "async-loads"])
@pytest.mark.parametrize("blocks_first", [True, False])
def test_device_cache_blocks_round_trip_through_the_cpu_arena(device, sizes, blocks_first,
                                                               async_loads):
    heads, dim = sizes.kv_heads, sizes.head_dim
    shape = (BLOCKS, 2, BLOCK, heads, dim) if blocks_first else (2, BLOCKS, BLOCK, heads, dim)
    g = torch.Generator().manual_seed(0)
    src = {f"l{i}": torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for i in range(LAYERS)}
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    block_bytes = LAYERS * 2 * BLOCK * heads * dim * 2
    grid = ChunkGrid(BLOCK, 3, FP)  # two chunks of three blocks and a two-block tail
    slot = max_chunk_bytes(LAYERS, block_bytes * grid.chunk_blocks)
    store = LocalChunkStore(TierManager([CPUTier(BLOCKS * slot, slot)]))
    keys = [k.key for k in grid.keys(list(range(8 * BLOCK)))]

    def spans(first: int) -> list[ChunkTransfer]:
        ids = list(range(first, first + 8))
        return [ChunkTransfer("r", [ChunkSpan(k, tuple(ids[3 * i : 3 * i + 3])) for i, k in enumerate(keys)])]

    try:
        writer = WorkerSide(lambda: store, grid, background=True)
        reader = WorkerSide(lambda: store, grid, async_loads=async_loads)
        writer.register(src, BLOCKS)
        reader.register(dst, BLOCKS)
        writer.save(spans(0))
        writer.wait_saves()  # the background save has landed
        if async_loads:  # on the loading thread and its own stream; done once reported
            reader.load_async(spans(10))
            deadline = time.monotonic() + 60
            while reader.finished_loading() != {"r"}:
                assert time.monotonic() < deadline, "the async load never finished"
                time.sleep(0.01)
        else:
            reader.load(spans(10))
        assert reader.take_load_errors() == set() and reader.stats.loaded_blocks == 8
        dim_b = 0 if blocks_first else 1
        for name in src:
            got = dst[name].narrow(dim_b, 10, 8)
            want = src[name].narrow(dim_b, 0, 8)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    finally:
        writer.close()
        reader.close()
        store.manager.close()


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
def test_device_cache_loads_compressed_chunks_decoded_on_the_device(device, sizes, tmp_path, codec):
    """A disk tier keeping chunks compressed (issue 33): a save encodes on the device (the
    tier's codec), a load copies the stored bytes to the device and decodes them there (on
    the CPU dry run, both on the host); the blocks hold exactly the codec's decode of what
    was saved, the host encoder's bytes."""
    from kvtier.connectors.tiers.disk_tier import DiskTier
    from kvtier.kv_codecs import Codec, decode, encode

    heads, dim = sizes.kv_heads, sizes.head_dim
    shape = (2, BLOCKS, BLOCK, heads, dim)
    g = torch.Generator().manual_seed(1)
    src = {f"l{i}": torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for i in range(LAYERS)}
    dst = {n: torch.zeros_like(t) for n, t in src.items()}
    grid = ChunkGrid(BLOCK, 2, FP)
    disk = DiskTier(tmp_path / "d", fsync=False)
    disk.codec = Codec(codec)
    store = LocalChunkStore(TierManager([disk]))
    keys = [k.key for k in grid.keys(list(range(4 * BLOCK)))]
    try:
        writer, reader = WorkerSide(lambda: store, grid), WorkerSide(lambda: store, grid)
        writer.register(src, BLOCKS)
        reader.register(dst, BLOCKS)
        writer.save([ChunkTransfer("r", [ChunkSpan(keys[0], (0, 1)), ChunkSpan(keys[1], (2, 3))])])
        reader.load([ChunkTransfer("r", [ChunkSpan(keys[0], (8, 9)), ChunkSpan(keys[1], (10, 11))])])
        assert reader.take_load_errors() == set() and reader.stats.loaded_blocks == 4
        assert store.manager.stats.codec_reads == {codec: 2}
        # encoded where the cache is (on a GPU: only the encoded bytes crossed), counted
        assert store.manager.stats.codec_chunks_stored == {codec: 2}
        for saved, loaded in ((0, 8), (2, 10)):
            kv = torch.stack([src[n][:, saved : saved + 2].reshape(2, 2 * BLOCK, -1)
                              for n in src]).unsqueeze(3).cpu()  # the chunk: [layers, 2, tokens, 1, rest]
            want = torch.cat([decode(encode(kv[i : i + 1], Codec(codec)), Codec(codec),
                                     tuple(kv[i : i + 1].shape), kv.dtype) for i in range(LAYERS)])
            got = torch.stack([dst[n][:, loaded : loaded + 2].reshape(2, 2 * BLOCK, -1)
                               for n in dst]).unsqueeze(3).cpu()
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
            assert not torch.equal(got, kv)  # lossy: the test sees the codec
    finally:
        writer.close()
        reader.close()
        store.manager.close()


def test_a_corrupt_chunk_in_device_caches_is_recomputed_with_every_later_one(device, sizes):
    """Three chunks loaded into device caches, the second with a flipped byte in its last
    layer and the third partly computed by vLLM already: the first loads bit for bit; the
    second fails its check where it landed (the device hash; on the CPU dry run the same
    Triton path under the interpreter), and it and the third (intact) are load errors, to
    be recomputed by vLLM; vLLM's own block is left alone."""
    heads, dim = sizes.kv_heads, sizes.head_dim
    shape = (2, BLOCKS, BLOCK, heads, dim)
    g = torch.Generator().manual_seed(2)
    src = {f"l{i}": torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for i in range(LAYERS)}
    dst = {n: torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for n in src}
    before = {n: t.clone() for n, t in dst.items()}
    grid = ChunkGrid(BLOCK, 2, FP)
    slot = max_chunk_bytes(LAYERS, LAYERS * 2 * BLOCK * heads * dim * 2 * 2)
    store = LocalChunkStore(TierManager([CPUTier(8 * slot, slot)]))
    keys = [k.key for k in grid.keys(list(range(6 * BLOCK)))]
    try:
        writer = WorkerSide(lambda: store, grid, device_copies=True)
        reader = WorkerSide(lambda: store, grid, device_copies=True)
        writer.register(src, BLOCKS)
        reader.register(dst, BLOCKS)
        writer.save([ChunkTransfer("r", [ChunkSpan(k, (2 * i, 2 * i + 1)) for i, k in enumerate(keys)])])
        with store.manager.tiers[0].lease([keys[1]]) as (view,):
            view[-3] ^= 0xFF
        reader.load([ChunkTransfer("r", [ChunkSpan(keys[0], (10, 11)), ChunkSpan(keys[1], (12, 13)),
                                         ChunkSpan(keys[2], (None, 15))])])
        assert reader.take_load_errors() == {12, 13, 15} and reader.stats.loaded_blocks == 2
        assert store.lookup(keys[1:2]) == 0 and store.lookup(keys[2:3]) == 1  # dropped; intact
        for n in src:
            bits = lambda t: t.view(torch.int16)  # noqa: E731
            assert torch.equal(bits(dst[n][:, 10:12]), bits(src[n][:, 0:2]))
            assert torch.equal(bits(dst[n][:, 14]), bits(before[n][:, 14]))  # vLLM's own
    finally:
        store.manager.close()
