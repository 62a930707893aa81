"""A chunk's move between its payload and a cache as half-block pieces: offsets in the
payload, addresses in the cache, lengths. Built with numpy for every layer and block at
once; the host copies and the device kernel both take these tables."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.errors import ChunkMismatchError
from kvtier.transfer.block_path.cache_blocks import CacheBlocks
from kvtier.transfer.block_path.spans import BlockSpan


@dataclass(frozen=True)
class Pieces:
    """``[layers, 2, blocks]`` tables of one chunk's layers ``[first, last)`` (every block
    of the chunk; a block its span leaves alone has length 0)."""

    offsets: np.ndarray
    """Each piece's offset (bytes) from the start of layer ``first`` in the payload."""
    cache: np.ndarray
    """Each piece's address in the cache (block 0's where its length is 0: never touched)."""
    lens: np.ndarray
    layer_bytes: int
    first: int
    last: int

    @property
    def per_layer(self) -> int:
        return self.lens.shape[1] * self.lens.shape[2]


def chunk_pieces(cache: CacheBlocks, span: BlockSpan, tokens: int, first: int, last: int
                 ) -> Pieces:
    """The pieces of a chunk of ``tokens`` tokens (its KV as the cache's bytes: per layer
    the K halves of its blocks, then the V halves) moved along ``span``. Raises
    :class:`ChunkMismatchError` where the chunk's blocks do not fit ``span``."""
    bs, tb = cache.block_tokens, cache.token_bytes
    blocks = len(span.blocks)
    if blocks != -(-tokens // bs) or tokens < 1:
        raise ChunkMismatchError(f"a chunk of {tokens} tokens is not {blocks} blocks of {bs}")
    if not 0 <= first <= last <= cache.layers:
        raise ChunkMismatchError(f"layers {first}..{last} outside the cache's {cache.layers}")
    layers = last - first
    j = np.arange(blocks, dtype=np.uint64)
    block_lens = np.minimum(bs, tokens - j.astype(np.int64) * bs).astype(np.uint64) * np.uint64(tb)
    moved = np.array([b is not None for b in span.blocks], dtype=bool)
    ids = np.array([0 if b is None else b for b in span.blocks], dtype=np.int64)
    layer_bytes = 2 * tokens * tb
    offsets = (np.arange(layers, dtype=np.uint64)[:, None, None] * np.uint64(layer_bytes)
               + np.arange(2, dtype=np.uint64)[None, :, None] * np.uint64(tokens * tb)
               + (j * np.uint64(bs * tb))[None, None, :])
    addresses = cache.piece_addresses(first, last, ids)
    lens = np.broadcast_to(np.where(moved, block_lens, np.uint64(0)), (layers, 2, blocks))
    return Pieces(offsets, addresses, np.ascontiguousarray(lens, dtype=np.uint64),
                  layer_bytes, first, last)
