"""The worker side of kvtier's vLLM connector: vLLM's per-layer cache tensors to and from
the store, one copy and one checksum pass per block each way.

A block's chunk holds that block of every layer. A save gathers each layer's block straight
into memory the store provides (a CPU arena slot in-process; a staging buffer an upload
goes out of) and checksums each group of layers while it is still in cache
(:func:`~kvtier.chunk_format.encode_into`). A load scatters a lent chunk (a view of the
arena's slot, or of the buffer a file or a reply was read into) straight into vLLM's
cache, each group of layers checked right before it is copied. A block that is missing,
corrupt or of another layout is reported as a load error and vLLM recomputes it: never
wrong KV. vLLM's blocks are copied whole, never reinterpreted: the chunk's nominal shape
only carries the bytes, the fingerprint names the real layout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.chunk_format import DTYPES, chunk_layout, encode_into
from kvtier.connectors.chunk_store import ChunkStore
from kvtier.connectors.tiers.base import ChunkWrite
from kvtier.connectors.tiers.chunk_workers import map_restore
from kvtier.connectors.tiers.lent_chunk import LentChunk
from kvtier.connectors.vllm_blocks import BlockTransfer
from kvtier.errors import ChunkError, ChunkMismatchError, InvalidArgumentError
from kvtier.gpu_pool.kernels import host_native
from kvtier.gpu_pool.kernels.host_native import (
    PieceLayout,
    gather_pieces_hashed,
    scatter_chunks_verified,
    scatter_pieces_verified,
)

log = logging.getLogger(__name__)

GROUP_BYTES = 4 << 20
"""Layers are gathered and checksummed, or checked and scattered, this many bytes at a time."""


@dataclass(frozen=True)
class CacheLayer:
    """One layer's cache tensor and the dimension that indexes its blocks. A host cache is
    also seen as numpy bytes (``host``): a copy of one layer's block (tens of KiB) costs
    about as much as torch's per-call overhead, numpy's is a fraction of it."""

    name: str
    kv: torch.Tensor
    block_dim: int
    host: np.ndarray | None = None

    @classmethod
    def of(cls, name: str, kv: torch.Tensor, block_dim: int) -> CacheLayer:
        host = None
        if kv.device.type == "cpu" and kv.is_contiguous():
            host = kv.view(torch.uint8).numpy()  # the same memory, as bytes
        return cls(name, kv, block_dim, host)

    def block(self, block_id: int) -> torch.Tensor:
        """The layer's block (K and V), a view of the cache."""
        return self.kv.select(self.block_dim, block_id)

    def host_block(self, block_id: int) -> np.ndarray:
        """The layer's block as a numpy byte view of the cache (a host cache only)."""
        assert self.host is not None
        return self.host[block_id] if self.block_dim == 0 else self.host[:, block_id]


