"""The worker side of kvtier's vLLM connector: vLLM's per-layer cache tensors to and from
the store, one copy and one checksum pass per block each way.

A chunk holds ``chunk_blocks`` of vLLM's blocks (:mod:`.vllm_blocks`) of every layer, laid
out layer-major as every kvtier chunk: per layer the K halves of its blocks, then their V
halves. A save gathers each layer's blocks straight into memory the store provides (a CPU
arena slot in-process; a staging buffer an upload goes out of) and checksums each group of
layers while it is still in cache (:func:`~kvtier.chunk_format.encode_into`), on a
background thread (:mod:`.vllm_saves`), off vLLM's forward path. A load scatters a lent
chunk (a view of the arena's slot, or of the buffer a file or a reply was read into)
straight into vLLM's cache, each group of layers checked right before it is copied; blocks
vLLM computed already are left alone. A chunk that is missing, corrupt, of another layout
or of another rank is reported as a load error and vLLM recomputes its blocks: never wrong
KV. vLLM's blocks are copied whole, never reinterpreted: the chunk's nominal shape only
carries the bytes, the fingerprint names the real layout and the rank. A tier that keeps
chunks compressed (``tiers.<tier>_codec``) encodes those values of the cache's dtype, K
apart from V, in groups of the nominal rows; such a chunk is decoded on load (where this
connector takes its codec, ``accept_codecs``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from kvtier.chunk_format import DTYPES, chunk_layout, encode_into
from kvtier.connectors.chunk_store import ChunkStore
from kvtier.connectors.save_refusals import SaveRefusals
from kvtier.connectors.store_breaker import StoreUnavailableError, fault_of
from kvtier.connectors.tiers.base import ChunkWrite
from kvtier.connectors.tiers.chunk_workers import map_restore
from kvtier.connectors.tiers.derived import TokenRange
from kvtier.connectors.tiers.lent_chunk import LentChunk
from kvtier.connectors.vllm_blocks import ChunkGrid, ChunkSpan, ChunkTransfer, Rank
from kvtier.connectors.vllm_device_blocks import BlockMove, DeviceBlocks
from kvtier.connectors.vllm_device_io import DeviceIO
from kvtier.connectors.vllm_loads import LoadQueue
from kvtier.connectors.vllm_pieces import BlockPieces, CacheLayer
from kvtier.connectors.vllm_policy import LoadObservation
from kvtier.connectors.vllm_saves import SaveQueue
from kvtier.errors import ChunkError, ChunkMismatchError, InvalidArgumentError
from kvtier.gpu_pool.kernels.host_native import (
    gather_pieces_hashed,
    scatter_chunks_verified,
    scatter_pieces_verified,
)
from kvtier.kv_codecs import Codec
from kvtier.policies.eviction import ChunkInfo
from kvtier.transfer.lossy_restore import LOSSY_GROUP_BYTES, decode_scratch

log = logging.getLogger(__name__)

GROUP_BYTES = 4 << 20
"""Layers are gathered and checksummed, or checked and scattered, this many bytes at a time."""


def rank_fingerprint(fingerprint: bytes, rank: Rank) -> bytes:
    """What a rank's chunks carry in their header: the model and layout, and the rank."""
    return fingerprint if rank.world == 1 else fingerprint + f"|rank{rank.index}of{rank.world}".encode()


@dataclass
class WorkerStats:
    loaded_blocks: int = 0
    saved_blocks: int = 0
    derived_blocks: int = 0
    """Blocks whose save was cut out of a stored segment holding them (not uploaded)."""
    load_errors: int = 0
    load_s: float = 0.0
    """Time loads held vLLM's forward path (synchronous loads, or submitting async ones)."""
    async_load_s: float = 0.0
    """Time async loads took on the loading thread, off the forward path."""
    save_wait_s: float = 0.0
    """Time saves held it (submitting, and draining before a preempted request's blocks
    are reused)."""
    step_s: float = 0.0
    """Time of vLLM's steps (from the step's plan bound to the worker to its end)."""
    steps: int = 0


