"""Moving a token prefix's KV between the paged pool and the lower tiers.

``save`` gathers the pool blocks that hold a prefix (all layers, one kernel launch per
chunk) into chunk blobs and puts them through the :class:`TierManager`; ``load`` reads the
stored chunks back, verified, scatters them into fresh pool blocks and publishes them in the
prefix cache, so the next request over that prefix finds them as ordinary prefix hits and
computes only the rest. ``evict`` drops a prefix's unreferenced blocks from the pool (the
offload's second half: only once its chunks are safely stored).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvtier.chunk_format import decode_chunk, encode_chunk
from kvtier.chunk_keys import ChunkKey, chunk_keys
from kvtier.connectors.tiers.manager import Location, TierManager
from kvtier.errors import ChunkError, InvalidArgumentError, OutOfBlocksError
from kvtier.gpu_pool import PagedKVPool
from kvtier.gpu_pool.kernels import gather_blocks, scatter_blocks
from kvtier.hashing import chain_hashes
from kvtier.policies.eviction import ChunkInfo
from kvtier.transfer.layer_load import LayerLoad

log = logging.getLogger(__name__)


@dataclass
class SaveReport:
    tokens: int
    """Leading tokens whose KV is now stored in some tier."""
    keys: list[str] = field(default_factory=list)
    stored: int = 0
    already: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    bytes: int = 0


@dataclass
class Snapshot:
    """Host copies of the chunks of a prefix that are not stored yet."""

    keys: list[ChunkKey]
    already: int = 0
    """Leading chunks already stored in some tier."""
    end: int = 0
    """Tokens covered by the stored chunks plus the copied ones (contiguous)."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0
    ready: torch.cuda.Event | None = None


@dataclass
class StoredPrefix:
    """What a restore would find (:meth:`KVTransfer.stored_prefix`). Hand it to
    :meth:`KVTransfer.load` right after, and the restore reads what it saw without asking
    every tier (a Redis round trip among them) where each chunk lies a second time."""

    cached: int
    """Leading tokens still cached in the pool."""
    chunks: list[tuple[int, str]]
    """The stored chunks after them, in order: new tokens each brings, fastest tier."""
    prefix: list[int] = field(default_factory=list, repr=False)
    keys: list[ChunkKey] = field(default_factory=list, repr=False)
    loc: Location | None = field(default=None, repr=False)


@dataclass
class LoadReport:
    tokens: int
    """Leading tokens whose KV is now in the pool (cached blocks or restored from tiers)."""
    from_pool: int = 0
    from_tiers: int = 0
    tier_hits: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    pending: LayerLoad | None = None
    """A streamed restore still loading (the pool's forward passes wait on it per layer);
    then ``bytes`` counts only what was read before returning (``pending.bytes`` grows)."""


class PoolOwner(Protocol):
    """What the data path needs of the engine's model runner: its pool, the model
    fingerprint its chains are keyed with, and the layer-wise loads the forward waits on.
    (A protocol, so that transfer/ sits below engine/ and imports nothing of it.)"""

    pool: PagedKVPool
    fingerprint: bytes
    layer_loads: list[LayerLoad]

    def add_layer_load(self, load: LayerLoad) -> None: ...

    def reap_layer_loads(self, wait: bool = False) -> None: ...


CPU_STREAM_MIN_TOKENS = 2048
"""On a CPU, restores stream layer by layer only from this many tokens (docs/tiers.md)."""