@dataclass(frozen=True)
class BlockPieces:
    """Where one block of every layer lies as two contiguous pieces per layer (K and V, or
    the two halves of a contiguous block), in the chunk's byte order: what the fused
    native copy (copy and checksum in one pass, the GIL released) takes."""

    bases: np.ndarray
    """Each layer's cache address (uint64)."""
    strides: np.ndarray
    """Bytes from one block to the next, per layer."""
    offsets: np.ndarray
    """``[layers, 2]``: the two pieces of block 0, from the layer's address."""
    layout: PieceLayout
    """The pieces' lengths, checked once."""
    num_blocks: int

    @classmethod
    def of(cls, layers: list[CacheLayer], num_blocks: int) -> BlockPieces | None:
        """None where a cache is not on the host or its blocks are not two contiguous
        pieces (the numpy or torch copy serves)."""
        if not host_native.AVAILABLE or any(layer.host is None for layer in layers):
            return None
        offsets, lens = [], []
        for layer in layers:
            block, base, size = layer.block(0), layer.kv.data_ptr(), layer.kv.element_size()
            if block.is_contiguous():
                n = block.numel() * size
                pieces = [(block.data_ptr() - base, n // 2), (block.data_ptr() - base + n // 2, n - n // 2)]
            elif block.shape[0] == 2 and block[0].is_contiguous() and block[1].is_contiguous():
                n = block[0].numel() * size
                pieces = [(block[0].data_ptr() - base, n), (block[1].data_ptr() - base, n)]
            else:
                return None
            offsets.append([o for o, _ in pieces])
            lens += [n for _, n in pieces]
        return cls(
            np.array([layer.kv.data_ptr() for layer in layers], dtype=np.uint64),
            np.array([layer.kv.stride(layer.block_dim) * layer.kv.element_size()
                      for layer in layers], dtype=np.uint64),
            np.array(offsets, dtype=np.uint64),
            PieceLayout(np.array(lens, dtype=np.uint64), len(layers)), num_blocks)

    def at_many(self, block_ids: list[int]) -> np.ndarray:
        """``[blocks, pieces]``: the pieces' addresses of each block (checked)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise InvalidArgumentError(f"a block outside the cache's {self.num_blocks}")
        at = (self.bases[None, :, None] + ids.astype(np.uint64)[:, None, None]
              * self.strides[None, :, None] + self.offsets[None])
        return at.reshape(len(ids), -1)

    def at(self, block_id: int) -> np.ndarray:
        """The pieces' addresses of block ``block_id`` (inside the caches: checked)."""
        if not 0 <= block_id < self.num_blocks:
            raise InvalidArgumentError(f"block {block_id} outside the cache's {self.num_blocks}")
        at = self.bases[:, None] + np.uint64(block_id) * self.strides[:, None] + self.offsets
        return at.reshape(-1)


@dataclass
class WorkerStats:
    loaded_blocks: int = 0
    saved_blocks: int = 0
    load_errors: int = 0


class WorkerSide:
    """``store()`` opens the store when first needed."""

    def __init__(self, store: Callable[[], ChunkStore], block_size: int,
                 fingerprint: bytes) -> None:
        self._store = store
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.layers: list[CacheLayer] = []
        self._host = False
        self._pieces: BlockPieces | None = None
        self.stats = WorkerStats()
        self._load_errors: set[int] = set()

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
        """Every layer a host cache: copies in numpy (else torch's, e.g. to a GPU)."""
        self._pieces = BlockPieces.of(layers, num_blocks)
        """Host caches whose blocks the fused native copy can take (copy and checksum in
        one pass); None: numpy or torch copies, checksums apart."""

    # ----------------------------------------------------------------- the layout
    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        """A block of every layer as a chunk: ``[layers, 2, block_size, 1, rest]``."""
        per_layer = self.layers[0].block(0).numel()
        return (len(self.layers), 2, self.block_size, 1, per_layer // (2 * self.block_size))

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].kv.dtype

    # ---------------------------------------------------------------------- saves
    def save(self, saves: list[BlockTransfer]) -> None:
        """Store the blocks, each gathered straight into the store's memory."""
        writes = [self._write(key, block)
                  for s in saves for key, block in zip(s.keys, s.block_ids, strict=True)]
        if not writes:
            return
        try:
            failed = self._store().put_from(writes)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss
            log.warning("kvtier save of %d blocks failed: %s", len(writes), exc)
            return
        self.stats.saved_blocks += len(writes) - len(failed)

    def _write(self, key: str, block_id: int) -> ChunkWrite:
        shape, dtype, fp = self.chunk_shape, self.dtype, self.fingerprint
        _, total = chunk_layout(key, fp, dtype, shape)

        def gather(part: torch.Tensor, a: int, b: int) -> None:
            if self._host:
                dst = part.view(torch.uint8).numpy()
                for i, layer in enumerate(self.layers[a:b]):
                    src = layer.host_block(block_id)
                    np.copyto(dst[i].reshape(src.shape), src)
                return
            for i, layer in enumerate(self.layers[a:b]):
                src = layer.block(block_id)
                part[i].view(src.shape).copy_(src)

        pieces = self._pieces
        if pieces is not None:  # copied and checksummed in one native pass
            addrs = pieces.at(block_id)
            return ChunkWrite(key, total, fill=lambda slot: encode_into(
                slot, key, fp, dtype, shape,
                lambda part: gather_pieces_hashed(part, addrs, pieces.layout)))
        return ChunkWrite(key, total, fill=lambda slot: encode_into(
            slot, key, fp, dtype, shape, gather, GROUP_BYTES))

    # ---------------------------------------------------------------------- loads
    def load(self, loads: list[BlockTransfer]) -> None:
        """Scatter each planned block from the store into the cache; a block that cannot
        be loaded is a load error (recomputed)."""
        for load in loads:
            loaded: set[int] = set()
            try:
                with self._store().get_into(load.keys) as lent:
                    items = list(zip(load.keys, load.block_ids, lent, strict=True))
                    for (_, block_id, _), error in zip(items, self._scatter_all(items),
                                                       strict=True):
                        if error is None:
                            loaded.add(block_id)
                        else:
                            log.warning("kvtier load of block %d failed (recomputed): %s",
                                        block_id, error)
            except Exception as exc:  # noqa: BLE001 - every block not loaded is an error
                log.warning("kvtier load failed (recomputed): %s", exc)
            missed = set(load.block_ids) - loaded
            self._load_errors.update(missed)
            self.stats.load_errors += len(missed)
            self.stats.loaded_blocks += len(loaded)

    def _scatter_all(self, items: list[tuple[str, int, LentChunk | None]]
                     ) -> list[ChunkError | None]:
        """Each lent chunk scattered into its block, or why not. Chunks lent whole into a
        fused host cache go in few native calls, half on each restore worker (a block's
        chunk is a couple of MiB: a call per chunk would spend about as long in Python as
        in the copy); the rest (a chunk still being read) one by one, two at a time."""
        if self._pieces is None:
            return map_restore(self._scatter, items)
        out: list[ChunkError | None] = [None] * len(items)
        whole: list[int] = []
        rest: list[int] = []
        for i, (key, _, chunk) in enumerate(items):
            try:
                if chunk is None:
                    raise ChunkError(f"chunk {key} is not stored")
                self._check(chunk)
            except ChunkError as exc:
                out[i] = exc
                continue
            (whole if chunk.reading is None else rest).append(i)
        halves = [h for h in (whole[0::2], whole[1::2]) if h]
        done = map_restore(lambda idxs: self._scatter_whole([items[i] for i in idxs]), halves)
        for half, errors in zip(halves, done, strict=True):
            for i, error in zip(half, errors, strict=True):
                out[i] = error
        for i, error in zip(rest, map_restore(self._scatter, [items[i] for i in rest]), strict=True):
            out[i] = error
        return out

    def _scatter_whole(self, items: list[tuple[str, int, LentChunk | None]]
                       ) -> list[ChunkError | None]:
        """Whole chunks checked and scattered in as few native calls as failures allow; a
        chunk that fails a layer is recorded on it (dropped from its tier after the lease)."""
        pieces = self._pieces
        assert pieces is not None
        chunks = [chunk for _, _, chunk in items]
        assert all(c is not None for c in chunks)
        expected = np.array([c.header.layer_checksums for c in chunks], dtype=np.uint64)  # type: ignore[union-attr]
        failures = scatter_chunks_verified(
            [c.payload for c in chunks], expected,  # type: ignore[union-attr]
            pieces.at_many([block_id for _, block_id, _ in items]), pieces.layout)
        out: list[ChunkError | None] = [None] * len(items)
        for i, layer in failures:
            try:
                chunks[i].fail(layer)  # type: ignore[union-attr]
            except ChunkError as exc:
                out[i] = exc
        return out

    def _scatter(self, item: tuple[str, int, LentChunk | None]) -> ChunkError | None:
        """Scatter one lent chunk into its block (two at a time, on the restore workers);
        why it could not be, or None."""
        key, block_id, chunk = item
        try:
            if chunk is None:
                raise ChunkError(f"chunk {key} is not stored")
            self._check(chunk)
            if self._pieces is not None:
                self._scatter_fused(chunk, block_id, self._pieces)
            elif self._host:
                src = chunk.payload.numpy().reshape(len(self.layers), -1)
                for a, b in chunk.checked_groups(GROUP_BYTES):
                    for i, layer in enumerate(self.layers[a:b], start=a):
                        dst = layer.host_block(block_id)
                        np.copyto(dst, src[i].reshape(dst.shape))
            else:
                for a, b in chunk.checked_groups(GROUP_BYTES):
                    for i, layer in enumerate(self.layers[a:b], start=a):
                        dst = layer.block(block_id)
                        dst.copy_(chunk.kv[i].view(dst.shape))
        except ChunkError as exc:
            return exc
        return None

    @staticmethod
    def _scatter_fused(chunk: LentChunk, block_id: int, pieces: BlockPieces) -> None:
        """Each group of layers checked and copied in one native pass (a chunk in memory
        in one call; one still being read, group by group as its layers land)."""
        dsts, step = pieces.at(block_id), chunk.header.layer_nbytes
        group = GROUP_BYTES if chunk.reading is not None else 1 << 62
        for a, b, sums in chunk.read_groups(group):
            part = chunk.payload[a * step : b * step]
            bad = scatter_pieces_verified(part, sums, dsts[2 * a : 2 * b], pieces.layout, a)
            if bad >= 0:
                chunk.fail(a + bad)

    def _check(self, chunk: LentChunk) -> None:
        """The chunk is this model's and layout's: its fingerprint, dtype and shape."""
        header = chunk.header
        if header.fingerprint != self.fingerprint:
            raise ChunkMismatchError(f"chunk {header.key} was written for another model or layout")
        if header.first_layer or tuple(header.shape) != self.chunk_shape or (
                DTYPES.get(header.dtype) != self.dtype):
            raise ChunkMismatchError(f"chunk {header.key} holds {header.shape} of "
                                     f"{header.dtype}, not a block of this cache")

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