@dataclass(frozen=True)
class _Item:
    """One chunk to scatter: its storage key, its blocks, and what the store lent."""

    key: str
    span: ChunkSpan
    chunk: LentChunk | None


class WorkerSide:
    """``store()`` opens the store when first needed. ``background``: saves run off the
    forward path (vLLM holds a finished request's blocks until :meth:`finished` names it),
    at idle priority with ``idle_saves``."""

    def __init__(self, store: Callable[[], ChunkStore], grid: ChunkGrid, rank: Rank = Rank(),
                 background: bool = False, idle_saves: bool = False,
                 async_loads: bool = False, accept_codecs: frozenset[str] | None = None,
                 saves_yield: bool | None = False, save_step_gap_s: float | None = None) -> None:
        self._store = store
        self.accept_codecs = accept_codecs
        """The codecs of stored KV this worker loads (None: whatever the store lends, which
        gives each reader only the codecs it takes); a lossy chunk is decoded on load."""
        self.grid = grid
        self.rank = rank
        self.fingerprint = rank_fingerprint(grid.fingerprint, rank)
        self.layers: list[CacheLayer] = []
        self._host = False
        self._pieces: BlockPieces | None = None
        self._device: DeviceIO | None = None
        self.stats = WorkerStats()
        self.saves = SaveQueue(background, idle_saves, yield_to_prefill=bool(saves_yield),
                               step_gap_s=save_step_gap_s)
        self._saves_yield = saves_yield
        """Saves yield to prefill steps; None: where vLLM's cache is on the host (its
        prefill and the saves share the cores), decided at :meth:`register`."""
        self.refusals = SaveRefusals()
        """Chunks the store refused to save, by why (counted, and logged now and then)."""
        self._load_errors: set[int] = set()
        self._observed: list[LoadObservation] = []
        self._lock = threading.Lock()
        """Guards what the loading thread and vLLM's both touch: observations, counters."""
        self.loads = (LoadQueue(self._load_async_one, _planned_blocks) if async_loads
                      else None)
        """Loads off the forward path (vLLM's async-load protocol, :mod:`.vllm_loads`)."""
        self._load_stream: torch.cuda.Stream | None = None

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """vLLM's cache tensors, one per layer, each with a block dimension of
        ``num_blocks`` among its first two."""
        layers = []
        for name, kv in kv_caches.items():
            dims = [d for d, n in enumerate(kv.shape[:2]) if n == num_blocks]
            if not dims:
                raise InvalidArgumentError(
                    f"kvtier connector: layer {name} has KV shape {tuple(kv.shape)}, with no "
                    f"block dimension of size {num_blocks} in its first two dims")
            layers.append(CacheLayer.of(name, kv, dims[0]))
        if len({(layer.kv.dtype, layer.block(0).numel()) for layer in layers}) > 1:
            raise InvalidArgumentError("kvtier connector: every layer's block must have one "
                                       "dtype and size (one chunk holds them all)")
        self.layers = layers
        self._host = all(layer.host is not None for layer in layers)
        """Every layer a host cache: copies in numpy (else index kernels, e.g. on a GPU)."""
        self._device = (None if self._host else
                        DeviceIO(DeviceBlocks.of(layers), layers[0].kv.dtype, len(layers)))
        if self._saves_yield is None:
            self.saves.yield_to_prefill = self._host and self.saves.background
        self._pieces = BlockPieces.of(layers, num_blocks)
        """Host caches whose blocks the fused native copy can take (copy and checksum in
        one pass); None: numpy or torch copies, checksums apart."""

    # ----------------------------------------------------------------- the layout
    def chunk_shape(self, blocks: int) -> tuple[int, int, int, int, int]:
        """``blocks`` blocks of every layer as a chunk: ``[layers, 2, tokens, 1, rest]``."""
        return _shape(len(self.layers), self.layers[0].block(0).numel(), self.grid.block_size, blocks)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].kv.dtype

    # ---------------------------------------------------------------------- saves
    def save(self, saves: list[ChunkTransfer]) -> None:
        """Store the chunks, each gathered straight into the store's memory: in the
        background where asked (after what vLLM has queued on the device so far)."""
        if not saves:
            return
        t0 = time.perf_counter()
        ready = None
        if any(layer.kv.is_cuda for layer in self.layers):
            ready = torch.cuda.Event()
            ready.record()
        self.saves.submit({s.req_id for s in saves}, lambda: self._save_now(saves, ready))
        self.stats.save_wait_s += time.perf_counter() - t0

    def _save_now(self, saves: list[ChunkTransfer], ready: torch.cuda.Event | None) -> None:
        """The spans written, then those a stored segment holds cut out of it inside the
        store (after the writes: a source may be among them), writing those it could not
        cut."""
        if ready is not None:
            ready.synchronize()
        items = [(span, s.session) for s in saves for span in s.chunks]
        self._put([item for item in items if item[0].source is None])
        self._put([item for item in items
                   if item[0].source is not None and not self._derived(*item)])

    def _put(self, items: list[tuple[ChunkSpan, str | None]]) -> None:
        if not items:
            return
        spans = [(ChunkGrid.rank_key(span.key, self.rank), len(span.block_ids))
                 for span, _ in items]
        writes = [self._write(span, session) for span, session in items]
        failed: dict[str, str] = {}
        tried: set[str] = set()  # keys whose put returned: stored, or named in failed
        try:
            if self.saves.yield_to_prefill:  # chunk by chunk, each once no prefill runs
                for write in writes:
                    self.saves.pause()
                    failed.update(self._store().put_from([write]))
                    tried.add(write.key)
            else:
                failed = self._store().put_from(writes)
                tried.update(w.key for w in writes)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss, counted
            lost = fault_of(exc) is not None or isinstance(exc, StoreUnavailableError)
            why = f"{'unavailable' if lost else 'error'}: {type(exc).__name__}: {exc}"
            failed.update({w.key: why for w in writes if w.key not in tried})
        self.refusals.refused(failed)
        self.stats.saved_blocks += sum(n for key, n in spans
                                       if key in tried and key not in failed)

    def _derived(self, span: ChunkSpan, session: str | None) -> bool:
        bs, n = self.grid.block_size, len(span.block_ids)
        info = ChunkInfo(0, session, span.first_block) if session else None
        assert span.source is not None
        self.saves.pause()
        try:
            done = self._store().derive(ChunkGrid.rank_key(span.key, self.rank),
                                        ChunkGrid.rank_key(span.source.key, self.rank),
                                        TokenRange(span.source.offset * bs, n * bs), info)
        except Exception as exc:  # noqa: BLE001 - the blocks are written instead
            log.info("kvtier: cutting chunk %s out of %s failed (%s); writing it",
                     span.key, span.source.key, exc)
            return False
        if done:
            self.stats.derived_blocks += n
        return done

    def _write(self, span: ChunkSpan, session: str | None = None) -> ChunkWrite:
        key = ChunkGrid.rank_key(span.key, self.rank)
        ids, fp, dtype = span.targets, self.fingerprint, self.dtype
        if len(ids) != len(span.block_ids):
            raise InvalidArgumentError(f"a save of chunk {key} must name every block")
        shape = self.chunk_shape(len(ids))
        _, total = chunk_layout(key, fp, dtype, shape)
        info = ChunkInfo(total, session, span.first_block) if session else None
        pieces = self._pieces
        if pieces is not None:  # copied and checksummed in one native pass
            addrs, layout = pieces.at_chunk(ids), pieces.layout(len(ids))
            return ChunkWrite(key, total, info=info, fill=lambda slot: encode_into(
                slot, key, fp, dtype, shape, lambda part: gather_pieces_hashed(part, addrs, layout)))
        device = self._device
        if device is not None:  # gathered on the device (encoded there for a lossy tier)
            codec = self._store().landing_codec() if device.on_cuda else Codec.NONE
            if device.encodes(codec):
                return ChunkWrite.of_blob(key, device.encoded(key, fp, ids, shape, codec), info)
            return ChunkWrite(key, total, info=info, fill=lambda slot: encode_into(
                slot, key, fp, dtype, shape, lambda part: device.fill(part, ids)))
        return ChunkWrite(key, total, info=info, fill=lambda slot: encode_into(
            slot, key, fp, dtype, shape, lambda part, a, b: _gather_host(self.layers, part, a, b, ids),
            GROUP_BYTES))

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests vLLM finished whose saves have all landed (their blocks may go)."""
        return self.saves.finished(finished_req_ids)

    def wait_saves(self) -> None:
        """Wait for every save submitted so far: before vLLM may write blocks a save reads
        (a preempted request's, given back at once), or before a load reads a chunk a
        save writes."""
        t0 = time.perf_counter()
        self.saves.drain()
        self.stats.save_wait_s += time.perf_counter() - t0

    # ---------------------------------------------------------------------- loads
    def load(self, loads: list[ChunkTransfer]) -> None:
        """Scatter each planned chunk from the store into the cache; the blocks of a chunk
        that cannot be loaded are load errors (recomputed)."""
        t0 = time.perf_counter()
        for load in loads:
            self._load_errors |= self._load_one(load)
        self.stats.load_s += time.perf_counter() - t0

    def load_async(self, loads: list[ChunkTransfer], after_saves: bool = False) -> None:
        """Hand ``loads`` to the loading thread (vLLM parks their requests until
        :meth:`finished_loading` names them); ``after_saves``: they read chunks the saves
        submitted so far write. On CUDA they wait for what vLLM queued on the device so
        far (blocks just freed may still be read) and run on their own stream."""
        if not loads:
            return
        assert self.loads is not None, "async loads were not enabled"
        t0 = time.perf_counter()
        ready = None
        if any(layer.kv.is_cuda for layer in self.layers):
            ready = torch.cuda.Event()
            ready.record()
        saves = self.saves

        def before() -> None:
            if after_saves:
                saves.drain()
            if ready is not None:
                ready.synchronize()

        self.loads.submit(loads, before)
        self.stats.load_s += time.perf_counter() - t0

    def _load_async_one(self, load: ChunkTransfer) -> set[int]:
        t0 = time.perf_counter()
        try:
            if not any(layer.kv.is_cuda for layer in self.layers):
                return self._load_one(load)
            if self._load_stream is None:
                self._load_stream = torch.cuda.Stream(self.layers[0].kv.device)
            with torch.cuda.stream(self._load_stream):
                missed = self._load_one(load)
            self._load_stream.synchronize()  # in the cache before vLLM hears it landed
            return missed
        finally:
            self.stats.async_load_s += time.perf_counter() - t0

    def finished_loading(self) -> set[str]:
        """Requests whose async loads are over; the blocks they could not load join the
        load errors vLLM reads in the same pass (and recomputes)."""
        if self.loads is None:
            return set()
        done, missed = self.loads.finished()
        self._load_errors |= missed
        return done

    def _load_one(self, load: ChunkTransfer) -> set[int]:
        """One request's planned chunks scattered; the blocks not loaded."""
        t0 = time.perf_counter()
        keys = [ChunkGrid.rank_key(span.key, self.rank) for span in load.chunks]
        loaded: set[int] = set()
        try:
            with self._store().get_into(keys) as lent:
                items = [_Item(k, s, c) for k, s, c in zip(keys, load.chunks, lent, strict=True)]
                for item, error in zip(items, self._scatter_all(items), strict=True):
                    if error is None:
                        loaded.update(item.span.targets)
                    else:
                        log.warning("kvtier load of chunk %s failed (recomputed): %s", item.key, error)
        except StoreUnavailableError:
            pass  # set aside after a failure: counted by the store, every block recomputed
        except Exception as exc:  # noqa: BLE001 - every block not loaded is an error
            log.warning("kvtier load failed (recomputed): %s", exc)
        wanted = _planned_blocks(load)
        if loaded:
            block_bytes = self.layers[0].block(0).numel() * self.layers[0].kv.element_size()
            seen = LoadObservation(load.req_id, len(loaded) * block_bytes * len(self.layers),
                                   time.perf_counter() - t0)
            with self._lock:
                self._observed.append(seen)
        missed = wanted - loaded
        with self._lock:
            self.stats.load_errors += len(missed)
            self.stats.loaded_blocks += len(loaded)
        return missed

    def _scatter_all(self, items: list[_Item]) -> list[ChunkError | None]:
        """Each lent chunk scattered into its blocks, or why not. Whole chunks of one size
        into a fused host cache go in few native calls, half on each restore worker; the
        rest (a chunk still being read) one by one, two at a time."""
        if self._device is not None:
            return self._scatter_device(items, self._device)
        if self._pieces is None:
            return map_restore(self._scatter, items)
        out: list[ChunkError | None] = [None] * len(items)
        whole: dict[int, list[int]] = {}
        rest: list[int] = []
        for i, item in enumerate(items):
            try:
                self._check(item)
            except ChunkError as exc:
                out[i] = exc
                continue
            if item.chunk.reading is None and not item.chunk.header.lossy:  # type: ignore[union-attr]
                whole.setdefault(len(item.span.block_ids), []).append(i)
            else:
                rest.append(i)
        halves = [h for same in whole.values() for h in (same[0::2], same[1::2]) if h]
        done = map_restore(lambda idxs: self._scatter_whole([items[i] for i in idxs]), halves)
        for half, errors in zip(halves, done, strict=True):
            for i, error in zip(half, errors, strict=True):
                out[i] = error
        for i, error in zip(rest, map_restore(self._scatter, [items[i] for i in rest]), strict=True):
            out[i] = error
        return out

    def _scatter_whole(self, items: list[_Item]) -> list[ChunkError | None]:
        """Whole chunks of one size checked and scattered in as few native calls as
        failures allow; a chunk that fails a layer is recorded on it (dropped from its tier
        after the lease)."""
        pieces = self._pieces
        assert pieces is not None
        chunks = [item.chunk for item in items]
        assert all(c is not None for c in chunks)
        blocks = len(items[0].span.block_ids)
        expected = np.array([c.header.layer_checksums for c in chunks], dtype=np.uint64)  # type: ignore[union-attr]
        dsts = np.stack([pieces.at_chunk(i.span.block_ids) for i in items])
        failures = scatter_chunks_verified(
            [c.payload for c in chunks], expected, dsts, pieces.layout(blocks))  # type: ignore[union-attr]
        out: list[ChunkError | None] = [None] * len(items)
        for i, layer in failures:
            try:
                chunks[i].fail(layer)  # type: ignore[union-attr]
            except ChunkError as exc:
                out[i] = exc
        return out

    def _scatter(self, item: _Item) -> ChunkError | None:
        """Scatter one lent chunk into its blocks (two at a time, on the restore workers);
        why it could not be, or None."""
        try:
            self._check(item)
            chunk, span = item.chunk, item.span
            assert chunk is not None
            if chunk.header.lossy:
                self._scatter_decoded(chunk, span)
            elif self._pieces is not None:
                _scatter_fused(chunk, span, self._pieces)
            else:
                self._scatter_copies(chunk, span)
        except ChunkError as exc:
            return exc
        return None

    def _scatter_copies(self, chunk: LentChunk, span: ChunkSpan) -> None:
        """Host caches without the native copy: each group of layers checked, then copied
        block by block (numpy)."""
        n = len(span.block_ids)
        src = chunk.payload.numpy().reshape(len(self.layers), 2, n, -1)
        for a, b in chunk.checked_groups(GROUP_BYTES):
            for i, layer in enumerate(self.layers[a:b], start=a):
                for j, block_id in _todo(span):
                    dst = layer.host_block(block_id)
                    np.copyto(dst, src[i, :, j].reshape(dst.shape))

    def _scatter_decoded(self, chunk: LentChunk, span: ChunkSpan) -> None:
        """A lossy chunk (kept encoded by its tier, issue 33) into host caches: each group
        of layers checked, decoded into this thread's reused scratch, then copied block by
        block."""
        n = len(span.block_ids)
        for a, b in chunk.checked_groups(LOSSY_GROUP_BYTES):
            src = chunk.layer_kv(a, b, decode_scratch(chunk, b - a)).view(b - a, 2, n, -1)
            for i, layer in enumerate(self.layers[a:b]):
                for j, block_id in _todo(span):
                    dst = layer.block(block_id)
                    dst.copy_(src[i, :, j].reshape(dst.shape))

    def _scatter_device(self, items: list[_Item], device: DeviceIO) -> list[ChunkError | None]:
        """Caches off the host (:mod:`.vllm_device_io`): each chunk checked as this
        connector's, then verified and scattered there."""
        out: list[ChunkError | None] = [None] * len(items)
        ready: list[int] = []
        for i, item in enumerate(items):
            try:
                self._check(item)
                ready.append(i)
            except ChunkError as exc:
                out[i] = exc
        moves = [BlockMove(tuple(_todo(items[i].span)), len(items[i].span.block_ids)) for i in ready]
        errors = device.scatter([items[i].chunk for i in ready], moves)  # type: ignore[misc]
        for i, error in zip(ready, errors, strict=True):
            out[i] = error
        return out

    def _check(self, item: _Item) -> None:
        """The chunk is stored, and is this model's, layout's and rank's: its fingerprint,
        dtype and shape."""
        if item.chunk is None:
            raise ChunkError(f"chunk {item.key} is not stored")
        header = item.chunk.header
        if header.fingerprint != self.fingerprint:
            raise ChunkMismatchError(f"chunk {header.key} was written for another model, "
                                     "layout or rank")
        if header.lossy and self.accept_codecs is not None and header.codec not in self.accept_codecs:
            raise ChunkMismatchError(f"chunk {header.key} holds {header.codec} KV; this "
                                     f"connector takes {', '.join(sorted(self.accept_codecs))}")
        if header.first_layer or tuple(header.shape) != self.chunk_shape(len(item.span.block_ids)) or (
                DTYPES.get(header.dtype) != self.dtype):
            raise ChunkMismatchError(f"chunk {header.key} holds {header.shape} of "
                                     f"{header.dtype}, not these blocks of this cache")

    def take_observations(self) -> list[LoadObservation]:
        """The loads made since the last call (bytes and seconds), for the scheduler's policy."""
        with self._lock:
            out, self._observed = self._observed, []
        return out

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self.loads is not None:
            self.loads.close()
        self.saves.close()


def _scatter_fused(chunk: LentChunk, span: ChunkSpan, pieces: BlockPieces) -> None:
    """Each group of layers checked and copied in one native pass (a chunk in memory
    in one call; one still being read, group by group as its layers land)."""
    blocks = len(span.block_ids)
    dsts, layout = pieces.at_chunk(span.block_ids), pieces.layout(blocks)
    step, per = chunk.header.layer_nbytes, layout.per_layer
    group = GROUP_BYTES if chunk.reading is not None else 1 << 62
    for a, b, sums in chunk.read_groups(group):
        part = chunk.payload[a * step : b * step]
        bad = scatter_pieces_verified(part, sums, dsts[per * a : per * b], layout, a)
        if bad >= 0:
            chunk.fail(a + bad)


def _gather_host(layers: list[CacheLayer], part: torch.Tensor, a: int, b: int, ids: list[int]) -> None:
    """Layers ``[a, b)`` of blocks ``ids`` of host caches into ``part`` (numpy)."""
    n = len(ids)
    dst = part.view(torch.uint8).numpy().reshape(b - a, 2, n, -1)
    for i, layer in enumerate(layers[a:b]):
        for j, block_id in enumerate(ids):
            np.copyto(dst[i, :, j], layer.host_block(block_id).reshape(2, -1))


def _todo(span: ChunkSpan) -> list[tuple[int, int]]:
    """``(j, block id)`` for the span's blocks to fill (vLLM computed the others)."""
    return [(j, b) for j, b in enumerate(span.block_ids) if b is not None]


def _planned_blocks(load: ChunkTransfer) -> set[int]:
    return {b for span in load.chunks for b in span.targets}


@lru_cache(maxsize=256)
def _shape(layers: int, block_numel: int, block_size: int, blocks: int
           ) -> tuple[int, int, int, int, int]:
    return (layers, 2, block_size * blocks, 1, block_numel // (2 * block_size))
