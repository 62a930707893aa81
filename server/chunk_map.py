"""The batch routes' msgpack framing, without holding the GIL for a whole batch.

A batch body is a msgpack map of chunk key (str) -> chunk (bin), and a batch reply a msgpack
array of chunk (bin) or nil. ``msgpack.packb``/``unpackb`` of a 400 MiB batch is one C call
that copies every byte while holding the GIL, which stalls the event loop for a second on
two cores. Only the framing is msgpack here; the chunks are never copied: a request's
chunks are views of the buffer the body landed in, and a reply is a list of parts (headers
and the chunks' own bytes) sent one after another.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import msgpack

from kvtier.server.errors import RouteError

_U8, _U16, _U32 = struct.Struct(">B"), struct.Struct(">H"), struct.Struct(">I")
_STR = {0xD9: _U8, 0xDA: _U16, 0xDB: _U32}
_BIN = {0xC4: _U8, 0xC5: _U16, 0xC6: _U32}
_NIL = b"\xc0"


def _bad(why: str) -> RouteError:
    return RouteError(400, f"body must be a msgpack map of chunk key (str) -> chunk (bin): {why}")


def parse_chunk_map(buf: memoryview) -> dict[str, memoryview]:
    """Keys and chunk views of a msgpack map in ``buf`` (no chunk is copied)."""
    n_bytes = len(buf)
    pos = 0

    def length(fmt: struct.Struct) -> int:
        nonlocal pos
        if pos + fmt.size > n_bytes:
            raise _bad("truncated")
        (v,) = fmt.unpack_from(buf, pos)
        pos += fmt.size
        return v

    def take(n: int) -> memoryview:
        nonlocal pos
        if pos + n > n_bytes:
            raise _bad("truncated")
        out = buf[pos : pos + n]
        pos += n
        return out

    tag = length(_U8)
    if 0x80 <= tag <= 0x8F:
        count = tag & 0x0F
    elif tag == 0xDE:
        count = length(_U16)
    elif tag == 0xDF:
        count = length(_U32)
    else:
        raise _bad(f"it starts with 0x{tag:02x}, not a map")
    out: dict[str, memoryview] = {}
    for _ in range(count):
        tag = length(_U8)
        if 0xA0 <= tag <= 0xBF:
            klen = tag & 0x1F
        elif tag in _STR:
            klen = length(_STR[tag])
        else:
            raise _bad(f"a key is not a string (0x{tag:02x})")
        try:
            key = bytes(take(klen)).decode()
        except UnicodeDecodeError:
            raise _bad("a key is not UTF-8") from None
        tag = length(_U8)
        if tag not in _BIN:
            raise _bad(f"the value of {key[:40]!r} is not bin (0x{tag:02x})")
        out[key] = take(length(_BIN[tag]))
    if pos != n_bytes:
        raise _bad(f"{n_bytes - pos} bytes after the map")
    return out


def _bin_header(n: int) -> bytes:
    if n < 1 << 8:
        return b"\xc4" + _U8.pack(n)
    if n < 1 << 16:
        return b"\xc5" + _U16.pack(n)
    return b"\xc6" + _U32.pack(n)


def chunk_list_parts(blobs: Sequence[bytes | memoryview | None]) -> list[bytes | memoryview]:
    """A msgpack array of bin-or-nil as parts to send in order (the chunks not copied)."""
    packer = msgpack.Packer(use_bin_type=True)
    parts: list[bytes | memoryview] = [packer.pack_array_header(len(blobs))]
    for blob in blobs:
        if blob is None:
            parts.append(_NIL)
        else:
            parts.append(_bin_header(len(blob)))
            parts.append(blob)
    return parts
