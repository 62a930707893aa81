"""Cheap admission checks and full verification of chunk blobs, shared by the tiers.

A tier admits a blob only when its header parses, names the key it is stored under and the
blob's length matches the header (cheap: no checksum pass). The full checksum pass runs on
read, so a chunk corrupted at rest is caught and turned into a miss.
"""

from __future__ import annotations

from kvtier.chunk_format import check_names, parse_header, validate_chunk
from kvtier.errors import ChunkError, ChunkFormatError, ChunkMismatchError


def admission_error(key: str, blob: bytes | bytearray | memoryview) -> str | None:
    """Why ``blob`` may not be stored under ``key`` (``"invalid: ..."``), or None."""
    try:
        header, offset = parse_header(blob)
    except ChunkFormatError as exc:
        return f"invalid: {exc}"
    try:
        check_names(header, key)  # its key, and the namespace (tenant) it was stored for
    except ChunkMismatchError as exc:
        return f"invalid: {exc}"
    if len(blob) != offset + header.payload_nbytes:
        return (
            f"invalid: blob is {len(blob)} bytes, its header says {offset + header.payload_nbytes}"
        )
    return None


def is_valid(key: str, blob: bytes | bytearray | memoryview) -> bool:
    """Full check (header, length, every layer checksum, key) of a blob read back."""
    try:
        validate_chunk(blob, key=key)
    except ChunkError:
        return False
    return True
