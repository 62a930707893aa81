"""A compressed chunk scattered into a host pool by the block path (checked, decoded and
written in one native pass) gives the same pool as decoding it with the reference and
scattering that, for every codec, dtype, a span that leaves its first block alone and a
partial last block; a corrupted layer stops it before anything of that layer is written,
and bytes no encoder writes are refused even under a checksum that matches them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import xxhash

from kvtier.chunk_format import _PREFIX, MAGIC, byte_view, encode_chunk, parse_header
from kvtier.connectors.tiers.lent_chunk import LentChunk
from kvtier.gpu_pool.kernels import host_native
from kvtier.kv_codecs import Codec, layer_exponents_at, reference_decode
from kvtier.transfer.block_path import BlockSpan, CacheBlocks, scatter

pytestmark = pytest.mark.skipif(not host_native.CODEC_AVAILABLE,
                                reason="the native codec kernels were not built")

LAYERS, TOKENS, HEADS, DIM, BS = 3, 72, 2, 64, 16  # 72 tokens: 5 blocks, the last of 8 tokens
NUM_BLOCKS = 10


def _blob(codec: Codec, dtype: torch.dtype, seed: int = 4) -> bytes:
    kv = torch.randn((LAYERS, 2, TOKENS, HEADS, DIM), generator=torch.Generator().manual_seed(seed))
    kv[:, 0, :, :, 7] *= 40
    return encode_chunk("k" * 8, b"fp", kv.to(dtype), codec)


def _lent(blob: bytes) -> LentChunk:
    """The chunk as a tier lends it: its bytes in (writable) lent memory, its header
    parsed from them, its layers not yet checked."""
    header, _ = parse_header(blob)
    return LentChunk(byte_view(bytearray(blob)), header)


def _pool(dtype: torch.dtype) -> torch.Tensor:
    """A host pool of random contents, so that a slot left alone shows."""
    g = torch.Generator().manual_seed(9)
    return torch.randn((LAYERS, NUM_BLOCKS, 2, BS, HEADS, DIM), generator=g).to(dtype)


def _reference(chunk: LentChunk, codec: Codec, dtype: torch.dtype, pool: torch.Tensor,
               span: BlockSpan, layers: range = range(LAYERS)) -> None:
    """Each of ``layers`` decoded by the reference and its blocks written where ``span``
    says, in torch."""
    step = chunk.header.layer_nbytes
    payload = chunk.payload
    for layer in layers:
        kv = reference_decode(payload[layer * step : (layer + 1) * step], codec,
                              (1, 2, TOKENS, HEADS, DIM), dtype)[0]
        for j, b in enumerate(span.blocks):
            if b is not None:
                n = min(BS, TOKENS - j * BS)
                pool[layer, b, :, :n] = kv[:, j * BS : j * BS + n]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("codec", [Codec.FP8, Codec.INT8, Codec.INT4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("skip", [0, 1])  # offset 0 or 16 tokens
def test_scatter_equals_decode_then_scatter(codec, dtype, skip):
    chunk = _lent(_blob(codec, dtype))
    span = BlockSpan.of([9, 2, 5, 0, 7][skip:], skip=skip)  # block 7 gets the last 8 tokens
    got = _pool(dtype)
    want = got.clone()
    done = scatter([chunk], [span], CacheBlocks.of_pool(got))
    assert (done.served, done.reason) == (1, None)
    assert done.bytes == chunk.kv_nbytes(0) and chunk.error is None
    _reference(chunk, codec, dtype, want, span)
    assert torch.equal(_bits(got), _bits(want))  # the partial block's tail slots kept


@pytest.mark.parametrize("codec", [Codec.FP8, Codec.INT8, Codec.INT4])
def test_scatter_of_a_layer_range(codec):
    dtype = torch.bfloat16
    chunk = _lent(_blob(codec, dtype))
    span = BlockSpan.of([3, 1, 8], skip=2)
    got = _pool(dtype)
    want = got.clone()
    done = scatter([chunk], [span], CacheBlocks.of_pool(got), 1, 3)
    assert (done.served, done.reason) == (1, None)
    assert done.bytes == chunk.kv_nbytes(1)
    _reference(chunk, codec, dtype, want, span, range(1, 3))
    assert torch.equal(_bits(got), _bits(want))  # layer 0 untouched


def test_a_corrupt_layer_stops_the_chunk():
    codec, dtype = Codec.INT8, torch.bfloat16
    chunk = _lent(_blob(codec, dtype))
    chunk.payload[1 * chunk.header.layer_nbytes + 5] ^= 1  # layer 1's bytes
    span = BlockSpan.of([1, 2, 3, 4, 5])
    got = _pool(dtype)
    before = got.clone()
    done = scatter([chunk], [span], CacheBlocks.of_pool(got))
    assert done.served == 0 and done.bytes == 0
    assert "layer 1" in done.reason and chunk.error is not None
    want = before.clone()
    _reference(chunk, codec, dtype, want, span, range(1))
    assert torch.equal(_bits(got[0]), _bits(want[0]))  # the layer before it landed
    assert torch.equal(_bits(got[1:]), _bits(before[1:]))  # nothing of layer 1 or later


def test_a_corrupt_chunk_ends_what_is_served():
    """Chunks are served in order up to the first that fails: a good chunk before a
    corrupt one is served whole, the corrupt one's bad layer and later are not written."""
    codec, dtype = Codec.INT4, torch.float16
    good, bad = _lent(_blob(codec, dtype, 4)), _lent(_blob(codec, dtype, 5))
    bad.payload[2 * bad.header.layer_nbytes] ^= 0x40  # layer 2
    spans = [BlockSpan.of([0, 1, 2, 3, 4]), BlockSpan.of([5, 6, 7, 8, 9])]
    got = _pool(dtype)
    before = got.clone()
    done = scatter([good, bad], spans, CacheBlocks.of_pool(got))
    assert done.served == 1 and "layer 2" in done.reason
    assert done.bytes == good.kv_nbytes(0)
    want = before.clone()
    _reference(good, codec, dtype, want, spans[0])
    assert torch.equal(_bits(got[:, :5]), _bits(want[:, :5]))
    assert torch.equal(_bits(got[2, 5:]), _bits(before[2, 5:]))


