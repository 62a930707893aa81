"""Restores: bringing a stored prefix's KV from the lower tiers back into the paged pool.

``load`` reads the stored chunks back, verified, scatters them into fresh pool blocks and
publishes them in the prefix cache, so the next request over that prefix finds them as
ordinary prefix hits and computes only the rest. Layer 0 comes in first; the other layers
follow either at once or streamed on a loader thread while the model already runs (see
:mod:`kvtier.transfer.layer_load`). ``stored_prefix`` says beforehand what a restore would
find, for the restore-or-recompute plan.

A :class:`Restorer` is owned by :class:`~kvtier.transfer.kv_transfer.KVTransfer` (the save
and evict side), which hands it what both share: the pool's owner, the tier stack, how a
prefix's chunk keys are made and the side stream CUDA copies run on.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvtier.chunk_keys import ChunkKey
from kvtier.connectors.tiers.chunk_workers import map_restore
from kvtier.connectors.tiers.lent_chunk import LentChunk
from kvtier.connectors.tiers.manager import Location, TierManager
from kvtier.errors import ChunkFormatError, OutOfBlocksError
from kvtier.gpu_pool import PagedKVPool
from kvtier.gpu_pool.kernels import host_native, scatter_blocks, scatter_blocks_host
from kvtier.gpu_pool.kernels.host_native import scatter_blocks_verified
from kvtier.thread_start import thread_started
from kvtier.transfer.device_restore import copy_then_check
from kvtier.transfer.layer_load import LayerLoad
from kvtier.transfer.lossy_restore import (
    LOSSY_GROUP_BYTES,
    decode_scratch,
    fused_decode,
    scatter_lossy,
)
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


def _fused(part: LentChunk, kv: torch.Tensor) -> bool:
    """Whether a lent chunk is checked and scattered by the fused native kernel (one still
    to check, a host pool of its dtype, a contiguous chunk), else checked, then copied
    with numpy."""
    return (host_native.AVAILABLE and not kv.is_cuda and not part.header.lossy
            and part.kv.device.type == "cpu"
            and part.kv.dtype == kv.dtype and part.kv.is_contiguous())


RESTORE_GROUP_BYTES = 4 << 20
"""A host restore checks and scatters a chunk's layers this many bytes at a time (a group
is still in cache when it is copied)."""

CPU_STREAM_MIN_TOKENS = 2048
"""On a CPU, restores stream layer by layer only from this many tokens (docs/tiers.md)."""

CUDA_STREAM_MIN_TOKENS = 1 << 62
"""On CUDA, restores do not stream (no size reaches this): a blocking restore measured
faster in every case on an H200 (docs/gpu.md)."""


def _layer0_checked(parts: Sequence[LentChunk | None]) -> list[LentChunk | None]:
    """Layer 0 of each lent chunk checked (two at a time): one that fails is a miss
    here, and the restore ends before it, as if it had failed up front."""

    def check(part: LentChunk | None) -> LentChunk | None:
        if part is None:
            return None
        try:
            part.check(0, 1)
            if part.header.lossy:
                part.layer_kv(0, 1)  # bytes no encoder writes fail here, not mid-restore
        except ChunkFormatError:
            return None
        return part

    return map_restore(check, parts)


class Restorer:
    """Restores of one pool from one tier stack. ``keys`` makes a prefix's chunk keys as
    the save side stores them; ``side_stream`` is the CUDA stream copies run on."""

    def __init__(
        self,
        runner: PoolOwner,
        manager: TierManager,
        keys: ChunkKeys,
        side_stream: Callable[[], torch.cuda.Stream],
        stream: bool | None = False,
    ) -> None:
        self.runner = runner
        self.manager = manager
        self.plan = RestorePlanner(runner, manager, keys)
        self._side_stream = side_stream
        self.stream = stream
        """Whether restores stream layer by layer; None: never on CUDA (slower than a
        blocking restore in every case measured on an H200, docs/gpu.md), on CPU from
        ``stream_min_tokens`` restored tokens (below that, on a few shared cores, the
        loader thread's competition with the forward costs more than the overlap saves:
        see docs/tiers.md)."""
        self.stream_min_tokens = CPU_STREAM_MIN_TOKENS
        self.copy_then_check: bool | None = None
        """Whether a restore that does not stream copies each chunk into the pool while the
        restore workers check it (:func:`~kvtier.transfer.device_restore.copy_then_check`)
        rather than checking each group
        of layers right before copying it; None: for a pool on a GPU."""
        self.lost_restores = 0
        """Restores that lost chunks after they were published (recomputed instead)."""
        self._tmp_ids = itertools.count()
        self._executor: ThreadPoolExecutor | None = None

    @property
    def _pool(self) -> PagedKVPool:
        return self.runner.pool

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

        Blocks still cached in the pool are kept; the rest are read from the tiers (verified)
        and scattered into newly allocated blocks, which are published in the prefix cache.
        Layer 0 of every chunk is read first: a chunk missing or broken as a whole ends the
        restore there. The other layers follow, one at a time; with ``stream`` (default: the
        ``stream`` given at construction; None decides by device and size) on a loader thread while the caller goes on — the
        model waits per layer (see :mod:`kvtier.transfer.layer_load`) — otherwise before returning,
        and then a chunk that fails in a later layer ends the restore at that chunk.

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
        # Not streaming: every layer in one read per chunk (one lease, one file read, one
        # round trip). On the host each chunk is checked a group of layers at a time, right
        # before the group is scattered (its bytes are read from memory once, not twice); to
        # a GPU each chunk is copied at once while the host checks it (device_restore).
        last = None if stream and num_layers > 1 else num_layers - 1
        deferred = last is not None
        with self._reading(usable, where, 0, last, deferred) as lent:
            chunks, begun = self._first_layers(prefix, cached, usable, lent, last, deferred)
        if begun is None:
            return report
        return self._finish_load(report, begun, chunks, where, last, cached)

    def _first_layers(
        self, prefix: list[int], cached: int, usable: list[ChunkKey], lent: list,
        last: int | None, deferred: bool,
    ) -> tuple[list[ChunkKey], tuple[str, LayerLoad, list[tuple[int, list[int]]]] | None]:
        """The leading chunks read whole (up to the first one missing), held in the pool
        with layer 0 scattered (every layer, where ``last`` says the read holds them all);
        no load when they bring nothing new or do not fit."""
        kv = self._pool.storage.kv
        # With the fused kernel, or to a GPU, layer 0 is checked and scattered with the
        # others (a chunk that fails it is poisoned like one failing a later layer); else
        # it is checked first, and a chunk that fails it ends the restore before it.
        fused = deferred and (self._copies_first()
                              or all(_fused(p, kv) for p in lent if p is not None))
        parts = _layer0_checked(lent) if deferred and not fused else lent
        chunks: list[ChunkKey] = []
        end = usable[0].start  # <= cached: the first chunk may overlap blocks still pooled
        for ck, part in zip(usable, parts, strict=True):
            if part is None or ck.start != end:
                break
            chunks.append(ck)
            end = ck.end
        if end <= cached:
            return chunks, None
        layer0 = None if fused else [
            p.layer_kv(0, 1) if isinstance(p, LentChunk) else (p if last is None else p[:1])
            for p in parts[: len(chunks)] if p is not None]
        begun = self._begin_load(prefix, end, chunks, layer0)
        if begun is not None and last is not None:
            _, load, spans = begun
            if deferred:
                self._load_rest_checked(load, spans, parts[: len(chunks)], 0 if fused else 1)
            else:
                self._load_rest(load, spans, [p[1:] for p in parts[: len(chunks)] if p is not None])
        return chunks, begun

    def _finish_load(
        self, report: LoadReport, begun: tuple[str, LayerLoad, list[tuple[int, list[int]]]],
        chunks: list[ChunkKey], where: Location, last: int | None, cached: int,
    ) -> LoadReport:
        """Stream the other layers (``last`` None) or settle a load done now; the report."""
        pool = self._pool
        sid, load, spans = begun
        where = Location(len(chunks), where.tiers[: len(chunks)])
        if last is None:
            self._stream_rest(load, chunks, spans, where)
            report.pending = load
            loaded = chunks
            end = chunks[-1].end
        else:
            for b in load.take_poisoned_blocks():
                pool.block_pool.uncache_block(b)
            pool.free_sequence(sid)
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

    def _begin_load(
        self,
        prefix: list[int],
        end: int,
        chunks: Sequence[ChunkKey],
        layer0: Sequence[torch.Tensor | None] | None,
    ) -> tuple[str, LayerLoad, list[tuple[int, list[int]]]] | None:
        """Hold ``prefix[:end]`` in the pool, scatter layer 0 of ``chunks`` into its new
        blocks and mark it computed. Returns the holding sequence, the load (layers 1.. to
        go; every layer where ``layer0`` is None: the caller loads layer 0 with the rest)
        and each chunk's span; None when the prefix does not fit in the pool now."""
        pool, fp = self._pool, self.runner.fingerprint
        # The restored prefix is held by one temporary sequence while it loads: cached blocks
        # are shared, new blocks receive the chunks; it is freed once the load is over.
        sid = f"__restore_{next(self._tmp_ids)}"
        try:
            added = pool.add_sequence(sid, prefix[:end], fp)
        except OutOfBlocksError:
            log.info("restore of %d tokens does not fit in the pool now", end)
            return None
        blocks = pool.sequence(sid).block_ids
        bs = pool.block_size
        spans: list[tuple[int, list[int]]] = []
        for ck in chunks:
            lo = max(ck.start, added.num_cached_tokens)
            spans.append((lo - ck.start, blocks[lo // bs : ck.end // bs] if lo < ck.end else []))
        load = LayerLoad(pool.storage.num_layers, [ids for _, ids in spans])
        load.release = lambda ld: pool.free_sequence(sid)
        if layer0 is None:
            pool.mark_computed(sid, end)
            return sid, load, spans
        try:
            self._scatter_layer(0, [p for p in layer0[: len(chunks)] if p is not None], spans)
        except BaseException:
            pool.free_sequence(sid)
            raise
        load.layer_loaded(0)
        load.bytes = sum(p.numel() * p.element_size() for p in layer0[: len(chunks)] if p is not None)
        pool.mark_computed(sid, end)
        return sid, load, spans

    def _stream_rest(
        self,
        load: LayerLoad,
        chunks: Sequence[ChunkKey],
        spans: Sequence[tuple[int, list[int]]],
        where: Location,
    ) -> None:
        """Hand layers 1.. to the loader thread; the model waits on ``load`` per layer."""
        start = None
        if self._pool.storage.kv.is_cuda:
            start = torch.cuda.Event()
            start.record()  # blocks just freed may still be read by queued kernels
        self.runner.add_layer_load(load)
        self._loader().submit(self._load_layers, load, chunks, spans, where, start)

    @contextlib.contextmanager
    def _reading(
        self, chunks: Sequence[ChunkKey], where: Location, layer: int, last: int | None = None,
        deferred: bool = False,
    ) -> Iterator[list]:
        """Layers ``layer`` to ``last`` (default: ``layer`` alone) of each chunk, verified
        (None where they could not be read): views into the CPU arena under its lease where
        the chunk lies there, so they must be scattered before the block ends (on CUDA the
        copies are waited for before the slots are let go). ``deferred`` (every layer):
        :class:`LentChunk` s whose layers are checked by the reader, group by group."""
        stop = layer + 1 if last is None else last + 1
        span = None if (layer, stop) == (0, self._pool.storage.num_layers) else (layer, stop)
        kv = self._pool.storage.kv
        keys = [ck.key for ck in chunks]
        lease = (self.manager.lease_chunks(keys, where) if deferred
                 else self.manager.lease(keys, span, where))
        with lease as parts:
            for i, (ck, part) in enumerate(zip(chunks, parts, strict=True)):
                want = (stop - layer, 2, ck.num_tokens, kv.shape[4], kv.shape[5])
                got = part.header.shape if isinstance(part, LentChunk) else (
                    None if part is None else part.shape)
                if got is not None and tuple(got) != want:
                    log.warning("chunk %s holds KV of shape %s, not %s: not restored",
                                ck.key, tuple(got), want)
                    parts[i] = None  # a chunk another writer shaped otherwise: a miss
            yield parts
            if self._pool.storage.kv.is_cuda:
                torch.cuda.current_stream().synchronize()

    def _load_rest(
        self,
        load: LayerLoad,
        spans: Sequence[tuple[int, list[int]]],
        parts: Sequence[torch.Tensor | None],
    ) -> None:
        """Scatter layers 1.. of the chunks from the views read with layer 0 (a restore
        that does not stream: per-layer reads would pay the tier's per-call costs once per
        layer, several times the copy itself on a CPU)."""
        last = load.num_layers - 1
        with self._finishing(load, "restore"):
            if last >= 1:
                good = [p for p in parts if p is not None]
                load.bytes += sum(p.numel() * p.element_size() for p in good)
                self._scatter_layer(1, good, spans[: len(good)], last)
            for layer in range(1, load.num_layers):
                load.layer_loaded(layer)

    def _load_rest_checked(
        self,
        load: LayerLoad,
        spans: Sequence[tuple[int, list[int]]],
        parts: Sequence[LentChunk | None],
        first: int = 1,
    ) -> None:
        """Layers ``first``.. of lent chunks, each group of about ``RESTORE_GROUP_BYTES`` checked
        and then scattered at once, two chunks at a time on the host. A chunk that fails a
        check poisons itself and every later chunk (their blocks are uncached, their tokens
        recomputed); the layers of the earlier ones all passed."""
        kv = self._pool.storage.kv
        n = load.num_layers
        good = [p for p in parts if p is not None]

        def one(item: tuple[int, LentChunk, tuple[int, list[int]]]) -> tuple[int, str] | None:
            i, part, (off, ids) = item
            try:
                if _fused(part, kv):  # each group checked and scattered in one pass
                    # a chunk in memory goes in one call; one still being read, group by
                    # group as its layers land
                    group = RESTORE_GROUP_BYTES if part.reading is not None else 1 << 62
                    for a, b, sums in part.read_groups(group, start=first, end=n):
                        src = part.kv[a:b]
                        at = off if ids else src.shape[2]
                        bad = scatter_blocks_verified(src, sums, at, kv[a:b], ids)
                        if bad >= 0:
                            part.fail(a + bad)
                elif part.header.lossy and fused_decode(part, kv):
                    if ids:
                        scatter_lossy(part, first, n, off, kv, ids)
                elif part.header.lossy:  # each group checked, decoded into a reused scratch
                    if ids:
                        for a, b in part.checked_groups(LOSSY_GROUP_BYTES, start=first, end=n):
                            src = part.layer_kv(a, b, decode_scratch(part, b - a))[:, :, off:]
                            scatter_blocks_host(src, kv[a:b], ids, src.shape[2])
                else:
                    for a, b in part.checked_groups(RESTORE_GROUP_BYTES, start=first, end=n):
                        if ids:
                            src = part.kv[a:b, :, off:]
                            scatter_blocks_host(src, kv[a:b], ids, src.shape[2])
            except ChunkFormatError as exc:
                return i, str(exc)
            return None

        failed: list[tuple[int, str]] = []
        with self._finishing(load, "restore"):
            if n > first:
                load.bytes += sum(p.kv_nbytes(first) for p in good)
                if self._copies_first():  # to a GPU: copied while the workers check
                    failed = copy_then_check(kv, self._side_stream, good, spans, first)
                else:
                    items = list(zip(range(len(good)), good, spans, strict=False))
                    failed = [f for f in map_restore(one, items) if f is not None]
            for layer in range(first, n):
                load.layer_loaded(layer)
        if failed:  # ends the restore at that chunk, as a failed read would have: not a loss
            load.poison(*min(failed))

    def _copies_first(self) -> bool:
        choice = self.copy_then_check
        return self._pool.storage.kv.is_cuda if choice is None else choice

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
        todo = [(part[:, :, off:], ids) for part, (off, ids) in zip(parts, spans, strict=False) if ids]
        if not kv.is_cuda and all(src.dtype == kv.dtype for src, _ in todo):
            # Host to host: chunks two at a time, each copy on its worker's own thread.
            map_restore(lambda item: scatter_blocks_host(item[0], dst, item[1], item[0].shape[2]), todo)
            return
        for part, ids in todo:
            src = part.to(device=kv.device, dtype=kv.dtype, non_blocking=True)
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
                with self._reading(chunks[:n], Location(n, where.tiers[:n]), layer) as parts:
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
                        event.synchronize()  # the copy is done before the slots are let go
                    else:
                        self._scatter_layer(layer, good, spans[:n])
                load.layer_loaded(layer, event)

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
