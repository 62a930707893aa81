"""The block path (:mod:`kvtier.transfer.block_path`) is the only code that moves bytes
between stored chunks and cache blocks. What it promises, on the host (the fused native
kernels, or the Python fallback where they were not built) and on a device (Triton
launches; here under Triton's interpreter) alike:

- a gather is the named blocks' halves copied one after another in the chunk's order (per
  layer every K half, then every V half), bytes as they lie, with each layer's xxh3: the
  checksums a stored chunk of those bytes carries;
- a scatter copies each chunk block into the cache block its span names, and leaves every
  other block (and every block a span leaves alone) as it was; a compressed chunk lands as
  its host decode, bit for bit;
- a chunk that fails its check, its read or its decode, or does not fit the cache, is not
  served, nor is any chunk after it; the chunks before it landed whole;
- every cache layout it accepts (kvtier's pool, vLLM's per-layer caches, permuted dense
  blocks) round-trips; one whose blocks are not dense, or a block id outside the cache, is
  refused.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import pytest
import torch
import xxhash

from kvtier import layer_sums as layer_sums_module
from kvtier.chunk_format import (
    _PREFIX,
    MAGIC,
    byte_view,
    encode_chunk,
    parse_header,
    slice_chunk,
)
from kvtier.connectors.tiers.lent_chunk import LentChunk, ReadingBuffer
from kvtier.errors import InvalidArgumentError
from kvtier.gpu_pool.kernels import host_native
from kvtier.kv_codecs import Codec, layer_exponents_at
from kvtier.layer_sums import layer_sums
from kvtier.transfer.block_path import (
    BlockSpan,
    CacheBlocks,
    Scattered,
    device_copies,
    gather,
    host_copies,
    scatter,
)

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 12, 4, 2, 8
FP = b"block-path-test"
PATHS = ["host", "host-python", "device"]


def use_path(monkeypatch: pytest.MonkeyPatch, path: str) -> bool:
    """Make ``path`` the one that moves the bytes; whether the cache is a device's."""
    if path == "host":  # built at install (setup.py); CI has a compiler
        assert host_native.AVAILABLE and host_native.CODEC_AVAILABLE
    elif path == "host-python":  # no native kernel: Python copies, the xxhash package's sums
        monkeypatch.setattr(host_native, "AVAILABLE", False)
        monkeypatch.setattr(host_native, "CODEC_AVAILABLE", False)
        monkeypatch.setattr(layer_sums_module, "_native", None)
    return path == "device"


@pytest.fixture(params=PATHS)
def on_device(request, monkeypatch) -> bool:
    """The host's native copies, the host's Python fallback, or device copies."""
    return use_path(monkeypatch, request.param)


# ------------------------------------------------------------------------- caches
Half = Callable[[list[torch.Tensor], int, int, int], torch.Tensor]


@dataclass
class Cache:
    storage: list[torch.Tensor]
    """The contiguous tensors that hold the cache's bytes."""
    blocks: CacheBlocks
    half: Half
    """``half(storage, layer, block, 0 or 1)``: that block's first or second half, a
    contiguous view (of ``storage`` or of a clone of it)."""

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.storage]

    def equals(self, other: list[torch.Tensor]) -> bool:
        return all(torch.equal(bits(a), bits(b)) for a, b in zip(self.storage, other, strict=True))


