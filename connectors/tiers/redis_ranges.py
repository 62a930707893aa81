"""Reading layer ranges of chunks out of Redis values: two pipelined round trips, one for
each value's header (its first ``HEADER_PROBE_BYTES``), one for each layer range's bytes
(``GETRANGE``), framed as chunks holding only those layers (the writer's checksums carried
over: the stack checks them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.chunk_format import ChunkHeader, layer_span, parse_header, slice_chunk
from kvtier.errors import ChunkError

HEADER_PROBE_BYTES = 4096
"""First bytes read by a layer-range read; covers the header of any chunk up to ~400 layers."""


@dataclass
class RangeReads:
    """What a layer-range read found: each key's chunk of those layers (None: a miss),
    and the values found corrupt (key -> bytes), to delete."""

    chunks: list[bytes | None]
    corrupt: dict[str, int] = field(default_factory=dict)


@dataclass
class _Planned:
    index: int
    header: ChunkHeader | None
    """None: the header is longer than the probe; the whole value is read."""
    offset: int = 0


async def read_layer_ranges(
    pipeline: Callable[[], Any], redis_key: Callable[[str], str], keys: Sequence[str],
    layers: tuple[int, int], count_faults: Callable[[Sequence[object]], None],
) -> RangeReads:
    """Layers ``layers`` of each key's chunk. ``pipeline()`` opens an asyncio pipeline;
    ``redis_key`` maps a chunk key to its Redis key; ``count_faults`` counts error replies."""
    pipe = pipeline()
    for k in keys:
        pipe.getrange(redis_key(k), 0, HEADER_PROBE_BYTES - 1)
    probes = await pipe.execute(raise_on_error=False)
    count_faults(probes)
    found = RangeReads([None] * len(keys))
    plan: list[_Planned] = []
    for i, (k, probe) in enumerate(zip(keys, probes, strict=True)):
        if not isinstance(probe, bytes) or not probe:
            continue  # miss
        try:
            header, offset = parse_header(probe)
        except ChunkError:
            if len(probe) == HEADER_PROBE_BYTES:  # maybe a header longer than the probe
                plan.append(_Planned(i, None))
            else:
                found.corrupt[k] = len(probe)
            continue
        if not 0 <= layers[0] < layers[1] <= header.num_layers:
            continue  # the chunk holds fewer layers than asked: a miss, not corruption
        plan.append(_Planned(i, header, offset))
    if not plan:
        return found
    pipe = pipeline()
    for p in plan:
        if p.header is None:
            pipe.get(redis_key(keys[p.index]))
        else:
            start, length = layer_span(p.header, layers)
            pipe.getrange(redis_key(keys[p.index]), p.offset + start, p.offset + start + length - 1)
    parts = await pipe.execute(raise_on_error=False)
    count_faults(parts)
    for p, part in zip(plan, parts, strict=True):
        if isinstance(part, bytes):  # else deleted or expired between the two round trips
            _frame(found, keys[p.index], p, part, layers)
    return found


def _frame(found: RangeReads, key: str, p: _Planned, part: bytes, layers: tuple[int, int]) -> None:
    header = p.header
    try:
        if header is None:
            header, offset = parse_header(part)
            start, length = layer_span(header, layers)
            part = part[offset + start : offset + start + length]
        found.chunks[p.index] = slice_chunk(header, layers, part)
    except ChunkError:
        found.corrupt[key] = header.payload_nbytes if header is not None else len(part)
