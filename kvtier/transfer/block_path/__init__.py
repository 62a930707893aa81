"""The one block path: the only code that moves bytes between stored chunks and cache blocks.

Both kvtier's engine (its paged pool) and the vLLM connector's worker (vLLM's per-layer
caches) restore and save through these two entries, on the host and on a GPU alike:

- :func:`scatter`: chunks lent by the tiers (exact or compressed, in any tier's host
  memory) checked against their stored per-layer xxh3 and copied into cache blocks;
- :func:`gather`: a chunk's blocks copied out of the cache into a host slot, with the
  xxh3 of each layer for its header.

Where a cache keeps its blocks is a :class:`CacheBlocks`; which blocks a chunk's blocks go
to is a :class:`BlockSpan`. One failure rule holds everywhere: a chunk that fails its check
(or its read, or its decode, or does not fit the cache) is never served, nor is any chunk
after it; :class:`Scattered` says how many leading chunks were. Bytes may have landed in the
blocks of the chunks not served; the caller recomputes them, so they are overwritten
before attention reads them.

A host cache is moved by the fused native kernels (:mod:`.host_copies`), a GPU's by a window
of device launches that check the bytes where they land (:mod:`.device_copies`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvtier.chunk_format import DTYPES
from kvtier.connectors.tiers.chunk_workers import map_restore
from kvtier.connectors.tiers.lent_chunk import LentChunk
from kvtier.errors import ChunkMismatchError, InvalidArgumentError
from kvtier.transfer.block_path import device_copies, host_copies
from kvtier.transfer.block_path.cache_blocks import CacheBlocks
from kvtier.transfer.block_path.pieces import Pieces, chunk_pieces
from kvtier.transfer.block_path.spans import BlockSpan

__all__ = ["BlockSpan", "CacheBlocks", "Gathered", "Scattered", "gather", "scatter"]


@dataclass(frozen=True)
class Scattered:
    """What a :func:`scatter` served."""

    served: int
    """Leading chunks whose layers were checked and landed in their blocks."""
    reason: str | None = None
    """Why chunk ``served`` was not (None: every chunk was)."""
    bytes: int = 0
    """KV bytes the served chunks delivered (decoded, for compressed ones)."""


def scatter(chunks: Sequence[LentChunk], spans: Sequence[BlockSpan], cache: CacheBlocks,
            first: int = 0, last: int | None = None) -> Scattered:
    """Layers ``[first, last)`` (default: all) of each chunk into the blocks its span
    names. Chunks are served in order up to the first that fails; every copy is done when
    this returns (the lent memory may go)."""
    if len(chunks) != len(spans):
        raise InvalidArgumentError(f"{len(chunks)} chunks, {len(spans)} spans")
    last = cache.layers if last is None else last
    plans: list[Pieces] = []
    stop: tuple[int, str] | None = None
    for i, (chunk, span) in enumerate(zip(chunks, spans, strict=True)):
        try:
            plans.append(_plan(chunk, span, cache, first, last))
        except ChunkMismatchError as exc:
            stop = (i, str(exc))
            break
    if plans:
        found = (device_copies.scatter(chunks[: len(plans)], plans, cache) if cache.on_device
                 else _scatter_host(chunks[: len(plans)], plans, cache))
        if found is not None:
            stop = found
    served = len(chunks) if stop is None else stop[0]
    delivered = sum(c.kv_nbytes(first) - c.kv_nbytes(last) for c in chunks[:served])
    return Scattered(served, None if stop is None else stop[1], delivered)


class Gathered(Protocol):
    """Chunks being gathered out of a cache (:func:`gather`)."""

    def into(self, i: int, out: torch.Tensor) -> tuple[int, ...]:
        """Chunk ``i``'s bytes into ``out``, a contiguous buffer of exactly them in the
        chunk's order (host memory, or for a device cache also memory on its device); the
        xxh3 of each layer, or ``()`` where not hashed."""
        ...


def gather(cache: CacheBlocks, spans: Sequence[BlockSpan], tokens: Sequence[int],
           first: int = 0, last: int | None = None, hashed: bool = True) -> Gathered:
    """Layers ``[first, last)`` of the chunks of ``tokens[i]`` tokens held in the blocks
    ``spans[i]`` names (every one of them), each copied out by ``.into(i, out)`` once its
    slot is there: on the host one fused copy and hash per chunk; on a device a window of
    chunks gathered and hashed at once, copied out chunk by chunk while the next window is
    gathered. Not ``hashed`` (a snapshot, checksummed when it is stored): no sums, and on a
    device the copies are only queued on the caller's current stream (the caller waits)."""
    if len(spans) != len(tokens):
        raise InvalidArgumentError(f"{len(spans)} spans, {len(tokens)} token counts")
    if any(b is None for span in spans for b in span.blocks):
        raise InvalidArgumentError("a gather names every block of its chunks")
    last = cache.layers if last is None else last
    plans = [chunk_pieces(cache, span, n, first, last) for span, n in zip(spans, tokens, strict=True)]
    if cache.on_device:
        return device_copies.DeviceGather(cache, plans, hashed)
    return host_copies.HostGather(plans, hashed)


