"""Restores: bringing a stored prefix's KV from the lower tiers back into the paged pool.

``load`` leases the stored chunks, scatters them into fresh pool blocks through the one
block path (:mod:`kvtier.transfer.block_path`: every layer checked against its stored
checksum, on the host or where the bytes land on a GPU) and publishes them in the prefix
cache, so the next request over that prefix finds them as ordinary prefix hits and
computes only the rest. Either every layer lands before ``load`` returns, or layer 0 does
and the others stream in on a loader thread while the model already runs (see
:mod:`kvtier.transfer.layer_load`). A chunk that fails (its check, its read, its decode) is
never served, nor is any chunk after it: their blocks are uncached and their tokens
recomputed. ``stored_prefix`` says beforehand what a restore would find, for the
restore-or-recompute plan.

A :class:`Restorer` is owned by :class:`~kvtier.transfer.kv_transfer.KVTransfer` (the save
and evict side), which hands it what both share: the pool's owner, the tier stack and how
a prefix's chunk keys are made. This module keeps the bookkeeping; the block path moves
the bytes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvtier.chunk_keys import ChunkKey
from kvtier.connectors.tiers.lent_chunk import LentChunk
from kvtier.connectors.tiers.manager import Location, TierManager
from kvtier.errors import OutOfBlocksError
from kvtier.gpu_pool import PagedKVPool
from kvtier.thread_start import thread_started
from kvtier.transfer.block_path import BlockSpan, CacheBlocks, scatter
from kvtier.transfer.layer_load import LayerLoad
from kvtier.transfer.pool_owner import PoolOwner
from kvtier.transfer.restore_plan import ChunkKeys, RestorePlanner, StoredPrefix

log = logging.getLogger(__name__)


@dataclass
class LoadReport:
    tokens: int
    """Leading tokens whose KV is now in the pool (cached blocks or restored from tiers)."""
    from_pool: int = 0
    from_tiers: int = 0
    tier_hits: dict[str, int] = field(default_factory=dict)
    """Chunks read per tier."""
    tier_tokens: dict[str, int] = field(default_factory=dict)
    """New tokens each tier brought (the pool's cached blocks excluded)."""
    bytes: int = 0
    pending: LayerLoad | None = None
    """A streamed restore still loading (the pool's forward passes wait on it per layer);
    then ``bytes`` counts only what was read before returning (``pending.bytes`` grows)."""


CPU_STREAM_MIN_TOKENS = 2048
"""On a CPU, restores stream layer by layer only from this many tokens (docs/tiers.md)."""

CUDA_STREAM_MIN_TOKENS = 1 << 62
"""On CUDA, restores do not stream (no size reaches this): a blocking restore measured
faster in every case on an H200 (docs/gpu.md)."""


@dataclass
class _Begun:
    """A restore holding its blocks: the temporary sequence, the load, each chunk's span."""

    sid: str
    load: LayerLoad
    spans: list[BlockSpan]


class Restorer:
    """Restores of one pool from one tier stack. ``keys`` makes a prefix's chunk keys as
    the save side stores them; ``side_stream`` is the CUDA stream copies run on."""

    def __init__(
        self,
        runner: PoolOwner,
        manager: TierManager,
        keys: ChunkKeys,
        stream: bool | None = False,
    ) -> None:
        self.runner = runner
        self.manager = manager
        self.plan = RestorePlanner(runner, manager, keys)
        self.stream = stream
        """Whether restores stream layer by layer; None: never on CUDA (slower than a
        blocking restore in every case measured on an H200, docs/gpu.md), on CPU from
        ``stream_min_tokens`` restored tokens (below that, on a few shared cores, the
        loader thread's competition with the forward costs more than the overlap saves:
        see docs/tiers.md)."""
        self.stream_min_tokens = CPU_STREAM_MIN_TOKENS
        self.device_copies: bool | None = None
        """Whether the pool's blocks move by device kernels (None: for a pool on a GPU;
        True on the host runs them under Triton's interpreter, for tests)."""
        self.lost_restores = 0
        """Restores that lost chunks after they were published (recomputed instead)."""
        self._tmp_ids = itertools.count()
        self._executor: ThreadPoolExecutor | None = None
        self._cache: CacheBlocks | None = None

    @property
    def _pool(self) -> PagedKVPool:
        return self.runner.pool

    @property
    def cache(self) -> CacheBlocks:
        """Where the pool keeps its blocks, for the block path."""
        kv = self._pool.storage.kv
        cache = self._cache
        if cache is None or cache.tensors[0] is not kv or cache.on_device != self._on_device():
            cache = self._cache = CacheBlocks.of_pool(kv, self._on_device())
        return cache

    def _on_device(self) -> bool:
        choice = self.device_copies
        return self._pool.storage.kv.is_cuda if choice is None else choice

    # --------------------------------------------------------- what a restore finds
    def load(
        self,
        token_ids: Sequence[int],
        stored_tokens: int | None = None,
        stream: bool | None = None,
        found: StoredPrefix | None = None,
        namespace: str | None = None,
    ) -> LoadReport:
        """Bring the longest stored prefix of ``token_ids[:stored_tokens]`` into the pool.

        Blocks still cached in the pool are kept; the rest are leased from the tiers and
        scattered (verified) into newly allocated blocks, which are published in the prefix
        cache. With ``stream`` (default: the ``stream`` given at construction; None decides
        by device and size) layer 0 lands before this returns and the other layers on a
        loader thread while the caller goes on — the model waits per layer (see
        :mod:`kvtier.transfer.layer_load`) — otherwise every layer lands before this
        returns. A chunk that fails ends the restore at that chunk.

        ``found``: what :meth:`stored_prefix` returned for the same tokens just before
        (nothing ran in between), so the tiers are not asked again. ``namespace``: the
        tenant whose chunks are restored (None: the engine's own)."""
        if stream is None:
            stream = self.stream
        self._reap_if_idle()
        plan = self.plan.usable_chunks(token_ids, stored_tokens, found, namespace)
        prefix, cached, usable, where = plan.prefix, plan.cached, plan.chunks, plan.where
        report = LoadReport(tokens=cached, from_pool=cached)
        if not usable:
            return report
        pool = self._pool
        num_layers = pool.storage.num_layers
        if stream is None:  # on a GPU never: slower in every case measured (docs/gpu.md)
            stream = (not pool.storage.kv.is_cuda
                      and usable[-1].end - cached >= self.stream_min_tokens)
        stream = bool(stream) and num_layers > 1
        lease = contextlib.ExitStack()
        try:
            lent = lease.enter_context(self._leased(usable, where))
            chunks = _leading(usable, lent)
            end = chunks[-1].end if chunks else cached
            begun = self._begin_load(prefix, end, chunks) if end > cached else None
            if begun is None:
                return report
            parts = [p for p in lent[: len(chunks)] if p is not None]
            if stream:
                self._scatter(begun.load, parts, begun.spans, 0, 1)
                self.runner.add_layer_load(begun.load)
                self._loader().submit(self._stream_rest, begun.load, parts, begun.spans,
                                      lease.pop_all())
            else:  # done before anything reads the blocks: a failure is no loss
                self._scatter(begun.load, parts, begun.spans, 0, num_layers)
                begun.load.finish()
        finally:
            lease.close()  # a no-op once the loader thread owns the lease
        return self._finish_load(report, begun, chunks, where, stream, cached)

    def _finish_load(self, report: LoadReport, begun: _Begun, chunks: list[ChunkKey],
                     where: Location, streamed: bool, cached: int) -> LoadReport:
        """The report of a load: one still streaming (pending), or one done now, whose
        poisoned blocks are uncached and whose holder is freed."""
        pool = self._pool
        load = begun.load
        where = Location(len(chunks), where.tiers[: len(chunks)])
        if streamed:
            report.pending = load
            loaded = chunks
            end = chunks[-1].end
        else:
            for b in load.take_poisoned_blocks():
                pool.block_pool.uncache_block(b)
            pool.free_sequence(begun.sid)
            loaded = chunks[: load.loaded_chunks]
            end = loaded[-1].end if loaded else cached
        report.tokens = max(end, cached)
        report.from_tiers = report.tokens - cached
        report.bytes = load.bytes
        for ti, ck in zip(where.tiers[: len(loaded)], loaded, strict=True):
            name = self.manager.tiers[ti].name
            report.tier_hits[name] = report.tier_hits.get(name, 0) + 1
            new = ck.end - max(ck.start, cached)
            report.tier_tokens[name] = report.tier_tokens.get(name, 0) + new
        return report

    def _begin_load(self, prefix: list[int], end: int, chunks: Sequence[ChunkKey]) -> _Begun | None:
        """Hold ``prefix[:end]`` in the pool (cached blocks shared, new blocks for the
        chunks) and mark it computed: the blocks are published now and filled by the load.
        None when the prefix does not fit in the pool now."""
        pool, fp = self._pool, self.runner.fingerprint
        # The restored prefix is held by one temporary sequence while it loads; it is freed
        # once the load is over.
        sid = f"__restore_{next(self._tmp_ids)}"
        try:
            added = pool.add_sequence(sid, prefix[:end], fp)
        except OutOfBlocksError:
            log.info("restore of %d tokens does not fit in the pool now", end)
            return None
        blocks = pool.sequence(sid).block_ids
        bs = pool.block_size
        spans, fills = [], []
        for ck in chunks:
            lo = max(ck.start, added.num_cached_tokens)
            ids = blocks[lo // bs : ck.end // bs] if lo < ck.end else []
            skip = (lo - ck.start) // bs
            spans.append(BlockSpan.of(list(ids) + [None] * (-(-ck.num_tokens // bs) - skip - len(ids)),
                                      skip))
            fills.append(list(ids))
        load = LayerLoad(pool.storage.num_layers, fills)
        load.release = lambda ld: pool.free_sequence(sid)
        pool.mark_computed(sid, end)
        return _Begun(sid, load, spans)

    def _scatter(self, load: LayerLoad, parts: Sequence[LentChunk], spans: Sequence[BlockSpan],
                 first: int, last: int) -> None:
        """Layers ``[first, last)`` of the chunks still active through the block path; the
        first chunk that fails poisons itself and every later one. An error poisons the
        whole restore (recomputed, never fatal). The layers are marked loaded."""
        n = load.active_chunks()
        try:
            if n:
                done = scatter(parts[:n], spans[:n], self.cache, first, last)
                load.bytes += done.bytes
                if done.reason is not None:
                    load.poison(done.served, done.reason)
        except Exception as exc:  # noqa: BLE001 - a lost restore is recomputed
            log.warning("restore failed: %s", exc)
            load.poison(0, f"{type(exc).__name__}: {exc}")
        for layer in range(first, last):
            load.layer_loaded(layer)

    def _stream_rest(self, load: LayerLoad, parts: Sequence[LentChunk],
                     spans: Sequence[BlockSpan], lease: contextlib.ExitStack) -> None:
        """Layers 1.. one at a time (the loader thread; the model waits per layer), then
        the lease let go. A chunk that fails poisons itself and every later chunk after
        they were published: a lost restore."""
        with lease:
            try:
                for layer in range(1, load.num_layers):
                    self._scatter(load, parts, spans, layer, layer + 1)
            finally:
                if load.error is not None:
                    self.lost_restores += 1
                load.finish()

    @contextlib.contextmanager
    def _leased(self, chunks: Sequence[ChunkKey], where: Location) -> Iterator[list[LentChunk | None]]:
        """The chunks as the tiers lend them (None where one could not be read or holds
        KV of another shape: a miss), valid until the block ends."""
        kv = self._pool.storage.kv
        with self.manager.lease_chunks([ck.key for ck in chunks], where) as parts:
            for i, (ck, part) in enumerate(zip(chunks, parts, strict=True)):
                want = (kv.shape[0], 2, ck.num_tokens, kv.shape[4], kv.shape[5])
                if part is not None and tuple(part.header.shape) != want:
                    log.warning("chunk %s holds KV of shape %s, not %s: not restored",
                                ck.key, tuple(part.header.shape), want)
                    parts[i] = None  # a chunk another writer shaped otherwise: a miss
            yield parts

    # ---------------------------------------------------------------- loader thread
    def _loader(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, "kvtier-restore", thread_started)
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


def _leading(usable: Sequence[ChunkKey], lent: Sequence[LentChunk | None]) -> list[ChunkKey]:
    """The leading chunks that were lent, each starting where the one before ends (the
    first may overlap blocks still pooled)."""
    chunks: list[ChunkKey] = []
    end = usable[0].start
    for ck, part in zip(usable, lent, strict=True):
        if part is None or ck.start != end:
            break
        chunks.append(ck)
        end = ck.end
    return chunks
