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

from kvtier.chunk_format import chunk_layout, encode_into
from kvtier.connectors.chunk_store import ChunkStore
from kvtier.connectors.tiers.base import ChunkWrite
from kvtier.connectors.tiers.lent_chunk import LentChunk
from kvtier.connectors.vllm_blocks import BlockTransfer
from kvtier.errors import ChunkError, ChunkMismatchError, InvalidArgumentError

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
                    for key, block_id, chunk in zip(load.keys, load.block_ids, lent, strict=True):
                        if self._scatter(key, block_id, chunk):
                            loaded.add(block_id)
            except Exception as exc:  # noqa: BLE001 - every block not loaded is an error
                log.warning("kvtier load failed (recomputed): %s", exc)
                missed = set(load.block_ids) - loaded - self._load_errors
                self._load_errors.update(missed)
                self.stats.load_errors += len(missed)

    def _scatter(self, key: str, block_id: int, chunk: LentChunk | None) -> bool:
        """Whether the block was loaded (else it is a load error)."""
        try:
            if chunk is None:
                raise ChunkError(f"chunk {key} is not stored")
            self._check(chunk)
            if self._host:
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
            log.warning("kvtier load of block %d failed (recomputed): %s", block_id, exc)
            self._load_errors.add(block_id)
            self.stats.load_errors += 1
            return False
        self.stats.loaded_blocks += 1
        return True

    def _check(self, chunk: LentChunk) -> None:
        """The chunk is this model's and layout's: its fingerprint, dtype and shape."""
        header = chunk.header
        if header.fingerprint != self.fingerprint:
            raise ChunkMismatchError(f"chunk {header.key} was written for another model or layout")
        if header.first_layer or tuple(header.shape) != self.chunk_shape or (
                chunk.kv.dtype != self.dtype):
            raise ChunkMismatchError(f"chunk {header.key} holds {header.shape} of "
                                     f"{header.dtype}, not a block of this cache")

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
