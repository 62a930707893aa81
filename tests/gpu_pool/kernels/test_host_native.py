"""The fused native copy + xxh3 kernels agree bit for bit with the numpy copies and the
chunk format's checksums, check before they copy, and refuse what would write outside
their tensors."""

from __future__ import annotations

import pytest
import torch
import xxhash

from kvtier.chunk_format import chunk_view, encode_into
from kvtier.gpu_pool.kernels import gather_blocks_host, host_native, scatter_blocks_host
from kvtier.gpu_pool.kernels.host_native import gather_blocks_hashed, scatter_blocks_verified


def _pool(dtype: torch.dtype, seed: int, layers: int = 3, blocks: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(1 << 15), 1 << 15, (layers, blocks, 2, 16, 2, 8), generator=g,
                         dtype=torch.int32)
    if dtype.itemsize == 1:
        return bits.to(torch.int8).view(dtype)
    return bits.to(torch.int16).view(dtype) if dtype.itemsize == 2 else bits.view(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # compared as bits: random patterns hold NaNs


def _layer_sums(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(xxhash.xxh3_64_intdigest(_bits(t[i]).numpy().tobytes()) for i in range(t.shape[0]))


def test_the_native_kernels_are_built():
    """The install builds them (scripts/setup.sh); without them the data path works but
    crosses memory twice, so a silent build failure must show here."""
    assert host_native.AVAILABLE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
@pytest.mark.parametrize("num_tokens", [16, 40, 48, 1])
@pytest.mark.parametrize("layers", [(0, 3), (1, 2)])
def test_fused_gather_matches_numpy_and_the_chunk_checksums(dtype, num_tokens, layers):
    kv = _pool(dtype, num_tokens)
    ids = [7, 2, 5][: -(-num_tokens // 16)]
    a, b = layers
    want = torch.zeros(b - a, 2, num_tokens, 2, 8).to(dtype)
    gather_blocks_host(kv[a:b], ids, num_tokens, want)
    got = torch.full_like(want, 3)
    sums = gather_blocks_hashed(kv[a:b], ids, num_tokens, got)
    assert torch.equal(_bits(got), _bits(want))
    assert sums == _layer_sums(want)


@pytest.mark.parametrize("offset", [0, 16, 32])
@pytest.mark.parametrize("num_tokens", [48, 40])
def test_verified_scatter_matches_numpy_from_any_block_offset(offset, num_tokens):
    kv = _pool(torch.bfloat16, 5)
    chunk = torch.zeros(3, 2, num_tokens, 2, 8, dtype=torch.bfloat16)
    gather_blocks_host(kv, [1, 2, 3], num_tokens, chunk)
    ids = [8, 0, 4][: -(-(num_tokens - offset) // 16)]
    ref, out = kv.clone(), kv.clone()
    scatter_blocks_host(chunk[:, :, offset:], ref, ids, num_tokens - offset)
    assert scatter_blocks_verified(chunk, _layer_sums(chunk), offset, out, ids) == -1
    assert torch.equal(_bits(out), _bits(ref))  # tail slots of a partial block kept


def test_a_layer_that_fails_its_check_is_not_copied_nor_any_after_it():
    kv = _pool(torch.float16, 6, layers=4)
    chunk = torch.zeros(4, 2, 32, 2, 8, dtype=torch.float16)
    gather_blocks_host(kv, [0, 1], 32, chunk)
    sums = list(_layer_sums(chunk))
    chunk.view(torch.uint8)[2, 1, 5, 0, 3] ^= 0x10  # one bit of layer 2 flipped
    out = kv.clone()
    assert scatter_blocks_verified(chunk, sums, 0, out, [6, 7]) == 2
    ref = kv.clone()
    scatter_blocks_host(chunk[:2], ref[:2], [6, 7], 32)
    assert torch.equal(_bits(out), _bits(ref))  # layers 0-1 copied, 2-3 untouched


def test_encode_into_with_the_fused_gather_writes_the_same_chunk():
    kv = _pool(torch.bfloat16, 7)
    ids, n = [4, 6, 1], 40
    shape = (3, 2, n, 2, 8)
    a = torch.zeros(1 << 16, dtype=torch.uint8)
    b = torch.zeros(1 << 16, dtype=torch.uint8)
    la = encode_into(a, "ab" * 32, b"fp", torch.bfloat16, shape,
                     lambda part, *_: gather_blocks_host(kv, ids, n, part))
    lb = encode_into(b, "ab" * 32, b"fp", torch.bfloat16, shape,
                     lambda part, *_: gather_blocks_hashed(kv, ids, n, part))
    assert la == lb and torch.equal(a[:la], b[:lb])
    _, view = chunk_view(b[:lb], "ab" * 32, b"fp")  # verifies every layer
    assert view.shape == shape


def test_encode_into_refuses_a_fill_that_returns_too_few_checksums():
    from kvtier.errors import ChunkFormatError

    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    with pytest.raises(ChunkFormatError, match="checksums for 3 layers"):
        encode_into(buf, "ab" * 32, b"fp", torch.bfloat16, (3, 2, 16, 2, 8), lambda part: (1, 2))


def test_the_kernels_refuse_what_would_reach_outside_their_tensors():
    kv = _pool(torch.bfloat16, 8)
    out = torch.zeros(3, 2, 32, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out of range"):
        gather_blocks_hashed(kv, [0, 9], 32, out)
    with pytest.raises(ValueError, match="out of range"):
        gather_blocks_hashed(kv, [-1, 0], 32, out)
    with pytest.raises(ValueError, match="need 2 blocks"):
        gather_blocks_hashed(kv, [0], 32, out)
    with pytest.raises(ValueError, match="gather into"):
        gather_blocks_hashed(kv, [0, 1], 32, torch.zeros(3, 2, 48, 2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="gather into"):
        gather_blocks_hashed(kv, [0, 1], 32, out.transpose(0, 1))
    with pytest.raises(ValueError, match="mixed dtypes"):
        gather_blocks_hashed(kv, [0, 1], 32, out.to(torch.float16))
    with pytest.raises(ValueError, match="not block-contiguous"):
        gapped = torch.zeros(3, 9, 2, 16, 2, 16, dtype=torch.bfloat16)[..., :8]
        gather_blocks_hashed(gapped, [0, 1], 32, out)
    sums = _layer_sums(out)
    with pytest.raises(ValueError, match="out of range"):
        scatter_blocks_verified(out, sums, 0, kv, [0, 100])
    with pytest.raises(ValueError, match="3 layers, 2 checksums"):
        scatter_blocks_verified(out, sums[:2], 0, kv, [0, 1])
    with pytest.raises(ValueError, match="offset"):
        scatter_blocks_verified(out, sums, 40, kv, [])
    with pytest.raises(ValueError, match="scatter of"):
        scatter_blocks_verified(out, sums, 0, kv[:2], [0, 1])


def test_pieces_gather_and_scatter_of_many_chunks_go_on_past_a_failed_one():
    """Chunks gathered from pieces (two per layer, as vLLM's K and V halves) hash as the
    chunk format does; scattered back in one call, a chunk whose layer fails keeps its
    earlier layers only, and the chunks after it are still copied."""
    import numpy as np

    from kvtier.gpu_pool.kernels.host_native import (
        PieceLayout,
        gather_pieces_hashed,
        scatter_chunks_verified,
    )

    layers, piece = 3, 256
    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (4, layers, 2, piece), generator=g, dtype=torch.uint8)
    layout = PieceLayout(np.full(layers * 2, piece, dtype=np.uint64), layers)
    payloads = [torch.empty(layers * 2 * piece, dtype=torch.uint8) for _ in range(4)]
    sums = []
    for c, out in enumerate(payloads):
        addrs = np.array([src[c, la, h].data_ptr() for la in range(layers) for h in range(2)],
                         dtype=np.uint64)
        sums.append(gather_pieces_hashed(out, addrs, layout))
        assert torch.equal(out, src[c].reshape(-1))
        assert sums[-1] == _layer_sums(out.view(layers, -1))
    payloads[1][piece * 2 * 1 + 5] ^= 1  # chunk 1, layer 1
    payloads[2][0] ^= 1  # chunk 2, layer 0
    dst = torch.zeros_like(src)
    dsts = np.array([[dst[c, la, h].data_ptr() for la in range(layers) for h in range(2)]
                     for c in range(4)], dtype=np.uint64)
    failures = scatter_chunks_verified(payloads, np.array(sums, dtype=np.uint64), dsts, layout)
    assert failures == [(1, 1), (2, 0)]
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[3], src[3])
    assert torch.equal(dst[1, 0], src[1, 0]) and not dst[1, 1:].any()  # up to the bad layer
    assert not dst[2].any()
    with pytest.raises(ValueError, match="one row"):
        scatter_chunks_verified(payloads, np.array(sums[:3], dtype=np.uint64), dsts, layout)
