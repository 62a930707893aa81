"""The native host kernels' address-based wrappers (:func:`verify_scatter`,
:func:`gather_hash`, :func:`verify_decode_pieces`) agree bit for bit with torch copies and
the reference decode, checksum as the chunk format does (xxh3 of each layer), check each
segment before they copy any of it and stop at the first that fails, copy nothing for a
piece of length 0, and refuse tables whose lengths do not agree.

The kernels trust the addresses they are given (the block path checks them); here they
are taken from live tensors' ``data_ptr()``, and every tensor is kept alive by the test
for as long as the call runs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import xxhash

from kvtier.chunk_format import chunk_view, encode_chunk, encode_into, parse_header
from kvtier.gpu_pool.kernels import host_native
from kvtier.kv_codecs import Codec, layer_exponents_at, native_id, reference_decode

BS = 16  # tokens per pool block


def _pool(dtype: torch.dtype, seed: int, layers: int = 3, blocks: int = 9) -> torch.Tensor:
    """A pool ``[layers, blocks, 2, BS, 2, 8]`` of random bit patterns."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(1 << 15), 1 << 15, (layers, blocks, 2, BS, 2, 8), generator=g,
                         dtype=torch.int32)
    if dtype.itemsize == 1:
        return bits.to(torch.int8).view(dtype)
    return bits.to(torch.int16).view(dtype) if dtype.itemsize == 2 else bits.view(dtype)


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.uint8)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # compared as bits: random patterns hold NaNs


def _xxh(t: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(_bits(t).numpy().tobytes())


def _layer_sums(t: torch.Tensor) -> list[int]:
    return [_xxh(t[i]) for i in range(t.shape[0])]


def _u64(values) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(values, dtype=np.uint64))