def _foreign(blob: bytes, layer: int, codec: Codec, dtype: torch.dtype) -> LentChunk:
    """``blob`` with layer ``layer``'s first key exponent set to -128 (no encoder writes
    it) and that layer's checksum recomputed, as its writer would have; lent."""
    header, _ = parse_header(blob)
    payload = bytearray(blob[len(blob) - header.payload_nbytes :])
    step = header.layer_nbytes
    k_at, _ = layer_exponents_at(codec, (2, TOKENS, HEADS, DIM), dtype)
    payload[layer * step + k_at] = 0x80
    sums = list(header.layer_checksums)
    sums[layer] = xxhash.xxh3_64_intdigest(bytes(payload[layer * step : (layer + 1) * step]))
    packed = dataclasses.replace(header, layer_checksums=tuple(sums)).pack()
    return _lent(b"".join((_PREFIX.pack(MAGIC, len(packed)), packed, bytes(payload))))


@pytest.mark.parametrize("codec", [Codec.FP8, Codec.INT8, Codec.INT4])
def test_bytes_no_encoder_writes_are_refused(codec):
    dtype = torch.float32
    chunk = _foreign(_blob(codec, dtype), 1, codec, dtype)
    got = _pool(dtype)
    before = got.clone()
    done = scatter([chunk], [BlockSpan.of([4, 0, 6, 2, 8])], CacheBlocks.of_pool(got))
    assert done.served == 0 and "no encoder writes" in done.reason
    assert chunk.error is not None  # its tier drops it
    assert torch.equal(_bits(got[2]), _bits(before[2]))  # no later layer written


def test_a_chunk_that_does_not_fit_is_not_served():
    """A span of the wrong number of blocks, or a pool of another dtype: refused before
    any byte moves."""
    chunk = _lent(_blob(Codec.INT8, torch.bfloat16))
    for dtype, span in [(torch.bfloat16, BlockSpan.of([1, 2, 3, 4])),
                        (torch.float16, BlockSpan.of([1, 2, 3, 4, 5]))]:
        got = _pool(dtype)
        before = got.clone()
        done = scatter([chunk], [span], CacheBlocks.of_pool(got))
        assert done.served == 0 and done.reason
        assert torch.equal(_bits(got), _bits(before))