def bits(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes (compared as integers: NaN patterns are bytes too)."""
    return t.view(torch.uint8).reshape(-1)


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * dtype.itemsize
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(dtype).view(shape)


def pool(dtype: torch.dtype, seed: int, on_device: bool) -> Cache:
    """kvtier's pool ``[layers, blocks, 2, block_size, heads, dim]``."""
    kv = random_bytes((LAYERS, BLOCKS, 2, BS, HEADS, DIM), dtype, seed)
    return Cache([kv], CacheBlocks.of_pool(kv, on_device), lambda s, layer, b, h: s[0][layer, b, h])


def per_layer(shape: tuple[int, ...], block_dim: int, half: Callable[..., torch.Tensor],
              view: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
              ) -> Callable[[torch.dtype, int, bool], Cache]:
    """vLLM's caches: a tensor of ``shape`` per layer, handed over as ``view`` of it."""
    def make(dtype: torch.dtype, seed: int, on_device: bool) -> Cache:
        storage = [random_bytes(shape, dtype, 10 * seed + i) for i in range(LAYERS)]
        blocks = CacheBlocks.of_layers([(view(t), block_dim) for t in storage], BS, on_device)
        return Cache(storage, blocks, lambda s, layer, b, h: half(s[layer], b, h))
    return make


LAYOUTS: dict[str, Callable[[torch.dtype, int, bool], Cache]] = {
    "pool": pool,
    "blocks-first": per_layer((BLOCKS, 2, BS, HEADS, DIM), 0, lambda t, b, h: t[b, h]),
    "kv-first": per_layer((2, BLOCKS, BS, HEADS, DIM), 1, lambda t, b, h: t[h, b]),
    # vLLM's CPU backend: no K/V dimension, a block's bytes split in two halves
    "cpu-backend": per_layer((BLOCKS, HEADS, BS, 2 * DIM), 0,
                             lambda t, b, h: t[b].reshape(2, -1)[h]),
    # [blocks, 2, heads, bs, dim] in memory, seen as [blocks, 2, bs, heads, dim]
    "permuted": per_layer((BLOCKS, 2, HEADS, BS, DIM), 0, lambda t, b, h: t[b, h],
                          view=lambda t: t.permute(0, 1, 3, 2, 4)),
}


def chunk_bytes(cache: Cache, ids: list[int], tokens: int, first: int = 0, last: int = LAYERS
                ) -> torch.Tensor:
    """The chunk of ``tokens`` tokens held in blocks ``ids``, block by block: per layer
    the K halves of its blocks (of the last one, its first tokens only), then the V halves."""
    storage = cache.storage
    token_bytes = bits(cache.half(storage, 0, 0, 0)).numel() // BS
    parts = []
    for layer in range(first, last):
        for h in (0, 1):
            for j, b in enumerate(ids):
                n = min(BS, tokens - j * BS)
                parts.append(bits(cache.half(storage, layer, b, h))[: n * token_bytes])
    return torch.cat(parts)


def moved(dst: Cache, src: Cache, pairs: list[tuple[int, int]], tokens: int = BS,
          layers: range = range(LAYERS), want: list[torch.Tensor] | None = None
          ) -> list[torch.Tensor]:
    """``dst``'s bytes once each ``(source block, target block)`` pair was copied block by
    block (its first ``tokens`` tokens) in ``layers``."""
    want = dst.snapshot() if want is None else want
    for s, d in pairs:
        for layer in layers:
            for h in (0, 1):
                target = bits(dst.half(want, layer, d, h))
                n = target.numel() * tokens // BS
                target[:n].copy_(bits(src.half(src.storage, layer, s, h))[:n])
    return want


# ------------------------------------------------------------------------- chunks
def lent(kv: torch.Tensor, key: str, codec: Codec = Codec.NONE) -> LentChunk:
    """``kv`` stored as a chunk and lent from a tier's memory."""
    return lent_blob(encode_chunk(key, FP, kv, codec))


def lent_blob(blob: bytes) -> LentChunk:
    header, _ = parse_header(blob)
    return LentChunk(byte_view(bytearray(blob)), header)


def nominal(payload: torch.Tensor, dtype: torch.dtype, tokens: int, layers: int = LAYERS
            ) -> torch.Tensor:
    """A chunk's payload bytes as its nominal KV ``[layers, 2, tokens, heads, rest]``."""
    return payload.view(dtype).view(layers, 2, tokens, HEADS, -1)


def kv_bytes(tokens: int, dtype: torch.dtype, layers: int = LAYERS) -> int:
    return layers * 2 * tokens * HEADS * DIM * dtype.itemsize


def xxh3s(payload: torch.Tensor, layers: int) -> tuple[int, ...]:
    return tuple(xxhash.xxh3_64_intdigest(bytes(part.numpy())) for part in payload.view(layers, -1))


def corrupt(chunk: LentChunk, layer: int, at: int = 5) -> None:
    """Flip a byte of ``layer`` in the lent memory (its stored checksum unchanged)."""
    chunk.payload[layer * chunk.header.layer_nbytes + at] ^= 0xFF


# ------------------------------------------------------------------------- gather and scatter
@pytest.mark.parametrize("path", PATHS)
def test_chunks_gathered_in_windows_come_out_in_any_order_from_two_threads(monkeypatch, path):
    """A gather of many chunks: on a device, windows of a few chunks each gathered and
    hashed at once (a window ahead of the one copied out); the chunks asked for out of
    order by two threads (a store's two workers) each come out as their blocks' bytes
    with their layers' xxh3."""
    on_device = use_path(monkeypatch, path)
    monkeypatch.setattr(device_copies, "WINDOW_BYTES", 2 * kv_bytes(2 * BS, torch.float16))
    cache = pool(torch.float16, 4, on_device)
    spans = [[2 * i, 2 * i + 1] for i in range(6)]
    want = [chunk_bytes(cache, ids, 2 * BS) for ids in spans]
    gathered = gather(cache.blocks, [BlockSpan.of(ids) for ids in spans], [2 * BS] * 6)
    if on_device:
        assert len(gathered.spans) == 3  # windows of two chunks
    outs = [torch.zeros_like(w) for w in want]
    sums: dict[int, tuple[int, ...]] = {}

    def take(order: list[int]) -> None:
        for i in order:
            sums[i] = gathered.into(i, outs[i])

    threads = [threading.Thread(target=take, args=(order,)) for order in ([4, 0, 2], [1, 5, 3])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(6):
        assert torch.equal(outs[i], want[i])
        assert sums[i] == xxh3s(want[i], LAYERS)
    assert not on_device or gathered.live == {}  # every window let go once copied out


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_gather_is_the_blocks_halves_in_chunk_order_with_each_layers_xxh3(on_device, layout,
                                                                            dtype):
    cache = LAYOUTS[layout](dtype, 1, on_device)
    before = cache.snapshot()
    ids = [7, 2, 11]
    want = chunk_bytes(cache, ids, 3 * BS)
    out = torch.zeros_like(want)
    sums = gather(cache.blocks, [BlockSpan.of(ids)], [3 * BS]).into(0, out)
    assert torch.equal(out, want)
    assert sums == layer_sums(want.numpy(), LAYERS) == xxh3s(want, LAYERS)
    stored, _ = parse_header(encode_chunk("same-kv", FP, nominal(want, torch.float16, 3 * BS)))
    assert sums == stored.layer_checksums  # what a chunk of those bytes carries
    assert cache.equals(before)  # a gather only reads


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_scatter_copies_each_chunk_block_to_its_span_block_and_no_other(on_device, layout,
                                                                         dtype):
    src = LAYOUTS[layout](dtype, 1, False)
    dst = LAYOUTS[layout](dtype, 2, on_device)
    # chunk 0: its first block the cache's already; chunk 1: its middle block
    moves = [([1, 4, 6], BlockSpan.of([10, 3], skip=1)), ([11, 0, 5], BlockSpan.of([2, None, 8]))]
    chunks = [lent(nominal(chunk_bytes(src, ids, 3 * BS), dtype, 3 * BS), f"key{i}")
              for i, (ids, _) in enumerate(moves)]
    want = moved(dst, src, [(s, d) for ids, span in moves
                            for s, d in zip(ids, span.blocks, strict=True) if d is not None])
    done = scatter(chunks, [span for _, span in moves], dst.blocks)
    assert done == Scattered(2, None, 2 * kv_bytes(3 * BS, dtype))
    assert dst.equals(want)
    assert all(c.error is None for c in chunks)
    out = torch.empty(kv_bytes(2 * BS, dtype), dtype=torch.uint8)
    sums = gather(dst.blocks, [BlockSpan.of([10, 3])], [2 * BS]).into(0, out)  # and back
    assert torch.equal(out, chunk_bytes(src, [4, 6], 2 * BS))
    assert sums == xxh3s(out, LAYERS)


@pytest.mark.parametrize("reader", ["scatter", "gather"])
def test_a_pool_chunk_with_a_partial_last_block_round_trips(on_device, reader):
    """Its last block holds 3 tokens of 4: those land, the block's other tokens stay."""
    tokens = 2 * BS + 3
    src, dst = pool(torch.float16, 1, on_device), pool(torch.float16, 2, on_device)
    out = torch.empty(kv_bytes(tokens, torch.float16), dtype=torch.uint8)
    sums = gather(src.blocks, [BlockSpan.of([5, 1, 9])], [tokens]).into(0, out)
    assert torch.equal(out, chunk_bytes(src, [5, 1, 9], tokens))
    assert sums == xxh3s(out, LAYERS)
    chunk = lent(nominal(out, torch.float16, tokens), "partial")
    assert chunk.header.layer_checksums == sums
    want = moved(dst, src, [(9, 4)], tokens=3, want=moved(dst, src, [(5, 0), (1, 11)]))
    done = scatter([chunk], [BlockSpan.of([0, 11, 4])], dst.blocks)
    assert done == Scattered(1, None, kv_bytes(tokens, torch.float16))
    assert dst.equals(want)
    back = torch.empty_like(out)
    assert gather(dst.blocks, [BlockSpan.of([0, 11, 4])], [tokens]).into(0, back) == sums
    assert torch.equal(back, out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 32, 33, 60, 61, 75, 256, 301])
def test_layers_of_every_length_are_hashed_and_checked_as_the_host_hashes_them(on_device, tokens,
                                                                              dtype):
    """Layers of 2 to 1204 bytes (every length class of XXH3, layers that start off an
    8-byte boundary): a one-token-wide pool of one block per chunk."""
    kv = random_bytes((LAYERS, 3, 2, tokens, 1, 1), dtype, seed=tokens)
    cache = CacheBlocks.of_pool(kv, on_device)
    out = torch.empty(LAYERS * 2 * tokens * dtype.itemsize, dtype=torch.uint8)
    sums = gather(cache, [BlockSpan.of([2])], [tokens]).into(0, out)
    assert torch.equal(out, bits(kv[:, 2].contiguous()))
    assert sums == xxh3s(out, LAYERS)
    if dtype.itemsize == 1:  # no stored dtype of one byte: nothing to scatter
        return
    sound = lent(out.view(dtype).view(LAYERS, 2, tokens, 1, 1), "sized")
    bad = lent(out.view(dtype).view(LAYERS, 2, tokens, 1, 1), "sized")
    corrupt(bad, 1, at=bad.header.layer_nbytes - 1)  # the last byte of a middle layer
    assert scatter([sound], [BlockSpan.of([0])], cache) == Scattered(1, None, out.numel())
    assert torch.equal(bits(kv[:, 0].contiguous()), out)
    assert scatter([bad], [BlockSpan.of([1])], cache).served == 0
    assert bad.error is not None


# ------------------------------------------------------------------------- what is refused
@pytest.mark.parametrize("layout", ["pool", "blocks-first", "kv-first", "cpu-backend"])
def test_caches_whose_blocks_are_not_dense_are_refused(layout):
    """A last dimension padded (a view ``wide[..., :dim]``): no block is a run of memory."""
    shape, block_dim = {
        "pool": ((LAYERS, BLOCKS, 2, BS, HEADS, DIM), None),
        "blocks-first": ((BLOCKS, 2, BS, HEADS, DIM), 0),
        "kv-first": ((2, BLOCKS, BS, HEADS, DIM), 1),
        "cpu-backend": ((BLOCKS, HEADS, BS, 2 * DIM), 0),
    }[layout]
    wide = torch.zeros(*shape[:-1], shape[-1] + 8, dtype=torch.float16)
    narrow = wide[..., : shape[-1]]
    with pytest.raises(InvalidArgumentError):
        if block_dim is None:
            CacheBlocks.of_pool(narrow)
        else:
            CacheBlocks.of_layers([(narrow, block_dim)] * LAYERS, BS)


def test_caches_whose_layers_differ_or_whose_blocks_do_not_hold_the_tokens_are_refused():
    f16 = torch.zeros(BLOCKS, 2, BS, HEADS, DIM, dtype=torch.float16)
    with pytest.raises(InvalidArgumentError):  # another dtype in one layer
        CacheBlocks.of_layers([(f16, 0), (f16.float(), 0)], BS)
    with pytest.raises(InvalidArgumentError):  # another block count in one layer
        CacheBlocks.of_layers([(f16, 0), (f16[:-1], 0)], BS)
    with pytest.raises(InvalidArgumentError):  # 64 bytes a half-block are not 3 tokens
        CacheBlocks.of_layers([(torch.zeros(BLOCKS, 2, 4, 8, dtype=torch.float16), 0)], 3)
    with pytest.raises(InvalidArgumentError):
        CacheBlocks.of_layers([], BS)


@pytest.mark.parametrize("bad", [[0, BLOCKS], [-1, 3]])
def test_block_ids_outside_the_cache_are_refused_before_anything_moves(on_device, bad):
    src, dst = pool(torch.float16, 1, False), pool(torch.float16, 2, on_device)
    before = dst.snapshot()
    chunks = [lent(nominal(chunk_bytes(src, ids, 2 * BS), torch.float16, 2 * BS), f"key{i}")
              for i, ids in enumerate([[0, 1], [2, 3]])]
    with pytest.raises(InvalidArgumentError):
        scatter(chunks, [BlockSpan.of([4, 5]), BlockSpan.of(bad)], dst.blocks)
    assert dst.equals(before)
    with pytest.raises(InvalidArgumentError):
        gather(dst.blocks, [BlockSpan.of(bad)], [2 * BS]).into(
            0, torch.empty(kv_bytes(2 * BS, torch.float16), dtype=torch.uint8))


# ------------------------------------------------------------------------- the failure rule
SRC_IDS = [[0, 1], [2, 3], [4, 5], [6, 7]]
DST_IDS = [[11, 10], [9, 8], [7, 6], [5, 4]]


def four_chunks(src: Cache, dtype: torch.dtype = torch.float16) -> list[LentChunk]:
    return [lent(nominal(chunk_bytes(src, ids, 2 * BS), dtype, 2 * BS), f"key{i}")
            for i, ids in enumerate(SRC_IDS)]


def landed(dst: Cache, src: Cache, chunks: int) -> bool:
    """Whether the first ``chunks`` of :func:`four_chunks` lie in their blocks."""
    return all(torch.equal(bits(dst.half(dst.storage, layer, d, h)),
                           bits(src.half(src.storage, layer, s, h)))
               for i in range(chunks) for s, d in zip(SRC_IDS[i], DST_IDS[i], strict=True)
               for layer in range(LAYERS) for h in (0, 1))


@pytest.mark.parametrize("layer", [0, LAYERS - 1])
@pytest.mark.parametrize("bad", [0, 2])
def test_a_corrupt_chunk_is_not_served_nor_any_after_it(on_device, bad, layer):
    src, dst = pool(torch.float16, 1, False), pool(torch.float16, 2, on_device)
    chunks = four_chunks(src)
    corrupt(chunks[bad], layer)
    done = scatter(chunks, [BlockSpan.of(ids) for ids in DST_IDS], dst.blocks)
    assert done.served == bad
    assert "key" + str(bad) in done.reason and f"layer {layer}" in done.reason
    assert done.bytes == bad * kv_bytes(2 * BS, torch.float16)
    assert chunks[bad].error is not None  # its tier drops it
    assert all(c.error is None for c in chunks[:bad])
    assert landed(dst, src, bad)


def test_on_a_device_a_corrupt_chunk_ends_the_windows_after_it(monkeypatch):
    """A window of one chunk at a time: the failure found in a later window still counts."""
    monkeypatch.setattr(device_copies, "WINDOW_BYTES", 1)
    src, dst = pool(torch.float16, 1, False), pool(torch.float16, 2, True)
    chunks = four_chunks(src)
    corrupt(chunks[2], LAYERS - 1)
    done = scatter(chunks, [BlockSpan.of(ids) for ids in DST_IDS], dst.blocks)
    assert done.served == 2 and "key2" in done.reason
    assert chunks[2].error is not None and chunks[3].error is None
    assert landed(dst, src, 2)


def misfit(src: Cache, kind: str) -> LentChunk:
    """A sound chunk that does not fit two blocks of the float16 pool."""
    payload = chunk_bytes(src, [2, 3], 2 * BS)
    if kind == "layers":  # one layer short
        part = payload[: (LAYERS - 1) * payload.numel() // LAYERS]
        return lent(nominal(part, torch.float16, 2 * BS, LAYERS - 1), "key1")
    if kind == "first-layer":  # layers 1.. of a chunk
        whole = encode_chunk("key1", FP, nominal(payload, torch.float16, 2 * BS))
        header, _ = parse_header(whole)
        step = header.layer_nbytes
        return lent_blob(slice_chunk(header, (1, LAYERS), whole[len(whole) - 2 * step:]))
    if kind == "more-tokens":  # three blocks for a span of two
        return lent(nominal(chunk_bytes(src, [2, 3, 4], 3 * BS), torch.float16, 3 * BS), "key1")
    if kind == "fewer-tokens":  # one block for a span of two
        return lent(nominal(chunk_bytes(src, [2], BS), torch.float16, BS), "key1")
    if kind == "wider":  # tokens of twice the bytes
        return lent(nominal(chunk_bytes(src, [2, 3, 4, 5], 4 * BS), torch.float16, 2 * BS), "key1")
    assert kind == "dtype"  # the same bytes, float32 values
    return lent(payload.view(torch.float32).view(LAYERS, 2, 2 * BS, HEADS, DIM // 2), "key1")


@pytest.mark.parametrize("kind", ["layers", "first-layer", "more-tokens", "fewer-tokens",
                                  "wider", "dtype"])
def test_a_chunk_that_does_not_fit_the_cache_ends_the_scatter_there(on_device, kind):
    src, dst = pool(torch.float16, 1, False), pool(torch.float16, 2, on_device)
    chunks = four_chunks(src)
    chunks[1] = misfit(src, kind)
    done = scatter(chunks, [BlockSpan.of(ids) for ids in DST_IDS], dst.blocks)
    assert done.served == 1 and done.reason
    assert done.bytes == kv_bytes(2 * BS, torch.float16)
    assert landed(dst, src, 1)
    assert chunks[1].error is None  # not a corrupt chunk: its tier keeps it


# ------------------------------------------------------------------------- layer ranges
def test_a_layer_range_moves_and_checks_only_its_layers(on_device):
    src, dst = pool(torch.float16, 1, False), pool(torch.float16, 2, on_device)
    chunk = lent(nominal(chunk_bytes(src, [3, 5], 2 * BS), torch.float16, 2 * BS), "key0")
    corrupt(chunk, 0)  # a layer outside the range
    span = BlockSpan.of([0, 7])
    done = scatter([chunk], [span], dst.blocks, first=1, last=2)
    assert done == Scattered(1, None, kv_bytes(2 * BS, torch.float16, layers=1))
    assert dst.equals(moved(dst, src, [(3, 0), (5, 7)], layers=range(1, 2)))
    out = torch.empty(kv_bytes(2 * BS, torch.float16, layers=1), dtype=torch.uint8)
    sums = gather(dst.blocks, [span], [2 * BS], first=1, last=2).into(0, out)
    assert torch.equal(out, chunk_bytes(src, [3, 5], 2 * BS, first=1, last=2))
    assert sums == (chunk.header.layer_checksums[1],)


# ------------------------------------------------------------------------- lossy chunks
def lossy_kv(dtype: torch.dtype, tokens: int, seed: int) -> torch.Tensor:
    kv = torch.randn((LAYERS, 2, tokens, HEADS, DIM), generator=torch.Generator().manual_seed(seed))
    kv[:, 0, :, :, 3] *= 40  # an outlier channel in the keys
    return kv.to(dtype)


def decoded_into(dst: Cache, chunk: LentChunk, span: BlockSpan, want: list[torch.Tensor]) -> None:
    """``want`` with the chunk's host decode copied block by block along ``span``."""
    kv, tokens = chunk.kv, chunk.header.num_tokens
    for j, b in enumerate(span.blocks):
        if b is None:
            continue
        n = min(BS, tokens - j * BS)
        for layer in range(LAYERS):
            for h in (0, 1):
                dst.half(want, layer, b, h)[:n].copy_(kv[layer, h, j * BS : j * BS + n])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("codec", [Codec.INT8, Codec.FP8, Codec.INT4])
def test_lossy_chunks_land_as_their_host_decode(on_device, codec, dtype):
    """Three in a row (the last with a partial block), one with a block left alone."""
    dst = pool(dtype, 2, on_device)
    tokens = [2 * BS, 2 * BS, 2 * BS - 1]
    chunks = [lent(lossy_kv(dtype, t, seed=i), f"key{i}", codec) for i, t in enumerate(tokens)]
    spans = [BlockSpan.of([3, 9]), BlockSpan.of([0], skip=1), BlockSpan.of([11, 6])]
    want = dst.snapshot()
    for chunk, span in zip(chunks, spans, strict=True):
        decoded_into(dst, chunk, span, want)
    done = scatter(chunks, spans, dst.blocks)
    assert done == Scattered(3, None, sum(kv_bytes(t, dtype) for t in tokens))
    assert dst.equals(want)
    assert all(c.error is None for c in chunks)


def foreign(chunk: LentChunk, layer: int, kind: str) -> LentChunk:
    """The chunk with bytes no encoder writes in ``layer``, its checksum recomputed (as a
    foreign or buggy writer's would be): an exponent of -128, or an fp8 NaN."""
    header = chunk.header
    payload = bytearray(chunk.payload.numpy().tobytes())
    step = header.layer_nbytes
    if kind == "exponent":
        k_at, _ = layer_exponents_at(Codec(header.codec), tuple(header.shape[1:]),
                                     torch.float16)
        payload[layer * step + k_at] = 0x80
    else:
        assert kind == "nan" and header.codec == Codec.FP8.value
        payload[layer * step + 3] = 0x7F
    sums = list(header.layer_checksums)
    sums[layer] = xxhash.xxh3_64_intdigest(bytes(payload[layer * step : (layer + 1) * step]))
    packed = dataclasses.replace(header, layer_checksums=tuple(sums)).pack()
    return lent_blob(b"".join((_PREFIX.pack(MAGIC, len(packed)), packed, bytes(payload))))


@pytest.mark.parametrize(("codec", "kind"), [(Codec.INT8, "exponent"), (Codec.FP8, "exponent"),
                                             (Codec.FP8, "nan"), (Codec.INT4, "exponent")])
def test_a_lossy_chunk_holding_bytes_no_encoder_writes_is_refused(on_device, codec, kind):
    dst = pool(torch.float16, 2, on_device)
    chunks = [lent(lossy_kv(torch.float16, 2 * BS, seed=i), f"key{i}", codec) for i in range(3)]
    chunks[1] = foreign(chunks[1], 1, kind)
    spans = [BlockSpan.of(ids) for ids in DST_IDS[:3]]
    want = dst.snapshot()
    decoded_into(dst, chunks[0], spans[0], want)
    done = scatter(chunks, spans, dst.blocks)
    assert done.served == 1 and done.reason
    assert chunks[1].error is not None  # its tier drops it
    assert chunks[0].error is None
    assert all(torch.equal(bits(dst.half(dst.storage, layer, b, h)), bits(dst.half(want, layer, b, h)))
               for b in DST_IDS[0] for layer in range(LAYERS) for h in (0, 1))  # chunk 0 landed


# ------------------------------------------------------------------------- chunks still being read
def reading(chunk: LentChunk, layers_read: int) -> tuple[LentChunk, Callable[..., None]]:
    """The chunk as a tier lends it while still reading it: its header and first
    ``layers_read`` layers there, the rest not yet. ``land(ok)`` ends the read: the rest
    of the bytes written and True, or the read failed (``ok`` False, or an exception)."""
    buf = chunk.buf.clone()
    at = buf.numel() - chunk.header.payload_nbytes + layers_read * chunk.header.layer_nbytes
    buf[at:] = 0
    done: Future[bool] = Future()

    def land(ok: bool | Exception = True) -> None:
        if isinstance(ok, Exception):
            done.set_exception(ok)
            return
        if ok:
            buf[at:] = chunk.buf[at:]
        done.set_result(ok)

    return LentChunk(buf, chunk.header, reading=ReadingBuffer(buf, at, done)), land


def later(fn: Callable[[], None], seconds: float = 0.05) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), fn()), daemon=True)
    thread.start()
    return thread


def test_a_chunk_still_being_read_is_scattered_once_its_layers_land(on_device):
    src, dst = pool(torch.float16, 1, False), pool(torch.float16, 2, on_device)
    chunks = four_chunks(src)
    chunks[1], land = reading(chunks[1], 1)
    thread = later(land)
    done = scatter(chunks, [BlockSpan.of(ids) for ids in DST_IDS], dst.blocks)
    thread.join()
    assert done == Scattered(4, None, 4 * kv_bytes(2 * BS, torch.float16))
    assert landed(dst, src, 4)
    assert all(c.error is None for c in chunks)


@pytest.mark.parametrize("failure", ["error", "truncated"])
def test_a_read_that_fails_ends_the_scatter_at_that_chunk(on_device, failure):
    src, dst = pool(torch.float16, 1, False), pool(torch.float16, 2, on_device)
    chunks = four_chunks(src)
    chunks[1], land = reading(chunks[1], 1)
    thread = later(lambda: land(OSError("the disk went away") if failure == "error" else False))
    done = scatter(chunks, [BlockSpan.of(ids) for ids in DST_IDS], dst.blocks)
    thread.join()
    assert done.served == 1 and "key1" in done.reason
    assert chunks[1].error is not None
    assert landed(dst, src, 1)


@pytest.mark.parametrize("path", ["host", "host-python"])
def test_on_the_host_the_layers_read_are_scattered_before_the_rest_land(monkeypatch, path):
    """A group of one layer at a time: the tier's read of the rest is still under way when
    the first layer's blocks are filled."""
    use_path(monkeypatch, path)
    src, dst = pool(torch.float16, 1, False), pool(torch.float16, 2, False)
    chunk = four_chunks(src)[0]
    monkeypatch.setattr(host_copies, "GROUP_BYTES", chunk.header.layer_nbytes)
    chunk, land = reading(chunk, 1)
    first_layer = [bits(src.half(src.storage, 0, s, h)) for s in SRC_IDS[0] for h in (0, 1)]
    seen = []

    def watch() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not seen:
            now = [bits(dst.half(dst.storage, 0, d, h)) for d in DST_IDS[0] for h in (0, 1)]
            if all(torch.equal(a, b) for a, b in zip(now, first_layer, strict=True)):
                seen.append(True)
            time.sleep(0.001)
        land()

    thread = later(watch, 0)
    done = scatter([chunk], [BlockSpan.of(DST_IDS[0])], dst.blocks)
    thread.join()
    assert seen == [True]
    assert done.served == 1 and landed(dst, src, 1)