class KVTransfer:
    def __init__(
        self,
        runner: PoolOwner,
        manager: TierManager,
        chunk_tokens: int = 256,
        stream: bool | None = False,
    ):
        bs = runner.pool.block_size
        if chunk_tokens < bs or chunk_tokens % bs:
            raise InvalidArgumentError(
                f"chunk_tokens ({chunk_tokens}) must be a positive multiple of the pool's "
                f"block_size ({bs})"
            )
        self.runner = runner
        self.manager = manager
        self.chunk_tokens = chunk_tokens
        self._tmp_ids = itertools.count()
        self._stream: torch.cuda.Stream | None = None
        self.stream = stream
        """Whether restores stream layer by layer; None: on CUDA always, on CPU from
        ``stream_min_tokens`` restored tokens (below that, on a few shared cores, the
        loader thread's competition with the forward costs more than the overlap saves:
        see docs/tiers.md)."""
        self.stream_min_tokens = CPU_STREAM_MIN_TOKENS
        self._executor: ThreadPoolExecutor | None = None
        self.lost_restores = 0
        """Restores that lost chunks after they were published (recomputed instead)."""

    @property
    def _pool(self):
        return self.runner.pool

    def _keys(self, token_ids: Sequence[int]) -> list[ChunkKey]:
        return chunk_keys(token_ids, self.chunk_tokens, self.runner.fingerprint)

    def _pool_blocks(self, token_ids: Sequence[int]) -> list[int | None]:
        """The pool block holding each full block of ``token_ids`` (None where not cached).

        Each block is looked up by its own chained hash, not only along the matched prefix:
        when another session's offload dropped a shared system prompt from the pool, this
        session's later blocks are still found (and the prompt's chunks are in the tiers)."""
        bs = self._pool.block_size
        hashes = chain_hashes(token_ids, bs, self.runner.fingerprint)
        lookup = self._pool.block_pool.lookup
        return [lookup(h) for h in hashes]

    def storable_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens up to the last full block of ``token_ids`` whose KV is in the pool now."""
        blocks = self._pool_blocks(token_ids)
        present = [i for i, b in enumerate(blocks) if b is not None]
        return (present[-1] + 1) * self._pool.block_size if present else 0

    # -------------------------------------------------------------------- save
    def snapshot(
        self, token_ids: Sequence[int], reserve: Callable[[int], None] | None = None
    ) -> Snapshot:
        """Copy the KV of every chunk not stored yet out of the pool (engine thread).

        The copy is what makes storing asynchronous safe: once taken, the pool's blocks may
        be reused. ``reserve(nbytes)`` is called before any copy is made (the transfer
        engine's cap on bytes in flight). On CUDA the gather runs on a side stream into
        pinned host memory and ``ready`` is its completion event."""
        pool = self._pool
        bs = pool.block_size
        blocks = self._pool_blocks(token_ids)
        n = self.storable_tokens(token_ids)
        keys = self._keys(list(token_ids[:n]))
        snap = Snapshot(keys=keys)
        if not keys:
            return snap
        have = self.manager.lookup([k.key for k in keys])
        todo: list[tuple[ChunkKey, list[int]]] = []
        for i, ck in enumerate(keys):
            if i < have.length:
                snap.already += 1
                snap.end = ck.end
                continue
            ids = blocks[ck.start // bs : ck.end // bs]
            if any(b is None for b in ids):
                break  # a hole: neither stored nor in the pool
            todo.append((ck, ids))  # type: ignore[arg-type]
            snap.end = ck.end
        per_token = pool.storage.bytes_per_token
        snap.nbytes = sum(ck.num_tokens for ck, _ in todo) * per_token
        if not todo:
            return snap
        if reserve is not None:
            reserve(snap.nbytes)
        kv = pool.storage.kv
        if kv.is_cuda:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(kv.device))
            with torch.cuda.stream(stream):
                for ck, ids in todo:
                    dev = gather_blocks(kv, ids, num_tokens=ck.num_tokens)
                    host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
                    host.copy_(dev, non_blocking=True)
                    dev.record_stream(stream)
                    snap.tensors[ck.key] = host
                snap.ready = torch.cuda.Event()
                snap.ready.record(stream)
        else:
            for ck, ids in todo:
                snap.tensors[ck.key] = gather_blocks(kv, ids, num_tokens=ck.num_tokens)
        return snap

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self._pool.storage.kv.device)
        return self._stream

    def store(self, snap: Snapshot, tier: int | str = 0, owner: Hashable | None = None) -> SaveReport:
        """Encode a snapshot's chunks and put them in ``tier`` (any thread); ``owner`` (a
        session id) lets the tiers' eviction policy treat them as that session's chain."""
        report = SaveReport(tokens=0, keys=[k.key for k in snap.keys], already=snap.already)
        if owner is not None and snap.already:  # a shared prefix, not written again
            self.manager.share([k.key for k in snap.keys[: snap.already]], owner)
        if snap.ready is not None:
            snap.ready.synchronize()
        fp = self.runner.fingerprint
        blobs = {key: encode_chunk(key, fp, t) for key, t in snap.tensors.items()}
        if blobs:
            info = {
                ck.key: ChunkInfo(len(blobs[ck.key]), session=owner, index=i)
                for i, ck in enumerate(snap.keys) if ck.key in blobs
            }
            res = self.manager.put(blobs, tier, info)
            report.failed = dict(res.failed)
            report.stored = len(blobs) - len(res.failed)
            report.bytes = sum(len(b) for k, b in blobs.items() if k not in res.failed)
        # The stored prefix ends at the first chunk no tier took.
        for ck in snap.keys:
            if ck.key in report.failed or ck.end > snap.end:
                break
            report.tokens = ck.end
        return report

    def save(
        self, token_ids: Sequence[int], tier: int | str = 0, owner: Hashable | None = None
    ) -> SaveReport:
        """Store the KV of ``token_ids`` up to its last block held in the pool (whole
        blocks; the last chunk is a tail keyed by its length). Chunks already in a tier are
        not written again; a chunk that is neither stored nor fully in the pool ends the
        stored prefix."""
        return self.store(self.snapshot(token_ids), tier, owner)

    # -------------------------------------------------------------------- load
    def _restorable(
        self, token_ids: Sequence[int], stored_tokens: int | None
    ) -> tuple[list[int], int, list[ChunkKey]]:
        """The whole-block prefix a restore may bring back, the tokens of it still cached
        in the pool, and its chunk keys."""
        pool = self._pool
        limit = len(token_ids) if stored_tokens is None else min(stored_tokens, len(token_ids))
        limit -= limit % pool.block_size
        prefix = list(token_ids[:limit])
        cached = len(pool.manager.match_prefix(prefix, self.runner.fingerprint)) * pool.block_size
        return prefix, cached, self._keys(prefix)

    def stored_prefix(
        self, token_ids: Sequence[int], stored_tokens: int | None = None
    ) -> StoredPrefix:
        """What a restore of ``token_ids[:stored_tokens]`` would find: the tokens still
        cached in the pool, and the stored chunks after them (new tokens each brings, name
        of the fastest tier holding it), in order, up to the first gap."""
        prefix, cached, keys = self._restorable(token_ids, stored_tokens)
        found = StoredPrefix(cached, [], prefix, keys)
        first = next((i for i, k in enumerate(keys) if k.end > cached), len(keys))
        if first == len(keys):
            return found
        found.loc = loc = self.manager.lookup([k.key for k in keys])
        end = cached
        for i in range(first, loc.length):
            if keys[i].start > end:
                break
            found.chunks.append((keys[i].end - end, self.manager.tiers[loc.tiers[i]].name))
            end = keys[i].end
        return found

    def _seen(self, found: StoredPrefix, stored_tokens: int | None) -> tuple | None:
        """``found`` cut to ``stored_tokens`` (prefix, cached, keys, location) when the cut
        falls on a chunk boundary it knows; else None (look again)."""
        if found.loc is None:
            return None
        limit = len(found.prefix) if stored_tokens is None else min(stored_tokens, len(found.prefix))
        keys = [k for k in found.keys if k.end <= limit]
        if limit != (keys[-1].end if keys else 0):
            return None
        n = min(found.loc.length, len(keys))
        return found.prefix[:limit], min(found.cached, limit), keys, Location(n, found.loc.tiers[:n])

    def keys_below_fastest(self, token_ids: Sequence[int]) -> list[str]:
        """Keys of the stored prefix of ``token_ids`` that only slower tiers hold."""
        keys = [k.key for k in self._keys(list(token_ids))]
        loc = self.manager.lookup(keys)
        return [keys[i] for i in range(loc.length) if loc.tiers[i] > 0]

    def load(
        self,
        token_ids: Sequence[int],
        stored_tokens: int | None = None,
        stream: bool | None = None,
        found: StoredPrefix | None = None,
    ) -> LoadReport:
        """Bring the longest stored prefix of ``token_ids[:stored_tokens]`` into the pool.

        Blocks still cached in the pool are kept; the rest are read from the tiers (verified)
        and scattered into newly allocated blocks, which are published in the prefix cache.
        Layer 0 of every chunk is read first: a chunk missing or broken as a whole ends the
        restore there. The other layers follow, one at a time; with ``stream`` (default: the
        ``stream`` given at construction; None decides by device and size) on a loader thread while the caller goes on — the
        model waits per layer (see :mod:`kvtier.transfer.layer_load`) — otherwise before returning,
        and then a chunk that fails in a later layer ends the restore at that chunk.

        ``found``: what :meth:`stored_prefix` returned for the same tokens just before
        (nothing ran in between), so the tiers are not asked again."""
        if stream is None:
            stream = self.stream
        self._reap_if_idle()
        pool, fp = self._pool, self.runner.fingerprint
        seen = self._seen(found, stored_tokens) if found is not None else None
        if seen is not None:
            prefix, cached, keys, loc = seen
        else:
            prefix, cached, keys = self._restorable(token_ids, stored_tokens)
        report = LoadReport(tokens=cached, from_pool=cached)
        if not any(k.end > cached for k in keys):
            return report
        if seen is None:
            loc = self.manager.lookup([k.key for k in keys])
        first = next((i for i, k in enumerate(keys) if k.end > cached), len(keys))
        usable = keys[first : loc.length]
        if not usable or usable[0].start > cached:
            return report  # the chunk right after the cached blocks is not stored anywhere
        where = Location(len(usable), loc.tiers[first : loc.length])
        layer0 = self._read_layer(usable, where, 0)
        chunks: list[ChunkKey] = []
        end = usable[0].start  # <= cached: the first chunk may overlap blocks still pooled
        for ck, part in zip(usable, layer0, strict=True):
            if part is None or ck.start != end:
                break
            chunks.append(ck)
            end = ck.end
        if end <= cached:
            return report
        # The restored prefix is held by one temporary sequence while it loads: cached blocks
        # are shared, new blocks receive the chunks; it is freed once the load is over.
        sid = f"__restore_{next(self._tmp_ids)}"
        try:
            added = pool.add_sequence(sid, prefix[:end], fp)
        except OutOfBlocksError:
            log.info("restore of %d tokens does not fit in the pool now", end)
            return report
        blocks = pool.sequence(sid).block_ids
        bs = pool.block_size
        spans: list[tuple[int, list[int]]] = []
        for ck in chunks:
            lo = max(ck.start, added.num_cached_tokens)
            spans.append((lo - ck.start, blocks[lo // bs : ck.end // bs] if lo < ck.end else []))
        load = LayerLoad(pool.storage.num_layers, [ids for _, ids in spans])
        load.release = lambda ld: pool.free_sequence(sid)
        try:
            self._scatter_layer(0, [p for p in layer0[: len(chunks)] if p is not None], spans)
        except BaseException:
            pool.free_sequence(sid)
            raise
        load.layer_loaded(0)
        load.bytes = sum(p.numel() * p.element_size() for p in layer0[: len(chunks)] if p is not None)
        pool.mark_computed(sid, end)
        where = Location(len(chunks), where.tiers[: len(chunks)])
        if stream is None:
            stream = pool.storage.kv.is_cuda or end - cached >= self.stream_min_tokens
        if stream and load.num_layers > 1:
            start = None
            if pool.storage.kv.is_cuda:
                start = torch.cuda.Event()
                start.record()  # blocks just freed may still be read by queued kernels
            self.runner.add_layer_load(load)
            self._loader().submit(self._load_layers, load, chunks, spans, where, start)
            report.pending = load
            loaded = chunks
        else:
            self._load_rest(load, chunks, spans, where)
            for b in load.take_poisoned_blocks():
                pool.block_pool.uncache_block(b)
            pool.free_sequence(sid)
            loaded = chunks[: load.loaded_chunks]
            end = loaded[-1].end if loaded else cached
        report.tokens = max(end, cached)
        report.from_tiers = report.tokens - cached
        report.bytes = load.bytes
        for ti in where.tiers[: len(loaded)]:
            name = self.manager.tiers[ti].name
            report.tier_hits[name] = report.tier_hits.get(name, 0) + 1
        return report

    def _read_layer(
        self, chunks: Sequence[ChunkKey], where: Location, layer: int, last: int | None = None
    ) -> list[torch.Tensor | None]:
        """Layers ``layer`` to ``last`` (default: ``layer`` alone) of each chunk, verified
        (None where they could not be read)."""
        stop = layer + 1 if last is None else last + 1
        blobs = self.manager.get([ck.key for ck in chunks], (layer, stop), where)
        out: list[torch.Tensor | None] = []
        fp = self.runner.fingerprint
        for ck, blob in zip(chunks, blobs, strict=True):
            part = None
            if blob is not None:
                try:
                    header, part = decode_chunk(blob, ck.key, fp)
                except ChunkError as exc:  # the manager verified it; a race with a rewrite
                    log.warning("chunk %s layers %d-%d: %s", ck.key, layer, stop - 1, exc)
                else:
                    if header.first_layer != layer or header.num_layers != stop - layer:
                        part = None
            out.append(part)
        return out

    def _load_rest(
        self,
        load: LayerLoad,
        chunks: Sequence[ChunkKey],
        spans: Sequence[tuple[int, list[int]]],
        where: Location,
    ) -> None:
        """Layers 1.. of the chunks in one read per chunk and one scatter (a restore that
        does not stream: per-layer reads would pay the tier's and the decoder's per-call
        costs once per layer, several times the copy itself on a CPU). A chunk that cannot
        be read ends the restore there."""
        last = load.num_layers - 1
        with self._finishing(load, "restore"):
            if last >= 1:
                parts = self._read_layer(chunks, where, 1, last)
                n = next((i for i, p in enumerate(parts) if p is None), len(parts))
                if n < len(parts):
                    load.poison(n, f"chunk {chunks[n].key}: layers 1-{last} could not be read")
                good = [p for p in parts[:n] if p is not None]
                load.bytes += sum(p.numel() * p.element_size() for p in good)
                self._scatter_layer(1, good, spans[:n], last)
            for layer in range(1, load.num_layers):
                load.layer_loaded(layer)

    @contextlib.contextmanager
    def _finishing(self, load: LayerLoad, what: str) -> Iterator[None]:
        """Run a restore's loading: an error poisons it (a lost restore is recomputed,
        never fatal), and the load is finished whatever happens."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001
            log.warning("%s failed: %s", what, exc)
            load.poison(0, f"{type(exc).__name__}: {exc}")
        finally:
            if load.error is not None:
                self.lost_restores += 1
            load.finish()

    def _scatter_layer(
        self,
        layer: int,
        parts: Sequence[torch.Tensor],
        spans: Sequence[tuple[int, list[int]]],
        last: int | None = None,
    ) -> None:
        kv = self._pool.storage.kv
        dst = kv[layer : (layer if last is None else last) + 1]
        for part, (off, ids) in zip(parts, spans, strict=False):
            if ids:
                src = part[:, :, off:].to(device=kv.device, dtype=kv.dtype, non_blocking=True)
                scatter_blocks(src.contiguous(), dst, ids)

    def _load_layers(
        self,
        load: LayerLoad,
        chunks: Sequence[ChunkKey],
        spans: Sequence[tuple[int, list[int]]],
        where: Location,
        start: torch.cuda.Event | None,
    ) -> None:
        """Read and scatter layers 1.. of the chunks (the loader thread, or inline). A chunk
        that fails poisons itself and every later chunk; the earlier ones go on loading."""
        cuda = start is not None
        with self._finishing(load, "streamed restore"):
            side = self._side_stream() if cuda else None
            if side is not None and start is not None:
                side.wait_event(start)
            for layer in range(1, load.num_layers):
                n = load.active_chunks()
                if n == 0:
                    break
                parts = self._read_layer(chunks[:n], Location(n, where.tiers[:n]), layer)
                for i, part in enumerate(parts):
                    if part is None:
                        load.poison(i, f"chunk {chunks[i].key}: layer {layer} could not be read")
                        break
                n = load.active_chunks()
                good = [p for p in parts[:n] if p is not None]
                load.bytes += sum(p.numel() * p.element_size() for p in good)
                event = None
                if side is not None:
                    with torch.cuda.stream(side):
                        self._scatter_layer(layer, good, spans[:n])
                        event = torch.cuda.Event()
                        event.record(side)
                else:
                    self._scatter_layer(layer, good, spans[:n])
                load.layer_loaded(layer, event)

    def _loader(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvtier-restore")
        return self._executor

    def _reap_if_idle(self) -> None:
        """Free finished, healthy restores' temporary holders (engine thread)."""
        if self.runner.layer_loads:
            self.runner.reap_layer_loads()

    def close(self) -> None:
        """Wait for restores in flight and stop the loader thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------- evict
    def pool_blocks(self, token_ids: Sequence[int]) -> set[int]:
        """Pool blocks currently holding any full block of ``token_ids``."""
        return {b for b in self._pool_blocks(token_ids) if b is not None}

    def evict(self, token_ids: Sequence[int], keep: set[int] | frozenset[int] = frozenset()) -> int:
        """Drop the blocks of ``token_ids`` from the pool's cache where no sequence uses them
        and they are not in ``keep`` (blocks other resident sessions share: a chunk is
        coarser than a block, so a shared block may not be in any stored chunk of theirs);
        returns how many were freed."""
        bp = self._pool.block_pool
        freed = 0
        for b in self._pool_blocks(token_ids):
            if b is not None and b not in keep and bp.ref_count(b) == 0:
                bp.uncache_block(b)
                freed += 1
        return freed