def _plan(chunk: LentChunk, span: BlockSpan, cache: CacheBlocks, first: int, last: int) -> Pieces:
    """The chunk's pieces, once its header says it fits the cache: every layer of it,
    stored bytes of the cache's element size (or compressed from the cache's dtype) and
    as many tokens as its span's blocks hold."""
    header = chunk.header
    if header.first_layer or header.num_layers != cache.layers:
        raise ChunkMismatchError(f"chunk {header.key} holds layers {header.first_layer}.."
                                 f"{header.first_layer + header.num_layers}, the cache "
                                 f"{cache.layers}")
    dtype = DTYPES.get(header.dtype)
    _, _, tokens, *_ = header.shape
    try:
        plan = chunk_pieces(cache, span, tokens, first, last)
    except ChunkMismatchError as exc:
        raise ChunkMismatchError(f"chunk {header.key}: {exc}") from exc
    kv_layer = header.layer_nbytes if not header.lossy else chunk.kv_nbytes(0) // header.num_layers
    fits = (dtype is not None and dtype.itemsize == cache.dtype.itemsize
            and (not header.lossy or dtype == cache.dtype))
    if not fits or kv_layer != plan.layer_bytes:
        raise ChunkMismatchError(f"chunk {header.key} holds {header.shape} of {header.dtype}, "
                                 f"not {len(span.blocks)} blocks of this cache")
    return plan


def _scatter_host(chunks: Sequence[LentChunk], plans: Sequence[Pieces], cache: CacheBlocks
                  ) -> tuple[int, str] | None:
    """Host copies as jobs over consecutive chunks (whole exact chunks of one shape in one
    native call, a chunk still being read or compressed alone), two at a time on the
    restore workers; the first chunk that failed."""
    jobs: list[list[int]] = []
    for i, chunk in enumerate(chunks):
        alone = chunk.header.lossy or chunk.reading is not None
        prev = jobs[-1][-1] if jobs else None
        same = (prev is not None and not alone and not (chunks[prev].header.lossy
                                                          or chunks[prev].reading is not None)
                and plans[prev].lens.shape == plans[i].lens.shape
                and plans[prev].layer_bytes == plans[i].layer_bytes)
        if same:
            jobs[-1].append(i)
        else:
            jobs.append([i])
    jobs = _halves(jobs)

    def run(job: list[int]) -> tuple[int, str] | None:
        head = chunks[job[0]]
        if head.header.lossy:
            why = host_copies.scatter_lossy(head, plans[job[0]], cache)
            return None if why is None else (job[0], why)
        if head.reading is not None:
            why = host_copies.scatter_reading(head, plans[job[0]])
            return None if why is None else (job[0], why)
        found = host_copies.scatter_whole([chunks[i] for i in job], [plans[i] for i in job])
        return None if found is None else (job[found[0]], found[1])

    failures = [f for f in map_restore(run, jobs) if f is not None]
    return min(failures) if failures else None


def _halves(jobs: list[list[int]]) -> list[list[int]]:
    """A lone batch split in two, so that both restore workers copy."""
    if len(jobs) == 1 and len(jobs[0]) > 1:
        mid = len(jobs[0]) // 2
        return [jobs[0][:mid], jobs[0][mid:]]
    return jobs
