"""Chunks as bytes objects, for callers that hold or want them whole: the service's chunk
routes (request and reply bodies: what clients and the LMCache backend send and get), and
tests. Built on the two operations of the tiers and the stack (a write from given bytes; a
lease, verified, copied out): the data path itself (the engine, the vLLM connector) never
makes a bytes object of a chunk.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from kvtier.chunk_format import layer_span, slice_chunk
from kvtier.connectors.tiers.base import Blob, PutResult, Tier, blob_writes
from kvtier.connectors.tiers.lent_chunk import LentChunk
from kvtier.connectors.tiers.manager import Location, PutReport, TierManager
from kvtier.errors import ChunkFormatError, InvalidArgumentError
from kvtier.policies.eviction import ChunkInfo

Layers = tuple[int, int] | None


def put_blobs(target: Tier | TierManager, chunks: Mapping[str, Blob],
              info: Mapping[str, ChunkInfo] | None = None, tier: int | str = 0
              ) -> PutResult | PutReport:
    """Store blobs (each checked for its header, key and length first) in one tier (its
    :class:`PutResult`), or through the stack from ``tier`` on (write policy, quotas,
    lower tiers as fallback: its :class:`PutReport`)."""
    writes = blob_writes(chunks, info)
    if isinstance(target, TierManager):
        return target.store(writes, tier)
    return target.store_in_place(writes)


def get_blobs(source: Tier | TierManager, keys: Sequence[str], layers: Layers = None
              ) -> list[bytes | None]:
    """Verified copies of ``keys`` (None for a miss, or for a chunk that failed its checks,
    which is dropped from its tier), each from the fastest tier holding it; with
    ``layers``, chunks holding only those layers (a chunk holding fewer is a miss)."""
    return [blob for blob, _ in get_each(_stack(source), keys, layers)]


def get_each(manager: TierManager, keys: Sequence[str], layers: Layers = None,
             codecs: Collection[str] | None = None, strict: bool = False
             ) -> list[tuple[bytes | None, str | None]]:
    """Each key on its own, not as a prefix: (verified copy, tier name) or (None, None);
    one lease per tier of the keys the faster tiers missed. Hits in a slower tier are
    promoted (whole chunks). ``codecs``: what the reader takes (the stack's by default);
    ``strict`` as :meth:`TierManager.lease_chunks` takes it."""
    if layers is not None and not 0 <= layers[0] < layers[1]:
        raise InvalidArgumentError(f"layer range {layers} is empty or negative")
    out: list[tuple[bytes | None, str | None]] = [(None, None)] * len(keys)
    todo = list(range(len(keys)))
    promote: dict[str, bytes] = {}
    for ti, tier in enumerate(manager.tiers):
        if not todo:
            break
        with manager.lease_chunks([keys[i] for i in todo], Location.all_in(ti, len(todo)),
                                  codecs, strict=strict) as lent:
            missed = []
            for i, chunk in zip(todo, lent, strict=True):
                blob = _copied(chunk, layers)
                if blob is None:
                    missed.append(i)
                    continue
                out[i] = (blob, tier.name)
                if ti > 0 and layers is None:
                    promote[keys[i]] = blob
        if ti + 1 < len(manager.tiers):  # not a miss yet (the lease counted it): a key
            manager.count_misses(-len(missed))  # is a miss once no tier holds it
        todo = missed
    manager.promote(promote)
    return out


def _copied(chunk: LentChunk | None, layers: Layers) -> bytes | None:
    """The lent chunk (or a chunk of its layers ``layers``) verified and copied out;
    None when it fails a check (recorded on it: the stack drops it after the lease)."""
    if chunk is None:
        return None
    header = chunk.header
    try:
        if layers is None:
            chunk.verify()
            return bytes(memoryview(chunk.buf.numpy()))
        start, end = layers[0] - header.first_layer, layers[1] - header.first_layer
        if not 0 <= start < end <= header.num_layers:
            return None  # it holds fewer layers than asked: a miss, not corruption
        chunk.check(start, end)
        lo, n = layer_span(header, (start, end))
        part = memoryview(chunk.payload.numpy())[lo : lo + n]
        return slice_chunk(header, (start, end), part)
    except ChunkFormatError:
        return None


def _stack(source: Tier | TierManager) -> TierManager:
    """A stack to read through: the manager itself, or a one-tier view of a tier (which
    shares its state: nothing to close)."""
    if isinstance(source, TierManager):
        return source
    if not isinstance(source, Tier):
        raise InvalidArgumentError(f"not a tier or a tier stack: {type(source).__name__}")
    return TierManager([source], promote_on_hit=False)
