"""Reading Redis values by their headers (:mod:`.redis_heads`): layer ranges (``GETRANGE``
of each range's bytes, framed as chunks holding only those layers, the writer's checksums
carried over: the stack checks them) and, on a cluster, whole chunks (``GET`` of values
whose length their header confirmed). Two pipelined round trips: headers, then bytes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.chunk_format import layer_span, slice_chunk
from kvtier.connectors.tiers.redis_heads import Head, probe_heads
from kvtier.errors import ChunkError


@dataclass
class ValueReads:
    """What a read found: each key's chunk (None: a miss), and the keys whose values are
    not chunks (unreadable header, a length it disagrees with, another type), to delete."""

    chunks: list[bytes | None]
    not_chunks: list[str] = field(default_factory=list)


async def read_layer_ranges(
    pipeline: Callable[[], Any], redis_key: Callable[[str], str], keys: Sequence[str],
    layers: tuple[int, int], count_faults: Callable[[Sequence[object]], None],
) -> ValueReads:
    """Layers ``layers`` of each key's chunk. ``pipeline()`` opens an asyncio pipeline;
    ``redis_key`` maps a chunk key to its Redis key; ``count_faults`` counts error replies."""
    probes = await probe_heads(pipeline, redis_key, keys, count_faults)
    found = ValueReads([None] * len(keys), probes.not_chunks)
    plan: list[tuple[int, Head]] = []
    for i, head in enumerate(probes.heads):
        if head is not None and 0 <= layers[0] < layers[1] <= head.header.num_layers:
            plan.append((i, head))  # else a miss; fewer layers than asked is no corruption
    if not plan:
        return found
    pipe = pipeline()
    for i, head in plan:
        start, length = layer_span(head.header, layers)
        pipe.getrange(redis_key(keys[i]), head.offset + start, head.offset + start + length - 1)
    parts = await pipe.execute(raise_on_error=False)
    count_faults(parts)
    for (i, head), part in zip(plan, parts, strict=True):
        if not isinstance(part, bytes):
            continue  # deleted or expired between the two round trips
        try:
            found.chunks[i] = slice_chunk(head.header, layers, part)
        except ChunkError:
            found.not_chunks.append(keys[i])
    return found


async def read_whole(
    pipeline: Callable[[], Any], redis_key: Callable[[str], str], keys: Sequence[str],
    count_faults: Callable[[Sequence[object]], None],
) -> ValueReads:
    """Each key's whole chunk, fetched only where its header confirmed the value's length
    (what redis-py's parser allocates is then the chunk's size)."""
    probes = await probe_heads(pipeline, redis_key, keys, count_faults)
    found = ValueReads([None] * len(keys), probes.not_chunks)
    plan = [(i, head) for i, head in enumerate(probes.heads) if head is not None]
    if not plan:
        return found
    pipe = pipeline()
    for i, _ in plan:
        pipe.get(redis_key(keys[i]))
    values = await pipe.execute(raise_on_error=False)
    count_faults(values)
    for (i, head), value in zip(plan, values, strict=True):
        if isinstance(value, bytes) and len(value) == head.length:  # else changed meanwhile
            found.chunks[i] = value
    return found
