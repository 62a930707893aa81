"""Chunk blobs and chunk keys: round trips, every corruption caught, layer slices, dedupe."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.chunk_format import (
    decode_chunk,
    encode_chunk,
    layer_span,
    parse_header,
    slice_chunk,
    validate_chunk,
)
from kvtier.chunk_keys import chunk_keys
from kvtier.errors import ChunkFormatError, ChunkMismatchError

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _kv(layers=3, tokens=16, heads=2, dim=8, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, tokens, heads, dim, generator=g).to(dtype)


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 4),
    tokens=st.integers(1, 40),
    heads=st.integers(1, 3),
    dim=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from(DTYPES),
)
def test_round_trip_is_bit_exact(layers, tokens, heads, dim, dtype):
    kv = _kv(layers, tokens, heads, dim, dtype)
    blob = encode_chunk("k", b"model", kv)
    header, out = decode_chunk(blob, "k", b"model")
    assert out.dtype == dtype and torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
    assert header.num_tokens == tokens and header.shape == tuple(kv.shape)


def test_every_single_byte_flip_in_the_payload_is_caught():
    blob = encode_chunk("k", b"m", _kv(layers=2, tokens=4, heads=1, dim=4))
    _, offset = parse_header(blob)
    for i in range(offset, len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x40
        with pytest.raises(ChunkFormatError, match="checksum"):
            validate_chunk(bad)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda b: b[:-1], "truncated"),
        (lambda b: b + b"\0", "truncated or padded"),
        (lambda b: b"XXXX" + b[4:], "not a kvtier chunk"),
        (lambda b: b[:6], "shorter than its fixed prefix|truncated"),
        (lambda b: b[:4] + (10**6).to_bytes(4, "little") + b[8:], "header length"),
        (lambda b: b[:8] + b"\xc1" + b[9:], "header is not valid"),
    ],
)
def test_malformed_blobs_are_rejected(mutate, match):
    blob = encode_chunk("k", b"m", _kv())
    with pytest.raises(ChunkFormatError, match=match):
        validate_chunk(mutate(blob))


def test_wrong_key_or_model_is_a_mismatch():
    blob = encode_chunk("k", b"model-a", _kv())
    with pytest.raises(ChunkMismatchError, match="another model"):
        decode_chunk(blob, "k", b"model-b")
    with pytest.raises(ChunkMismatchError, match="holds k"):
        decode_chunk(blob, "other", b"model-a")


def test_layer_slices_are_valid_chunks_and_stay_verifiable():
    kv = _kv(layers=5)
    blob = encode_chunk("k", b"m", kv)
    header, offset = parse_header(blob)
    off, length = layer_span(header, (1, 4))
    part = slice_chunk(header, (1, 4), memoryview(blob)[offset + off : offset + off + length])
    h, t = decode_chunk(part, "k", b"m")
    assert h.first_layer == 1 and torch.equal(t, kv[1:4])
    bad = bytearray(part)
    bad[-3] ^= 1
    with pytest.raises(ChunkFormatError, match="checksum"):
        validate_chunk(bad)
    with pytest.raises(ChunkFormatError, match="outside"):
        layer_span(header, (4, 6))


def test_bad_tensors_are_refused():
    with pytest.raises(ChunkFormatError, match="layers, 2, tokens"):
        encode_chunk("k", b"m", torch.zeros(2, 3, 4, 1, 1))
    with pytest.raises(ChunkFormatError, match="unsupported chunk dtype"):
        encode_chunk("k", b"m", torch.zeros(1, 2, 1, 1, 1, dtype=torch.int32))


def test_keys_dedupe_shared_prefixes_and_separate_tails_and_models():
    system = list(range(512))
    a = chunk_keys(system + [1, 2, 3] * 100, 256, b"m")
    b = chunk_keys(system + [9, 8] * 100, 256, b"m")
    assert [k.key for k in a[:2]] == [k.key for k in b[:2]]  # the shared system prompt
    assert a[2].key != b[2].key
    assert [(k.start, k.end, k.is_tail) for k in a] == [
        (0, 256, False),
        (256, 512, False),
        (512, 768, False),
        (768, 812, True),
    ]
    other_model = chunk_keys(system, 256, b"other")
    assert other_model[0].key != a[0].key
    # A tail's key carries its length: a longer tail over the same prefix is another key.
    t1 = chunk_keys(list(range(300)), 256, b"m")[-1]
    t2 = chunk_keys(list(range(301)), 256, b"m")[-1]
    assert t1.is_tail and t2.is_tail and t1.key != t2.key
    assert chunk_keys(list(range(300)), 256, b"m", include_tail=False)[-1].end == 256
