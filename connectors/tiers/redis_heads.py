"""Reading the chunk header of Redis values before any of their payload: one pipelined
round trip of ``GETRANGE`` (the first ``HEADER_PROBE_BYTES``) and ``STRLEN`` per key, a
second one only for a header longer than the probe.

What a read then fetches is sized by the header, never by the value: a value whose length
disagrees with its header (one grown to hundreds of MiB), whose header is unreadable, or
that is not a string at all (``WRONGTYPE``) is not a chunk, at the cost of the probe;
another error reply is a miss of that key alone.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.chunk_format import MAGIC, MAX_HEADER_BYTES, ChunkHeader, parse_header
from kvtier.connectors.tiers.redis_client import is_wrong_type
from kvtier.errors import ChunkError

HEADER_PROBE_BYTES = 4096
"""First bytes read of each value; covers the header of any chunk up to ~400 layers."""
_PREFIX = struct.Struct("<4sI")
"""A chunk's fixed prefix: magic, header length."""


@dataclass(frozen=True)
class Head:
    """A value's chunk header, its payload's offset, and its length (which the header
    agrees with)."""

    header: ChunkHeader
    offset: int

    @property
    def length(self) -> int:
        return self.offset + self.header.payload_nbytes


@dataclass
class HeadProbes:
    """Each key's :class:`Head` (None: a miss), and the keys whose values are not chunks,
    to delete."""

    heads: list[Head | None]
    not_chunks: list[str] = field(default_factory=list)


@dataclass
class _Probe:
    prefix: bytes
    length: int


async def probe_heads(
    pipeline: Callable[[], Any], redis_key: Callable[[str], str], keys: Sequence[str],
    count_faults: Callable[[Sequence[object]], None],
) -> HeadProbes:
    """The header of each key's value. ``pipeline()`` opens an asyncio pipeline;
    ``redis_key`` maps a chunk key to its Redis key; ``count_faults`` counts error
    replies."""
    found = HeadProbes([None] * len(keys))
    pipe = pipeline()
    for k in keys:
        pipe.getrange(redis_key(k), 0, HEADER_PROBE_BYTES - 1)
        pipe.strlen(redis_key(k))
    replies = await pipe.execute(raise_on_error=False)
    count_faults(replies)
    longer: dict[int, _Probe] = {}
    for i, (k, prefix, length) in enumerate(zip(keys, replies[0::2], replies[1::2], strict=True)):
        if is_wrong_type(prefix) or is_wrong_type(length):
            found.not_chunks.append(k)
            continue
        if not isinstance(prefix, bytes) or not isinstance(length, int) or not length:
            continue  # a miss (nothing stored, or an error reply of its own)
        probe = _Probe(prefix, length)
        need = _header_bytes(probe)
        if need is None:
            found.not_chunks.append(k)
        elif need > len(prefix):
            longer[i] = probe
        else:
            _settle(found, i, k, probe)
    if longer:  # headers past the probe (chunks of hundreds of layers): a second trip
        pipe = pipeline()
        for i, probe in longer.items():
            pipe.getrange(redis_key(keys[i]), 0, (_header_bytes(probe) or 0) - 1)
        replies = await pipe.execute(raise_on_error=False)
        count_faults(replies)
        for (i, probe), prefix in zip(longer.items(), replies, strict=True):
            if isinstance(prefix, bytes):  # else deleted or expired meanwhile: a miss
                _settle(found, i, keys[i], _Probe(prefix, probe.length))
    return found


def _header_bytes(probe: _Probe) -> int | None:
    """How many bytes the value's prefix and header take, as its prefix says; None where
    that cannot be a chunk's (another magic, a header too long for the value)."""
    if len(probe.prefix) < _PREFIX.size:
        return None
    magic, hlen = _PREFIX.unpack_from(probe.prefix)
    need = _PREFIX.size + hlen
    if magic != MAGIC or hlen > MAX_HEADER_BYTES or need > probe.length:
        return None
    return need


def _settle(found: HeadProbes, i: int, key: str, probe: _Probe) -> None:
    """Key ``i``'s head, where its header parses and agrees with the value's length."""
    try:
        header, offset = parse_header(probe.prefix)
    except ChunkError:
        found.not_chunks.append(key)
        return
    head = Head(header, offset)
    if head.length != probe.length:
        found.not_chunks.append(key)
        return
    found.heads[i] = head
