"""The worker side of kvtier's vLLM connector: vLLM's per-layer cache tensors to and from
the store. This side keeps the bookkeeping (which chunk goes to which blocks, what a
chunk must be to be loaded, what failed); the bytes move through kvtier's one block path
(:mod:`kvtier.transfer.block_path`), as the engine's do.

A chunk holds ``chunk_blocks`` of vLLM's blocks (:mod:`.vllm_blocks`) of every layer, laid
out layer-major as every kvtier chunk: per layer the first halves of its blocks (K), then
their second halves (V). A save gathers the blocks straight into memory the store provides
(a CPU arena slot in-process; a staging buffer an upload goes out of) with each layer's
checksum, on a background thread (:mod:`.vllm_saves`), off vLLM's forward path. A load
scatters the lent chunks (views of the arena's slots, or of the buffers a file or a reply
was read into) into vLLM's cache, each layer checked against its stored checksum; blocks
vLLM computed already are left alone. A chunk that is missing, corrupt, of another layout
or of another rank is not loaded, nor is any later chunk of the request: their blocks are
load errors, and vLLM recomputes them (never wrong KV). vLLM's blocks are copied whole,
never reinterpreted: the chunk's nominal shape only carries the bytes, the fingerprint
names the real layout and the rank. A tier that keeps chunks compressed
(``tiers.<tier>_codec``) encodes those values of the cache's dtype, K apart from V, in
groups of the nominal rows (on a GPU, encoded there); such a chunk is decoded on load
(where this connector takes its codec, ``accept_codecs``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from kvtier.chunk_format import DTYPES, chunk_layout, encode_chunk, encode_into
from kvtier.connectors.chunk_store import ChunkStore
from kvtier.connectors.save_refusals import SaveRefusals
from kvtier.connectors.store_breaker import StoreUnavailableError, fault_of
from kvtier.connectors.tiers.base import ChunkWrite
from kvtier.connectors.tiers.derived import TokenRange
from kvtier.connectors.tiers.lent_chunk import LentChunk
from kvtier.connectors.vllm_blocks import ChunkGrid, ChunkSpan, ChunkTransfer, Rank
from kvtier.connectors.vllm_loads import LoadQueue
from kvtier.connectors.vllm_policy import LoadObservation
from kvtier.connectors.vllm_saves import SaveQueue
from kvtier.errors import ChunkError, ChunkMismatchError, InvalidArgumentError
from kvtier.kv_codecs import ENCODABLE, Codec
from kvtier.policies.eviction import ChunkInfo
from kvtier.transfer.block_path import BlockSpan, CacheBlocks, Gathered, gather, scatter

log = logging.getLogger(__name__)

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
class CacheLayer:
    """One layer's cache tensor and the dimension that indexes its blocks."""

    name: str
    kv: torch.Tensor
    block_dim: int

    def block(self, block_id: int) -> torch.Tensor:
        """The layer's block (K and V), a view of the cache."""
        return self.kv.select(self.block_dim, block_id)


