"""Where the bytes of a chunk being stored come from: gathered straight from the pool's
blocks, copied from a host snapshot, or already in place in a staging buffer. A
:class:`ChunkSource` writes its chunk (payload, checksums, header) into memory the tier
provides with :func:`~kvtier.chunk_format.encode_into`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kvtier.chunk_format import chunk_layout, encode_into
from kvtier.gpu_pool.kernels import copy_host
from kvtier.transfer.block_path import Gathered

GROUP_BYTES = 4 << 20
"""Layers are gathered and checksummed this many bytes at a time (see ``encode_into``)."""

Fill = Callable[..., object]


@dataclass(frozen=True)
class ChunkSource:
    """A chunk to write: its KV's shape and dtype and how to fill its payload, a group of
    layers at a time (``fill(part, start, end)``), or the whole chunk in one call where the
    fill checksums as it copies (``whole``: it returns the checksums)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: Fill
    whole: bool = False

    def nbytes(self, key: str, fingerprint: bytes) -> int:
        """The encoded chunk's length."""
        return chunk_layout(key, fingerprint, self.dtype, self.shape)[1]

    def encode(self, key: str, fingerprint: bytes, dest: torch.Tensor) -> int:
        """Write the chunk into ``dest``; its length."""
        group = None if self.whole else GROUP_BYTES
        return encode_into(dest, key, fingerprint, self.dtype, self.shape, self.fill, group)

    def already_in_place(self) -> ChunkSource:
        """The same chunk, whose payload already lies where it goes (a snapshot's staging
        buffer): only its checksums and header are written."""
        return replace(self, fill=_in_place, whole=False)


def _in_place(part: torch.Tensor, a: int, b: int) -> None:
    """The payload already lies where it goes."""


def copied_from(t: torch.Tensor) -> ChunkSource:
    """A chunk copied from a host snapshot of its KV."""
    if t.is_cuda:
        return ChunkSource(tuple(t.shape), t.dtype, lambda part, a, b: part.copy_(t[a:b]))
    return ChunkSource(tuple(t.shape), t.dtype, lambda part, a, b: copy_host(part, t[a:b]))


def gathered_from(gathered: Gathered, i: int, shape: tuple[int, ...], dtype: torch.dtype
                  ) -> ChunkSource:
    """Chunk ``i`` of ``gathered`` (the pool's blocks, through the block path), each layer's
    checksum computed as it is copied (on the host by the fused native copy; on a GPU by
    the device hash of its window before one copy to the slot)."""
    return ChunkSource(shape, dtype, lambda part: gathered.into(i, part), whole=True)
