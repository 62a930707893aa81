"""Chunks read into a caller's shared-memory region (:mod:`kvtier.server.shm_regions`):
one chunk (``GET /v1/chunks/{key}?region=``) or the stored prefix of many keys in one
request (``POST /v1/chunks/batch/get-into-region``).

A restore reads a conversation's chunks in order and stops at the first one missing. Asked
one GET at a time, each chunk costs a round trip through the server's event loop and a
worker thread; on a host whose cores the engine keeps busy every hop waits for a core, and
a returning turn of nine segments waited for nine. The batch read is one round trip: the
chunks go into the region one after another (each at a page boundary), checked group by
group of layers as they are copied, until one is missing or the next does not fit.

Every copy is checked right before it is written (the bytes are read from memory once); a
copy that fails a check is dropped from its tier and the chunk read through the slower
tiers instead. A hit below the fastest tier is promoted, as any read's is.

What a tier lends for the copy (a staging buffer a disk file was read into, a pinned CPU
slot) is the server's memory while the copy runs: the chunks' sizes are taken from the
tiers' indexes first, so a chunk that cannot fit in the room is a 413 (or the end of the
read) before anything is leased, and the chunks leased together are charged against the
read budget (:mod:`kvtier.server.reply_budget`) while they are held.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from kvtier.connectors.tiers.blobs import get_each
from kvtier.connectors.tiers.lent_chunk import LentChunk
from kvtier.connectors.tiers.manager import Location, TierManager
from kvtier.errors import ChunkFormatError
from kvtier.server.errors import RouteError
from kvtier.server.reply_budget import ReplyBudget
from kvtier.server.shm_regions import Region
from kvtier.server.state import ServiceState

GROUP_BYTES = 4 << 20
"""A read into a region checks and copies a chunk this many bytes of layers at a time."""
ALIGN = 4096
"""Where each chunk of a batch read starts: a page boundary (a chunk's payload lies at a
multiple of 64 bytes into it, so the reader's views of it are aligned for any dtype)."""
LEASE_GROUP = 16
"""Keys of a batch read leased at a time, at most (a disk tier's reads of them run
together): only those the room can take, and no more bytes than the read budget's
``group_bytes``."""


class Stop(str, Enum):
    """Why a batch read ended before its last key."""

    MISSING = "missing"
    """The next key is not stored (the stored prefix ends there)."""
    ROOM = "room"
    """The next chunk does not fit in what is left of the room."""


@dataclass(frozen=True)
class RegionChunk:
    """One chunk a batch read wrote: its key as the caller named it, where it lies in the
    region, its length, and the tier it came from."""

    key: str
    offset: int
    length: int
    tier: str


@dataclass(frozen=True)
class PrefixRead:
    chunks: list[RegionChunk]
    stopped: Stop | None
    """Why the keys after ``chunks`` were not read (None: every key was)."""


def get_into_region(state: ServiceState, manager: TierManager, tenant: str, region_id: str,
                    offset: int, room: int | None, key: str, where: str,
                    codecs: frozenset[str] | None) -> tuple[int, str]:
    """Write the verified chunk into the caller's region (worker thread): (length, tier);
    404 where no tier holds it, 413 where it does not fit."""
    with state.regions.using(tenant, region_id) as region:
        end = region.size if room is None else min(region.size, offset + room)
        got = _read_at(_Reader(manager, state.replies, tenant, codecs), region, offset, end,
                       [key], [where], whole_room=True)
        if not got.chunks:
            raise RouteError(404, f"chunk {key} is not stored")
        return got.chunks[0].length, got.chunks[0].tier


def get_prefix_into_region(state: ServiceState, manager: TierManager, tenant: str,
                           region_id: str, offset: int, room: int | None, keys: Sequence[str],
                           wheres: Sequence[str], codecs: frozenset[str] | None) -> PrefixRead:
    """The stored prefix of ``keys`` (stored as ``wheres``) written into the caller's region
    from ``offset``, within ``room`` bytes (worker thread); 413 where the first chunk does
    not fit at all."""
    with state.regions.using(tenant, region_id) as region:
        end = region.size if room is None else min(region.size, offset + room)
        return _read_at(_Reader(manager, state.replies, tenant, codecs), region, offset, end,
                        keys, wheres, whole_room=False)


@dataclass(frozen=True)
class _Reader:
    """Whose reads these are, and through what: the stack, the read budget, the tenant
    charged, the codecs the reader takes."""

    manager: TierManager
    reads: ReplyBudget
    tenant: str
    codecs: frozenset[str] | None


def _read_at(reader: _Reader, region: Region, offset: int, end: int, keys: Sequence[str],
             wheres: Sequence[str], whole_room: bool) -> PrefixRead:
    """The leading stored ``wheres`` copied into ``region[offset:end]`` in order, a group of
    keys leased at a time: as many as the room takes by their indexed sizes, charged
    against the read budget while leased; ``whole_room``: one key at ``offset`` exactly
    (no alignment). A copy that fails its check ends its lease (which drops it from its
    tier) and the chunk is read through the tiers again."""
    manager = reader.manager
    out: list[RegionChunk] = []
    pos = 0
    while pos < len(wheres):
        window = list(wheres[pos : pos + LEASE_GROUP])
        loc = manager.lookup(window, reader.codecs)
        if not loc.length:
            manager.count_misses()
            return PrefixRead(out, Stop.MISSING)
        sizes = manager.sizes(window[: loc.length], loc.tiers)
        n = _taken(reader.reads, region, out, offset, end, keys[pos], sizes, whole_room)
        if n == 0:
            return PrefixRead(out, Stop.ROOM)
        group = Location(n, loc.tiers[:n])
        charge = sum(reader.reads.charge(size) for size in sizes[:n])
        with (reader.reads.holding(reader.tenant, charge),
              manager.lease_chunks(window[:n], group, reader.codecs, strict=True) as parts):
            failed = _copy_lent(manager, region, end, keys, wheres, pos, group.tiers, parts, out,
                                offset, whole_room)
        if isinstance(failed, Stop):
            return PrefixRead(out, failed)
        if failed is not None:  # its corrupt copy is gone now: read it from where it is intact
            with reader.reads.holding(reader.tenant, reader.reads.charge(sizes[failed - pos])):
                ((blob, tier),) = get_each(manager, [wheres[failed]], codecs=reader.codecs,
                                          strict=True)
                if blob is None:
                    return PrefixRead(out, Stop.MISSING)
                start = _next(out, offset, whole_room)
                if not _fits(region, start, end, keys[failed], len(blob), not out):
                    return PrefixRead(out, Stop.ROOM)
                region.write_from(start, memoryview(blob))
            out.append(RegionChunk(keys[failed], start, len(blob), tier or ""))
            pos = failed + 1
            continue
        if n == loc.length < len(window):
            return PrefixRead(out, Stop.MISSING)
        pos += n
    return PrefixRead(out, None)


def _taken(reads: ReplyBudget, region: Region, out: list[RegionChunk], offset: int, end: int,
           first_key: str, sizes: Sequence[int | None], whole_room: bool) -> int:
    """How many of the next stored chunks (their indexed ``sizes``) to lease together: those
    the room takes, within the budget's ``group_bytes`` (one at least); a chunk of unknown
    size goes alone, checked once lent. 0 where the next one does not fit in the room (a
    413, before anything is leased, where it would be the first)."""
    at = _next(out, offset, whole_room)
    n = charged = 0
    for size in sizes:
        if size is None:
            return n or 1
        if at + size > end:
            break
        if n and charged + size > reads.group_bytes:
            return n
        n, charged = n + 1, charged + size
        at = -(-(at + size) // ALIGN) * ALIGN
    if n == 0:
        _fits(region, at, end, first_key, sizes[0] or 0, not out)  # the 413 of a first chunk
    return n


def _next(out: list[RegionChunk], offset: int, whole_room: bool) -> int:
    """Where the next chunk goes: after the last one, at a page boundary."""
    at = out[-1].offset + out[-1].length if out else offset
    return at if whole_room else -(-at // ALIGN) * ALIGN


def _copy_lent(manager: TierManager, region: Region, end: int, keys: Sequence[str],
               wheres: Sequence[str], pos: int, tiers: Sequence[int],
               parts: Sequence[LentChunk | None], out: list[RegionChunk], offset: int,
               whole_room: bool) -> int | Stop | None:
    """Lent chunks (of keys ``pos``..) copied into the region after ``out``, checked as they
    go; hits below the fastest tier promoted. The index of the first one that was not lent
    intact, ROOM where one does not fit, None when all were copied."""
    promoted: dict[str, memoryview] = {}
    try:
        for i, part in enumerate(parts):
            k, start = pos + i, _next(out, offset, whole_room)
            if part is None:
                return k
            if not _fits(region, start, end, keys[k], part.buf.numel(), not out):
                return Stop.ROOM
            if not _checked_copy(region, start, part):
                return k
            out.append(RegionChunk(keys[k], start, part.buf.numel(), manager.tiers[tiers[i]].name))
            if tiers[i] > 0:
                promoted[wheres[k]] = memoryview(part.buf.numpy())
        return None
    finally:
        manager.promote(promoted)


def _fits(region: Region, start: int, end: int, key: str, nbytes: int, first_one: bool) -> bool:
    if start + nbytes <= end:
        return True
    if first_one:
        raise RouteError(413, f"chunk {key} is {nbytes} bytes: it does not fit in the "
                         f"{max(end - start, 0)} bytes of region {region.id} at offset {start}")
    return False


def _checked_copy(region: Region, offset: int, part: LentChunk) -> bool:
    """A lent chunk's header, then each group of its layers once checked, into the region;
    False when a check failed (the region holds no chunk then)."""
    buf, header = part.buf, part.header
    mem = memoryview(buf.numpy())
    at = buf.numel() - header.payload_nbytes
    step = header.layer_nbytes
    region.write_from(offset, mem[:at])
    try:
        for a, b in part.checked_groups(GROUP_BYTES):
            region.write_from(offset + at + a * step, mem[at + a * step : at + b * step])
    except ChunkFormatError:
        return False  # dropped from its tier when the lease ends
    return True