def _block_pieces(kv: torch.Tensor, ids: list[int], tokens: int, skip: int = 0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Addresses and lengths of the half-blocks of pool ``kv`` that hold a chunk of
    ``tokens`` tokens, in the chunk's order (layer, K/V, block): chunk block ``j`` is pool
    block ``ids[j - skip]``; the first ``skip`` chunk blocks are pieces of length 0."""
    layers, _, _, bs, heads, dim = kv.shape
    token_bytes = heads * dim * kv.element_size()
    blocks = -(-tokens // bs)
    assert len(ids) == blocks - skip
    addrs, lens = [], []
    for layer in range(layers):
        for half in range(2):
            for j in range(blocks):
                b = ids[j - skip] if j >= skip else ids[0]
                addrs.append(kv[layer, b, half].data_ptr())
                lens.append(0 if j < skip else min(bs, tokens - j * bs) * token_bytes)
    return _u64(addrs), _u64(lens)


def _chunk_pieces(chunk: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Each layer's address and the address of each block's run of tokens in ``chunk``
    (``[layers, 2, tokens, heads, dim]``), in the same order as :func:`_block_pieces`."""
    layers, _, tokens, _, _ = chunk.shape
    segs = _u64([chunk[layer].data_ptr() for layer in range(layers)])
    srcs = _u64([chunk[layer, half, j * BS].data_ptr() for layer in range(layers)
                 for half in range(2) for j in range(-(-tokens // BS))])
    return segs, srcs


def _gather_ref(kv: torch.Tensor, ids: list[int], tokens: int) -> torch.Tensor:
    layers, _, _, bs, heads, dim = kv.shape
    out = torch.empty((layers, 2, tokens, heads, dim), dtype=kv.dtype)
    for j, b in enumerate(ids):
        n = min(bs, tokens - j * bs)
        out[:, :, j * bs : j * bs + n] = kv[:, b, :, :n]
    return out


def _scatter_ref(chunk: torch.Tensor, kv: torch.Tensor, ids: list[int], skip: int = 0) -> None:
    tokens, bs = chunk.shape[2], kv.shape[3]
    for j in range(skip, -(-tokens // bs)):
        n = min(bs, tokens - j * bs)
        kv[: chunk.shape[0], ids[j - skip], :, :n] = chunk[:, :, j * bs : j * bs + n]


def test_the_native_kernels_are_built():
    """The install builds them (scripts/setup.sh); without them the data path works but
    crosses memory twice, so a silent build failure must show here."""
    assert host_native.AVAILABLE


# --- gather_hash --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
@pytest.mark.parametrize("num_tokens", [16, 40, 48, 1])
@pytest.mark.parametrize("layers", [(0, 3), (1, 2)])
def test_gather_hash_of_pool_blocks_matches_torch_and_the_chunk_checksums(dtype, num_tokens,
                                                                          layers):
    kv = _pool(dtype, num_tokens)
    ids = [7, 2, 5][: -(-num_tokens // BS)]
    a, b = layers
    want = _gather_ref(kv[a:b], ids, num_tokens)
    got = torch.full_like(want, 3)
    srcs, lens = _block_pieces(kv[a:b], ids, num_tokens)
    sums = host_native.gather_hash(got.data_ptr(), srcs, lens, 2 * len(ids))
    assert sums.dtype == np.uint64 and sums.shape == (b - a,)
    assert torch.equal(_bits(got), _bits(want))
    assert sums.tolist() == _layer_sums(want)


def test_gather_hash_of_odd_pieces_copies_them_end_to_end_and_hashes_each_run():
    """Lengths around the kernel's 4 KiB step and its streaming threshold, addresses at odd
    bytes, pieces of length 0 (nothing copied, nothing hashed; a run of only those hashes
    as no bytes), and nothing written past the last piece."""
    src = _random_bytes(300_000, 1)
    runs = [[1, 7, 0], [4097, 0, 65537], [13, 100_000, 255], [0, 0, 0], [256, 4096, 3]]
    starts = [[3, 1001, 0], [17, 5, 70_001], [9, 123_457, 200_001], [0, 0, 0], [11, 90_003, 7]]
    lens = _u64([n for run in runs for n in run])
    srcs = _u64([src.data_ptr() + s for run in starts for s in run])
    total = int(lens.sum())
    buf = _random_bytes(total + 64, 2)
    out = buf[1:]  # an odd destination address
    before = buf.clone()
    sums = host_native.gather_hash(out.data_ptr(), srcs, lens, 3)
    pieces = [src[s : s + n] for run_s, run_n in zip(starts, runs, strict=True)
              for s, n in zip(run_s, run_n, strict=True)]
    want = torch.cat(pieces)
    assert torch.equal(out[:total], want)
    assert torch.equal(buf[0], before[0]) and torch.equal(out[total:], before[1 + total :])
    run_bytes = [torch.cat(pieces[i * 3 : i * 3 + 3]).numpy().tobytes() for i in range(len(runs))]
    assert sums.tolist() == [xxhash.xxh3_64_intdigest(r) for r in run_bytes]
    assert sums[3] == xxhash.xxh3_64_intdigest(b"")


def test_gather_hash_of_no_pieces_writes_nothing():
    out = _random_bytes(16, 3)
    before = out.clone()
    sums = host_native.gather_hash(out.data_ptr(), _u64([]), _u64([]), 4)
    assert sums.shape == (0,) and torch.equal(out, before)


def test_gather_hash_refuses_tables_that_do_not_agree():
    src = _random_bytes(64, 4)
    out = torch.zeros(64, dtype=torch.uint8)
    srcs, lens = _u64([src.data_ptr()] * 4), _u64([8] * 4)
    with pytest.raises(ValueError, match="runs of"):
        host_native.gather_hash(out.data_ptr(), srcs, lens, 3)  # 4 pieces, runs of 3
    with pytest.raises(ValueError, match="runs of"):
        host_native.gather_hash(out.data_ptr(), srcs, lens, 0)
    with pytest.raises(ValueError, match="runs of"):
        host_native.gather_hash(out.data_ptr(), srcs, lens[:3], 2)
    assert not out.any()


def test_encode_into_with_gather_hash_as_its_fill_writes_the_same_chunk():
    """The checksums gather_hash returns are the chunk format's: a chunk framed with them
    is the chunk the format writes from the same KV, and verifies."""
    kv = _pool(torch.bfloat16, 7)
    ids, n = [4, 6, 1], 40
    shape = (3, 2, n, 2, 8)
    srcs, lens = _block_pieces(kv, ids, n)
    a = torch.zeros(1 << 16, dtype=torch.uint8)
    b = torch.zeros(1 << 16, dtype=torch.uint8)

    def copy(part):
        part.copy_(_gather_ref(kv, ids, n))

    def fused(part):
        assert part.is_contiguous()
        return tuple(host_native.gather_hash(part.data_ptr(), srcs, lens, 2 * len(ids)).tolist())

    la = encode_into(a, "ab" * 32, b"fp", torch.bfloat16, shape, copy)
    lb = encode_into(b, "ab" * 32, b"fp", torch.bfloat16, shape, fused)
    assert la == lb and torch.equal(a[:la], b[:lb])
    _, view = chunk_view(b[:lb], "ab" * 32, b"fp")  # verifies every layer
    assert view.shape == shape


def test_encode_into_refuses_a_fill_that_returns_too_few_checksums():
    from kvtier.errors import ChunkFormatError

    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    with pytest.raises(ChunkFormatError, match="checksums for 3 layers"):
        encode_into(buf, "ab" * 32, b"fp", torch.bfloat16, (3, 2, 16, 2, 8), lambda part: (1, 2))


# --- verify_scatter -----------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 16, 32])
@pytest.mark.parametrize("num_tokens", [48, 40])
def test_verify_scatter_into_pool_blocks_matches_torch_from_any_block_offset(offset,
                                                                             num_tokens):
    kv = _pool(torch.bfloat16, 5)
    chunk = _gather_ref(kv, [1, 2, 3][: -(-num_tokens // BS)], num_tokens)
    skip = offset // BS
    ids = [8, 0, 4][: -(-num_tokens // BS) - skip]
    ref, out = kv.clone(), kv.clone()
    _scatter_ref(chunk, ref, ids, skip)
    segs, srcs = _chunk_pieces(chunk)
    dsts, lens = _block_pieces(out, ids, num_tokens, skip)
    bad = host_native.verify_scatter(segs, chunk[0].nbytes, _u64(_layer_sums(chunk)), srcs, dsts,
                                     lens, 2 * -(-num_tokens // BS))
    assert bad == -1
    assert torch.equal(_bits(out), _bits(ref))  # tail slots of a partial block kept


def test_a_segment_that_fails_its_check_is_not_copied_nor_any_after_it():
    kv = _pool(torch.float16, 6, layers=4)
    chunk = _gather_ref(kv, [0, 1], 32)
    sums = _u64(_layer_sums(chunk))
    chunk.view(torch.uint8)[2, 1, 5, 0, 3] ^= 0x10  # one bit of layer 2 flipped
    chunk.view(torch.uint8)[3, 0, 0, 0, 0] ^= 0x01  # and one of layer 3: the first is told
    out = kv.clone()
    segs, srcs = _chunk_pieces(chunk)
    dsts, lens = _block_pieces(out, [6, 7], 32)
    assert host_native.verify_scatter(segs, chunk[0].nbytes, sums, srcs, dsts, lens, 4) == 2
    ref = kv.clone()
    _scatter_ref(chunk[:2], ref, [6, 7])
    assert torch.equal(_bits(out), _bits(ref))  # layers 0-1 copied, 2-3 untouched


def test_verify_scatter_of_odd_pieces_and_pieces_of_length_zero():
    """Segments of an odd length, pieces at odd addresses around the kernel's streaming
    threshold; a piece of length 0 copies nothing, wherever it points."""
    seg_len, per = 9001, 4
    src = _random_bytes(3 * seg_len, 8)
    dst = _random_bytes(3 * seg_len + 4096, 9)
    ref = dst.clone()
    sentinel = 3 * seg_len + 100  # where every piece of length 0 points
    piece_lens = [[1, 0, 255, 8745], [4096, 4097, 0, 808], [0, 0, 0, 9001]]
    srcs, dsts, lens = [], [], []
    at = 1
    for s, run in enumerate(piece_lens):
        off = 0
        for n in run:
            srcs.append(src.data_ptr() + s * seg_len + off)
            dsts.append(dst.data_ptr() + (at if n else sentinel))
            lens.append(n)
            if n:
                ref[at : at + n] = src[s * seg_len + off : s * seg_len + off + n]
            off += n
            at += n + (n % 3)  # gaps of 0-2 bytes, kept
    segs = _u64([src.data_ptr() + s * seg_len for s in range(3)])
    sums = _u64([_xxh(src[s * seg_len : (s + 1) * seg_len]) for s in range(3)])
    bad = host_native.verify_scatter(segs, seg_len, sums, _u64(srcs), _u64(dsts), _u64(lens), per)
    assert bad == -1
    assert torch.equal(dst, ref)


def test_verify_scatter_refuses_tables_that_do_not_agree():
    src = _random_bytes(64, 10)
    dst = torch.zeros(64, dtype=torch.uint8)
    segs = _u64([src.data_ptr(), src.data_ptr() + 32])
    sums = _u64([_xxh(src[:32]), _xxh(src[32:])])
    srcs = _u64([src.data_ptr() + i * 16 for i in range(4)])
    dsts = _u64([dst.data_ptr() + i * 16 for i in range(4)])
    lens = _u64([16] * 4)
    for args in [(segs, 32, sums[:1], srcs, dsts, lens, 2),
                 (segs, 32, sums, srcs[:3], dsts, lens, 2),
                 (segs, 32, sums, srcs, dsts[:3], lens, 2),
                 (segs, 32, sums, srcs, dsts, lens[:3], 2),
                 (segs, 32, sums, srcs, dsts, lens, 3)]:
        with pytest.raises(ValueError, match="wrong length"):
            host_native.verify_scatter(*args)
    assert not dst.any()
    empty = _u64([])
    assert host_native.verify_scatter(empty, 32, empty, empty, empty, empty, 2) == -1
    assert host_native.verify_scatter(segs, 32, sums, srcs, dsts, lens, 2) == -1
    assert torch.equal(dst, src)


def test_gather_hash_then_verify_scatter_round_trips_pieces():
    """Pieces gathered (two per layer, as vLLM's K and V halves) hash as the chunk format
    does; scattered back with those sums they land where they came from."""
    layers, piece = 3, 256
    src = _random_bytes(layers * 2 * piece, 3).view(layers, 2, piece)
    addrs = _u64([src[la, h].data_ptr() for la in range(layers) for h in range(2)])
    lens = _u64([piece] * (layers * 2))
    payload = torch.empty(layers * 2 * piece, dtype=torch.uint8)
    sums = host_native.gather_hash(payload.data_ptr(), addrs, lens, 2)
    assert torch.equal(payload, src.reshape(-1))
    assert sums.tolist() == _layer_sums(payload.view(layers, -1))
    dst = torch.zeros_like(src)
    segs = _u64([payload.data_ptr() + la * 2 * piece for la in range(layers)])
    srcs = _u64([payload.data_ptr() + i * piece for i in range(layers * 2)])
    dsts = _u64([dst[la, h].data_ptr() for la in range(layers) for h in range(2)])
    assert host_native.verify_scatter(segs, 2 * piece, sums, srcs, dsts, lens, 2) == -1
    assert torch.equal(dst, src)
    payload[piece * 2 * 1 + 5] ^= 1  # layer 1
    dst.zero_()
    assert host_native.verify_scatter(segs, 2 * piece, sums, srcs, dsts, lens, 2) == 1
    assert torch.equal(dst[0], src[0]) and not dst[1:].any()  # up to the bad layer


# --- verify_decode_pieces -----------------------------------------------------------

needs_codec = pytest.mark.skipif(not host_native.CODEC_AVAILABLE,
                                 reason="the native codec kernels were not built")

LAYERS, TOKENS, HEADS, DIM = 3, 64, 2, 64
ROWS = [(0, 0, TOKENS), (1, 0, TOKENS), (0, 5, 40), (1, 33, 47), (0, 9, 9)]
"""Per layer: K/V half, first token, end token; whole halves, runs that start and end
inside the codecs' groups of 32, and one of no tokens."""


def _encoded(codec: Codec, dtype: torch.dtype) -> tuple[bytearray, torch.Tensor, object]:
    kv = torch.randn((LAYERS, 2, TOKENS, HEADS, DIM), generator=torch.Generator().manual_seed(4))
    kv[:, 0, :, :, 7] *= 40
    blob = bytearray(encode_chunk("k" * 8, b"fp", kv.to(dtype), codec))
    header, offset = parse_header(blob)
    return blob, torch.frombuffer(blob, dtype=torch.uint8)[offset:], header


def _decode_targets(dtype: torch.dtype) -> tuple[list[list[torch.Tensor]], torch.Tensor, np.ndarray]:
    """A random-filled output per layer and row, a sentinel the row of no tokens points at,
    and the pieces table ``[LAYERS, len(ROWS), 4]``."""
    g = torch.Generator().manual_seed(11)
    outs = [[torch.randn((max(t1 - t0, 1), HEADS, DIM), generator=g).to(dtype)
             for _, t0, t1 in ROWS] for _ in range(LAYERS)]
    sentinel = torch.randn((4, HEADS, DIM), generator=g).to(dtype)
    pieces = _u64([[[half, t0, t1, sentinel.data_ptr() if t0 == t1 else outs[la][r].data_ptr()]
                    for r, (half, t0, t1) in enumerate(ROWS)] for la in range(LAYERS)])
    return outs, sentinel, pieces


def _decoded(payload, header, codec, dtype, layer) -> torch.Tensor:
    step = header.layer_nbytes
    return reference_decode(payload[layer * step : (layer + 1) * step], codec,
                            (1, 2, TOKENS, HEADS, DIM), dtype)[0]


def _call(codec, dtype, payload, header, pieces, expected=None, layers=LAYERS):
    at = layer_exponents_at(codec, (2, TOKENS, HEADS, DIM), dtype)
    expected = _u64(header.layer_checksums if expected is None else expected)
    return host_native.verify_decode_pieces(native_id(codec), dtype, payload.data_ptr(), layers,
                                            header.layer_nbytes, at, (TOKENS, HEADS, DIM),
                                            expected, pieces)


@needs_codec
@pytest.mark.parametrize("codec", [Codec.FP8, Codec.INT8, Codec.INT4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_verify_decode_pieces_equals_the_reference_decode(codec, dtype):
    blob, payload, header = _encoded(codec, dtype)
    outs, sentinel, pieces = _decode_targets(dtype)
    before = [[o.clone() for o in row] for row in outs]
    kept = sentinel.clone()
    assert _call(codec, dtype, payload, header, pieces) == (-1, 0)
    for layer in range(LAYERS):
        want = _decoded(payload, header, codec, dtype, layer)
        for r, (half, t0, t1) in enumerate(ROWS):
            expect = want[half, t0:t1] if t1 > t0 else before[layer][r]
            assert torch.equal(_bits(outs[layer][r]), _bits(expect)), (layer, ROWS[r])
    assert torch.equal(_bits(sentinel), _bits(kept))  # the row of no tokens wrote nothing
    del blob


@needs_codec
def test_verify_decode_pieces_stops_at_a_corrupt_layer():
    codec, dtype = Codec.INT8, torch.bfloat16
    blob, payload, header = _encoded(codec, dtype)
    payload[1 * header.layer_nbytes + 5] ^= 1  # layer 1's bytes
    outs, _, pieces = _decode_targets(dtype)
    before = [[o.clone() for o in row] for row in outs]
    assert _call(codec, dtype, payload, header, pieces) == (1, -1)
    want = _decoded(payload, header, codec, dtype, 0)
    for r, (half, t0, t1) in enumerate(ROWS[:-1]):
        assert torch.equal(_bits(outs[0][r]), _bits(want[half, t0:t1]))
    for layer in (1, 2):  # nothing of the bad layer or after it written
        for r in range(len(ROWS)):
            assert torch.equal(_bits(outs[layer][r]), _bits(before[layer][r]))
    del blob


@needs_codec
@pytest.mark.parametrize("codec", [Codec.FP8, Codec.INT8, Codec.INT4])
def test_verify_decode_pieces_refuses_bytes_no_encoder_writes(codec):
    """Layer 1's first key exponent set to -128 (no encoder writes it) under a checksum
    recomputed to match, as a foreign writer's chunk would be: its checksum passes, its
    decode is refused with the codec's status, and no later layer is written."""
    dtype = torch.float16
    blob, payload, header = _encoded(codec, dtype)
    step = header.layer_nbytes
    k_at, _ = layer_exponents_at(codec, (2, TOKENS, HEADS, DIM), dtype)
    payload[step + k_at] = 0x80
    sums = list(header.layer_checksums)
    sums[1] = _xxh(payload[step : 2 * step])
    header = dataclasses.replace(header, layer_checksums=tuple(sums))
    outs, _, pieces = _decode_targets(dtype)
    before = [o.clone() for o in outs[2]]
    assert _call(codec, dtype, payload, header, pieces) == (1, 2)  # 2: an exponent
    assert all(torch.equal(_bits(o), _bits(b)) for o, b in zip(outs[2], before, strict=True))
    want = _decoded(payload, header, codec, dtype, 0)
    assert torch.equal(_bits(outs[0][0]), _bits(want[0]))
    del blob


@needs_codec
def test_verify_decode_pieces_refuses_tables_that_do_not_agree():
    codec, dtype = Codec.FP8, torch.bfloat16
    blob, payload, header = _encoded(codec, dtype)
    outs, sentinel, pieces = _decode_targets(dtype)
    before = [[o.clone() for o in row] for row in outs]
    for bad in [pieces.astype(np.int64), pieces.reshape(LAYERS, -1), pieces[:2],
                np.ascontiguousarray(pieces[..., :3])]:
        with pytest.raises(ValueError, match="pieces must be"):
            _call(codec, dtype, payload, header, bad)
    with pytest.raises(ValueError, match="3 layers, 2 checksums"):
        _call(codec, dtype, payload, header, pieces, expected=header.layer_checksums[:2])
    # no layers, or no pieces: nothing to do
    assert _call(codec, dtype, payload, header, pieces[:0], expected=(), layers=0) == (-1, 0)
    assert _call(codec, dtype, payload, header, pieces[:, :0]) == (-1, 0)
    for layer in range(LAYERS):
        for r in range(len(ROWS)):
            assert torch.equal(_bits(outs[layer][r]), _bits(before[layer][r]))
    del blob, sentinel
