"""No byte of a stored chunk is outside a checksum: a one-byte flip anywhere (the magic,
the header's length, any header field such as the fingerprint or the first layer, or the
payload) is refused, never served."""

import pytest
import torch

from kvtier.chunk_format import FORMAT_VERSION, encode_chunk, parse_header, validate_chunk
from kvtier.errors import ChunkError


@pytest.fixture(scope="module")
def blob() -> bytes:
    kv = torch.arange(2 * 2 * 3 * 1 * 4, dtype=torch.float32).view(2, 2, 3, 1, 4)
    return encode_chunk("k" * 32, b"lmcache|meta-of-the-writer", kv)


def test_every_single_byte_flip_is_refused(blob):
    validate_chunk(blob)  # the intact chunk is fine
    refused = 0
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x01
        with pytest.raises(ChunkError):
            validate_chunk(bytes(bad))
        refused += 1
    assert refused == len(blob)


def test_the_fingerprint_and_first_layer_are_covered(blob):
    header, offset = parse_header(blob)
    assert header.version == FORMAT_VERSION
    at = blob.index(b"meta-of-the-writer")
    bad = bytearray(blob)
    bad[at] = ord("M")  # the same length: only a checksum can tell
    with pytest.raises(ChunkError, match="header checksum"):
        parse_header(bytes(bad))
