"""Where a cache keeps its blocks, described once for every layout the block path serves.

kvtier's pool is one tensor ``[layers, blocks, 2, block_size, heads, dim]``; vLLM keeps a
tensor per layer, ``[2, blocks, ...]`` or ``[blocks, 2, ...]``. In each, a layer's block is
two contiguous halves (K and V, or the two halves of a block with no K/V split such as
MLA's latent), at a fixed stride from one block to the next: three numbers per layer. A
chunk stores per layer the K halves of its blocks, then their V halves, so every move
between a chunk and a cache is a list of half-block pieces whose addresses follow from
:class:`CacheBlocks` alone. Blocks move as bytes, never reinterpreted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.errors import InvalidArgumentError


@dataclass(frozen=True, eq=False)
class CacheBlocks:
    """Block ``b`` of layer ``l``: its first half at ``addresses[l] + b * block_strides[l]``,
    its second ``v_offsets[l]`` bytes further, each ``half_bytes`` contiguous bytes holding
    ``block_tokens`` tokens."""

    tensors: tuple[torch.Tensor, ...] = field(repr=False)
    """What the addresses point into (kept alive while this lives)."""
    addresses: np.ndarray
    block_strides: np.ndarray
    v_offsets: np.ndarray
    half_bytes: int
    block_tokens: int
    num_blocks: int
    dtype: torch.dtype
    on_device: bool
    """Moved by device kernels (a GPU's cache; in tests, Triton's interpreter on the host)
    rather than by host copies."""

    @property
    def layers(self) -> int:
        return len(self.addresses)

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def token_bytes(self) -> int:
        """Bytes of one token in one half of a block."""
        return self.half_bytes // self.block_tokens

    @classmethod
    def of_pool(cls, kv: torch.Tensor, on_device: bool | None = None) -> CacheBlocks:
        """kvtier's pool, ``[layers, blocks, 2, block_size, heads, dim]`` with each block's
        halves contiguous. ``on_device``: default, for a CUDA pool."""
        layers, blocks, two, bs, heads, dim = kv.shape
        if two != 2 or kv.stride(5) != 1 or kv.stride(4) != dim or kv.stride(3) != heads * dim:
            raise InvalidArgumentError(
                f"pool layout {tuple(kv.shape)} / {kv.stride()} is not block-contiguous")
        size = kv.element_size()
        addresses = kv.data_ptr() + np.arange(layers, dtype=np.uint64) * np.uint64(kv.stride(0) * size)
        return cls((kv,), addresses.astype(np.uint64),
                   np.full(layers, kv.stride(1) * size, dtype=np.uint64),
                   np.full(layers, kv.stride(2) * size, dtype=np.uint64),
                   bs * heads * dim * size, bs, blocks, kv.dtype,
                   kv.is_cuda if on_device is None else on_device)

    @classmethod
    def of_layers(cls, caches: Sequence[tuple[torch.Tensor, int]], block_tokens: int,
                  on_device: bool | None = None) -> CacheBlocks:
        """A tensor per layer with the dimension that indexes its blocks (vLLM's caches):
        each layer's block is one dense run of memory, split in two halves (a permuted
        layout too: bytes move as they lie), or two dense halves along its first
        dimension. Raises :class:`InvalidArgumentError` otherwise, or where
        the layers' blocks differ in size or dtype."""
        if not caches:
            raise InvalidArgumentError("a cache needs at least one layer")
        addresses, strides, offsets, halves = [], [], [], set()
        for kv, dim in caches:
            block = kv.select(dim, 0)
            size = kv.element_size()
            if _dense(block):  # its bytes in one run, in whatever order: two halves of it
                half = block.numel() * size // 2
                offset = half
            elif block.dim() and block.shape[0] == 2 and _dense(block[0]) and _dense(block[1]):
                half = block[0].numel() * size
                offset = block.stride(0) * size
            else:
                raise InvalidArgumentError(
                    f"cache blocks of shape {tuple(block.shape)} / strides {block.stride()} "
                    "are not two contiguous halves")
            addresses.append(kv.data_ptr())
            strides.append(kv.stride(dim) * size)
            offsets.append(offset)
            halves.add((half, kv.dtype, kv.shape[dim], kv.device))
        if len(halves) != 1:
            raise InvalidArgumentError("every layer's block must have one size, dtype, count "
                                       "and device (one chunk holds them all)")
        ((half, dtype, blocks, device),) = halves
        if half % block_tokens:
            raise InvalidArgumentError(f"a half-block of {half} bytes does not hold "
                                       f"{block_tokens} tokens")
        return cls(tuple(kv for kv, _ in caches), np.array(addresses, dtype=np.uint64),
                   np.array(strides, dtype=np.uint64), np.array(offsets, dtype=np.uint64),
                   half, block_tokens, blocks, dtype,
                   device.type == "cuda" if on_device is None else on_device)

    def piece_addresses(self, first: int, last: int, blocks: np.ndarray) -> np.ndarray:
        """``[last - first, 2, len(blocks)]`` addresses of the halves of ``blocks`` (int64
        block ids, checked in range) in layers ``[first, last)``: a chunk's byte order."""
        if len(blocks) and (blocks.min() < 0 or blocks.max() >= self.num_blocks):
            raise InvalidArgumentError(f"a block outside the cache's {self.num_blocks}")
        ids = blocks.astype(np.uint64)
        return (self.addresses[first:last, None, None]
                + np.arange(2, dtype=np.uint64)[None, :, None] * self.v_offsets[first:last, None, None]
                + ids[None, None, :] * self.block_strides[first:last, None, None])


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one run of memory from its first element on (any
    order of its dimensions, none of them reversed or overlapping)."""
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride(), strict=True)
                  if size != 1)
    expect = 1
    for stride, size in dims:
        if stride != expect:
            return False
        expect *= size
    return True
