"""vLLM's caches off the host (a GPU's): a chunk's blocks gathered and scattered with a few
index kernels a layer, its bytes crossing the link in one copy.

Copying block by block (a ``copy_`` per layer and block: 512 for a chunk of 16 blocks of a
32-layer model) pays each small copy's launch and synchronisation. Here a save gathers a
chunk's blocks on the device into one staging tensor, which crosses to the host slot in one
copy; a load copies a chunk's stored bytes to the device in one copy while the host verifies
them, and scatters them into the blocks only once verified (a compressed chunk decoded on the
device first, one Triton pass for every layer). Blocks move as integers of the cache's
element size: copied whole, never reinterpreted (fp8 caches too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.chunk_format import DTYPES
from kvtier.connectors.tiers.lent_chunk import LentChunk
from kvtier.connectors.vllm_pieces import CacheLayer
from kvtier.errors import ChunkFormatError
from kvtier.gpu_pool.kernels.api import DECODE_ERRORS, scatter_decoded

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class BlockMove:
    """One chunk's blocks in a load: block ``j`` of the chunk goes to cache block ``id``
    for each ``(j, id)`` of ``todo`` (blocks vLLM computed already are left out)."""

    todo: tuple[tuple[int, int], ...]
    blocks: int
    """Blocks in the chunk."""


@dataclass(frozen=True)
class DeviceBlocks:
    """Every layer's cache as integers of its element size, and the dimension that indexes
    its blocks."""

    caches: tuple[torch.Tensor, ...]
    block_dims: tuple[int, ...]
    half: int
    """Values in half a block (its K or its V half)."""

    @classmethod
    def of(cls, layers: Sequence[CacheLayer]) -> DeviceBlocks:
        bits = _BITS[layers[0].kv.element_size()]
        return cls(tuple(layer.kv.view(bits) for layer in layers),
                   tuple(layer.block_dim for layer in layers),
                   layers[0].block(0).numel() // 2)

    @property
    def device(self) -> torch.device:
        return self.caches[0].device

    @property
    def bits(self) -> torch.dtype:
        return self.caches[0].dtype

    def _index(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    def gather(self, first: int, last: int, ids: Sequence[int]) -> torch.Tensor:
        """Blocks ``ids`` of layers ``[first, last)`` as ``[layers, 2, blocks, half]`` on the
        device, in a chunk's byte order (per layer the K halves of the blocks, then their V
        halves)."""
        n, idx = len(ids), self._index(ids)
        out = torch.empty((last - first, 2, n, self.half), dtype=self.bits, device=self.device)
        for i, (kv, dim) in enumerate(zip(self.caches[first:last], self.block_dims[first:last],
                                          strict=True)):
            if dim == 1 and kv.shape[0] == 2:  # [2, blocks, ...]: already the chunk's order
                torch.index_select(kv, 1, idx, out=out[i].view(2, n, *kv.shape[2:]))
                continue
            blocks = kv.index_select(dim, idx).movedim(dim, 0).reshape(n, 2, self.half)
            out[i].copy_(blocks.transpose(0, 1))
        return out

    def scatter(self, src: torch.Tensor, first: int, move: BlockMove) -> None:
        """``src`` (``[layers, 2, blocks, half]`` of :attr:`bits` on the device) into the
        blocks ``move`` names, layers from ``first`` on."""
        js = [j for j, _ in move.todo]
        if not js:
            return
        if js != list(range(move.blocks)):
            src = src[:, :, self._index(js)]
        idx = self._index([b for _, b in move.todo])
        layers = zip(self.caches[first : first + src.shape[0]],
                     self.block_dims[first : first + src.shape[0]], strict=True)
        for i, (kv, dim) in enumerate(layers):
            shape = kv.select(dim, 0).shape
            blocks = src[i].transpose(0, 1).reshape(len(js), *shape).movedim(0, dim)
            kv.index_copy_(dim, idx, blocks)

    def as_blocks(self, kv: torch.Tensor, blocks: int) -> torch.Tensor:
        """A chunk's KV (contiguous, any chunk shape of the caches' dtype, or its bytes) as
        ``[layers, 2, blocks, half]`` of :attr:`bits`."""
        return kv.reshape(-1).view(self.bits).view(-1, 2, blocks, self.half)


def decode_on_device(chunk: LentChunk, stored: torch.Tensor, status: torch.Tensor) -> torch.Tensor:
    """A lossy chunk's stored bytes (already on the device) decoded there in one pass into a
    new contiguous tensor of its KV; what only a foreign writer puts in a payload is written
    to ``status`` (an int32 ``[1]``; read it before using the KV: :func:`refuse_bad`)."""
    layers, two, tokens, heads, dim = chunk.header.shape
    kv = torch.empty((layers, 1, two, tokens, heads, dim), dtype=DTYPES[chunk.header.dtype],
                     device=stored.device)
    scatter_decoded(stored, chunk.header.codec, kv, [0], tokens=tokens, status=status)
    return kv


def refuse_bad(chunks: Sequence[LentChunk], statuses: torch.Tensor) -> list[ChunkFormatError | None]:
    """Per chunk, the refusal its device decode's status calls for (recorded on the chunk,
    so its tier drops it as it does one failing its checksum), or None."""
    out: list[ChunkFormatError | None] = []
    for chunk, code in zip(chunks, statuses.tolist(), strict=True):
        try:
            if code:
                chunk.refuse(f"{chunk.header.codec} {DECODE_ERRORS.get(code, 'payload does not decode')}")
            out.append(None)
        except ChunkFormatError as exc:
            out.append(exc)
    return out

