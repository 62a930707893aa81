"""Where vLLM keeps a block: each layer's cache tensor (:class:`CacheLayer`) and, for
host caches, the addresses of a chunk's pieces for the fused native copy
(:class:`BlockPieces`): per layer, the K half of each of the chunk's blocks, then their V
halves, the order of the chunk's bytes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.errors import InvalidArgumentError
from kvtier.gpu_pool.kernels import host_native
from kvtier.gpu_pool.kernels.host_native import PieceLayout


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
    """Where one block of every layer lies as two contiguous pieces of ``piece`` bytes per
    layer (K and V, or the two halves of a contiguous block): what the fused native copy
    (copy and checksum in one pass, the GIL released) takes."""

    bases: np.ndarray
    """Each layer's cache address (uint64)."""
    strides: np.ndarray
    """Bytes from one block to the next, per layer."""
    offsets: np.ndarray
    """``[layers, 2]``: the two pieces of block 0, from the layer's address."""
    piece: int
    num_blocks: int
    scratch: np.ndarray = field(repr=False)
    """Where a load writes the pieces of blocks it leaves alone (vLLM computed them)."""
    _layouts: dict[int, PieceLayout] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, layers: list[CacheLayer], num_blocks: int) -> BlockPieces | None:
        """None where a cache is not on the host or its blocks are not two contiguous
        pieces (the numpy or torch copy serves)."""
        if not host_native.AVAILABLE or any(layer.host is None for layer in layers):
            return None
        offsets, sizes = [], set()
        for layer in layers:
            block, base, size = layer.block(0), layer.kv.data_ptr(), layer.kv.element_size()
            if block.is_contiguous():
                n = block.numel() * size // 2
                pieces = [block.data_ptr() - base, block.data_ptr() - base + n]
            elif block.shape[0] == 2 and block[0].is_contiguous() and block[1].is_contiguous():
                n = block[0].numel() * size
                pieces = [block[0].data_ptr() - base, block[1].data_ptr() - base]
            else:
                return None
            offsets.append(pieces)
            sizes.add(n)
        if len(sizes) != 1:
            return None
        (piece,) = sizes
        return cls(
            np.array([layer.kv.data_ptr() for layer in layers], dtype=np.uint64),
            np.array([layer.kv.stride(layer.block_dim) * layer.kv.element_size()
                      for layer in layers], dtype=np.uint64),
            np.array(offsets, dtype=np.uint64), piece, num_blocks,
            np.empty(piece, dtype=np.uint8))

    def layout(self, blocks: int) -> PieceLayout:
        """The pieces of a chunk of ``blocks`` blocks (checked once per size)."""
        got = self._layouts.get(blocks)
        if got is None:
            lens = np.full(len(self.bases) * 2 * blocks, self.piece, dtype=np.uint64)
            got = self._layouts[blocks] = PieceLayout(lens, len(self.bases))
        return got

    def at_chunk(self, block_ids: Sequence[int | None]) -> np.ndarray:
        """The pieces' addresses of a chunk of ``block_ids`` in its byte order (layer, K or
        V, block); those of a block None point at the scratch piece (left alone)."""
        none = np.array([b is None for b in block_ids], dtype=bool)
        ids = np.array([0 if b is None else b for b in block_ids], dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise InvalidArgumentError(f"a block outside the cache's {self.num_blocks}")
        at = (self.bases[:, None, None] + self.offsets[:, :, None]
              + ids.astype(np.uint64)[None, None, :] * self.strides[:, None, None])
        at[:, :, none] = np.uint64(self.scratch.ctypes.data)
        return np.ascontiguousarray(at.reshape(-1))
