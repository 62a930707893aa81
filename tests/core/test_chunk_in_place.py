"""Chunks written in place (into a slot that already exists) and read back as views."""

from __future__ import annotations

import tracemalloc

import msgpack
import pytest
import torch

from kvtier.chunk_format import (
    PAYLOAD_ALIGN,
    ChunkHeader,
    chunk_layout,
    chunk_view,
    decode_chunk,
    encode_chunk,
    encode_into,
    validate_chunk,
)
from kvtier.errors import ChunkFormatError, ChunkMismatchError

KEY = "ab" * 32
FP = b"model-fingerprint"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layers", [1, 3, 32, 80])
def test_in_place_chunk_reads_back_as_a_view_and_as_any_chunk(dtype, layers):
    shape = (layers, 2, 16, 2, 8)
    kv = torch.randn(shape).to(dtype)
    offset, total = chunk_layout(KEY, FP, dtype, shape)
    assert offset % PAYLOAD_ALIGN == 0
    slot = torch.full((total + 64,), 0xEE, dtype=torch.uint8)  # a slot larger than the chunk
    n = encode_into(slot, KEY, FP, dtype, shape, lambda payload: payload.copy_(kv))
    assert n == total
    header, view = chunk_view(slot[:n], KEY, FP)
    assert torch.equal(view, kv) and header.num_tokens == 16
    assert view.data_ptr() == slot.data_ptr() + offset  # a view, no copy
    blob = bytes(slot[:n].numpy())
    assert torch.equal(decode_chunk(blob, KEY, FP)[1], kv)  # every reader takes it
    assert validate_chunk(blob).key == KEY


def test_the_header_pads_to_any_size_it_is_asked_for():
    header = ChunkHeader(KEY, FP, "float16", (80, 2, 16, 8, 128), 16, tuple(range(80)))
    base = len(msgpack.packb({**header.fields(), "pad": b""}, use_bin_type=True))
    for size in range(base, base + 600):  # across the bin8 / bin16 boundary
        assert len(header.pack_to(size)) == size
    with pytest.raises(ChunkFormatError, match="does not fit"):
        header.pack_to(base - 1)


def test_in_place_reads_verify_and_never_return_wrong_kv():
    shape = (2, 2, 16, 2, 8)
    kv = torch.randn(shape)
    _, total = chunk_layout(KEY, FP, kv.dtype, shape)
    slot = torch.empty(total, dtype=torch.uint8)
    encode_into(slot, KEY, FP, kv.dtype, shape, lambda p: p.copy_(kv))
    with pytest.raises(ChunkMismatchError, match="another model"):
        chunk_view(slot, KEY, b"other")
    with pytest.raises(ChunkMismatchError):
        chunk_view(slot, "cd" * 32, FP)
    slot[-1] ^= 0xFF  # one flipped payload byte
    with pytest.raises(ChunkFormatError, match="checksum"):
        chunk_view(slot, KEY, FP)
    with pytest.raises(ChunkFormatError, match="needs"):
        encode_into(torch.empty(total - 1, dtype=torch.uint8), KEY, FP, kv.dtype, shape, lambda p: None)


def test_an_older_unaligned_chunk_still_reads():
    kv = torch.randn(2, 2, 16, 2, 8).to(torch.float16)
    blob = encode_chunk(KEY, FP, kv)  # packed header, payload wherever it ends
    buf = torch.frombuffer(bytearray(b"x" + blob), dtype=torch.uint8)[1:]  # odd address
    assert torch.equal(chunk_view(buf, KEY, FP)[1], kv)


def test_writing_and_reading_in_place_allocates_nothing_chunk_sized():
    """No chunk-sized bytes/bytearray (tracemalloc sees Python's allocations) and the
    payload never leaves the slot (torch's own allocations are checked by address)."""
    shape = (16, 2, 256, 8, 128)  # 16 MiB in float16
    kv = torch.randn(shape).to(torch.float16)
    _, total = chunk_layout(KEY, FP, kv.dtype, shape)
    slot = torch.empty(total, dtype=torch.uint8)
    out = torch.empty_like(kv)
    encode_into(slot, KEY, FP, kv.dtype, shape, lambda p: p.copy_(kv))  # warm up
    tracemalloc.start()
    try:
        encode_into(slot, KEY, FP, kv.dtype, shape, lambda p: p.copy_(kv))
        _, view = chunk_view(slot, KEY, FP)
        out.copy_(view)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert torch.equal(out, kv)
    assert slot.data_ptr() <= view.data_ptr() < slot.data_ptr() + total
    assert peak < total // 16, f"{peak} bytes allocated for a {total}-byte chunk"


def test_a_layer_range_view_reads_only_those_layers_checksums():
    shape = (4, 2, 16, 2, 8)
    kv = torch.randn(shape)
    offset, total = chunk_layout(KEY, FP, kv.dtype, shape)
    slot = torch.empty(total, dtype=torch.uint8)
    encode_into(slot, KEY, FP, kv.dtype, shape, lambda p: p.copy_(kv))
    header, part = chunk_view(slot, KEY, FP, layers=(1, 3))
    assert torch.equal(part, kv[1:3]) and header.first_layer == 1 and header.num_layers == 2
    layer_bytes = kv[0].numel() * kv.element_size()
    slot[offset + 3 * layer_bytes] ^= 0xFF  # layer 3 corrupted: layers 1-2 still verify
    assert torch.equal(chunk_view(slot, KEY, FP, layers=(1, 3))[1], kv[1:3])
    with pytest.raises(ChunkFormatError, match="checksum"):
        chunk_view(slot, KEY, FP, layers=(2, 4))
    with pytest.raises(ChunkFormatError, match="outside"):
        chunk_view(slot, KEY, FP, layers=(3, 5))