class WorkerSide:
    """``store()`` opens the store when first needed. ``background``: saves run off the
    forward path (vLLM holds a finished request's blocks until :meth:`finished` names it),
    at idle priority with ``idle_saves``."""

    def __init__(self, store: Callable[[], ChunkStore], grid: ChunkGrid, rank: Rank = Rank(),
                 background: bool = False, idle_saves: bool = False,
                 async_loads: bool = False, accept_codecs: frozenset[str] | None = None,
                 saves_yield: bool | None = False, save_step_gap_s: float | None = None,
                 device_copies: bool | None = None) -> None:
        self._store = store
        self.accept_codecs = accept_codecs
        """The codecs of stored KV this worker loads (None: whatever the store lends, which
        gives each reader only the codecs it takes); a lossy chunk is decoded on load."""
        self.grid = grid
        self.rank = rank
        self.fingerprint = rank_fingerprint(grid.fingerprint, rank)
        self.layers: list[CacheLayer] = []
        self.device_copies = device_copies
        """Whether the caches' blocks move by device kernels (None: where they lie on a
        GPU; True on the host runs them under Triton's interpreter, for tests)."""
        self.cache: CacheBlocks | None = None
        self._streams = threading.local()
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
            layers.append(CacheLayer(name, kv, dims[0]))
        try:
            cache = CacheBlocks.of_layers([(layer.kv, layer.block_dim) for layer in layers],
                                          self.grid.block_size, self.device_copies)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"kvtier connector: {exc}") from exc
        self.layers, self.cache = layers, cache
        if self._saves_yield is None:  # a host cache's prefill and the saves share the cores
            self.saves.yield_to_prefill = not cache.on_device and self.saves.background

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
        for span, _ in items:
            if len(span.targets) != len(span.block_ids):
                raise InvalidArgumentError(f"a save of chunk {span.key} must name every block")
        with self._save_stream():  # a device cache's windows gathered on this stream
            gathered = gather(self._cache, [BlockSpan.of(span.targets) for span, _ in items],
                              [self.chunk_shape(len(span.block_ids))[2] for span, _ in items])
        writes = [self._write(span, session, gathered, i)
                  for i, (span, session) in enumerate(items)]
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

    def _write(self, span: ChunkSpan, session: str | None, gathered: Gathered, i: int
               ) -> ChunkWrite:
        """Chunk ``i`` of ``gathered`` as the store writes it: into the slot the store
        lends, copied out with each layer's checksum (on a device cache, on this saving
        thread's own stream, so that saves queue neither behind the next forward pass nor
        behind each other); into a compressed tier from a GPU, encoded there first."""
        key = ChunkGrid.rank_key(span.key, self.rank)
        fp, dtype, cache = self.fingerprint, self.dtype, self._cache
        shape = self.chunk_shape(len(span.block_ids))
        _, total = chunk_layout(key, fp, dtype, shape)
        info = ChunkInfo(total, session, span.first_block) if session else None
        if cache.device.type == "cuda":  # into a compressed tier: encoded on the GPU
            codec = self._store().landing_codec()
            if codec is not Codec.NONE and dtype in ENCODABLE:
                return ChunkWrite.of_blob(key, self._encoded(key, gathered, i, shape, codec), info)

        def into(part: torch.Tensor) -> tuple[int, ...]:
            with self._save_stream():
                return gathered.into(i, part)

        return ChunkWrite(key, total, info=info, fill=lambda slot: encode_into(
            slot, key, fp, dtype, shape, into))

    def _encoded(self, key: str, gathered: Gathered, i: int, shape: tuple[int, ...],
                 codec: Codec) -> bytes:
        """Chunk ``i`` of ``gathered`` encoded by ``codec`` on the device (only the encoded
        bytes cross)."""
        with self._save_stream():
            kv = torch.empty(shape, dtype=self.dtype, device=self._cache.device)
            gathered.into(i, kv)  # checksums unused: the encoded bytes get their own
            return encode_chunk(key, self.fingerprint, kv, codec)

    def _save_stream(self) -> contextlib.AbstractContextManager[object]:
        """On CUDA, this thread's save stream; elsewhere nothing."""
        cache = self._cache
        if cache.device.type != "cuda":
            return contextlib.nullcontext()
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(cache.device)
        return torch.cuda.stream(stream)

    @property
    def _cache(self) -> CacheBlocks:
        if self.cache is None:
            raise InvalidArgumentError("kvtier connector: no caches registered")
        return self.cache

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
        """One request's planned chunks scattered, in order up to the first that cannot
        be (missing, foreign, corrupt): its blocks and every later chunk's are not loaded
        (vLLM recomputes them). The blocks not loaded."""
        t0 = time.perf_counter()
        keys = [ChunkGrid.rank_key(span.key, self.rank) for span in load.chunks]
        loaded: set[int] = set()
        try:
            with self._store().get_into(keys) as lent:
                usable, why = self._usable(keys, load.chunks, lent)
                spans = [BlockSpan.of(span.block_ids) for span in load.chunks[: len(usable)]]
                done = scatter(usable, spans, self._cache)
                for span in load.chunks[: done.served]:
                    loaded.update(span.targets)
                why = done.reason or why
                if why is not None:
                    log.warning("kvtier load of chunk %s failed (it and the rest recomputed): %s",
                                keys[len(usable) if done.reason is None else done.served], why)
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

    def _usable(self, keys: list[str], spans: list[ChunkSpan], lent: list[LentChunk | None]
                ) -> tuple[list[LentChunk], str | None]:
        """The leading lent chunks that are this connector's (stored, of this model,
        layout, rank and codec), and why the next one is not."""
        usable: list[LentChunk] = []
        for key, span, chunk in zip(keys, spans, lent, strict=True):
            try:
                usable.append(self._check(key, span, chunk))
            except ChunkError as exc:
                return usable, str(exc)
        return usable, None

    def _check(self, key: str, span: ChunkSpan, chunk: LentChunk | None) -> LentChunk:
        """The chunk is stored, and is this model's, layout's and rank's: its fingerprint,
        dtype and shape."""
        if chunk is None:
            raise ChunkError(f"chunk {key} is not stored")
        header = chunk.header
        if header.fingerprint != self.fingerprint:
            raise ChunkMismatchError(f"chunk {header.key} was written for another model, "
                                     "layout or rank")
        if header.lossy and self.accept_codecs is not None and header.codec not in self.accept_codecs:
            raise ChunkMismatchError(f"chunk {header.key} holds {header.codec} KV; this "
                                     f"connector takes {', '.join(sorted(self.accept_codecs))}")
        if header.first_layer or tuple(header.shape) != self.chunk_shape(len(span.block_ids)) or (
                DTYPES.get(header.dtype) != self.dtype):
            raise ChunkMismatchError(f"chunk {header.key} holds {header.shape} of "
                                     f"{header.dtype}, not these blocks of this cache")
        return chunk

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


def _planned_blocks(load: ChunkTransfer) -> set[int]:
    return {b for span in load.chunks for b in span.targets}


@lru_cache(maxsize=256)
def _shape(layers: int, block_numel: int, block_size: int, blocks: int
           ) -> tuple[int, int, int, int, int]:
    return (layers, 2, block_size * blocks, 1, block_numel // (2 * block_size))
