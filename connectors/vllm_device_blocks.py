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
from kvtier.errors import ChunkFormatError, InvalidArgumentError
from kvtier.gpu_pool.kernels.api import DECODE_ERRORS, scatter_decoded
from kvtier.gpu_pool.kernels.dispatch import device_guard

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class BlockMove:
    """One chunk's blocks in a load: block ``j`` of the chunk goes to cache block ``id``
    for each ``(j, id)`` of ``todo`` (blocks vLLM computed already are left out)."""

    todo: tuple[tuple[int, int], ...]
    blocks: int
    """Blocks in the chunk."""


@dataclass(frozen=True)
class LayerTable:
    """Where every layer's blocks lie, alike in each layer: what the one-launch Triton copy
    (:mod:`kvtier.gpu_pool.kernels.triton_layer_blocks`) takes."""

    addresses: torch.Tensor
    """Each layer's cache address (int64, on the device)."""
    block_stride: int
    """Elements from one block to the next."""
    v_offset: int
    """Elements from a block's K half to its V half (each half contiguous)."""

    @classmethod
    def of(cls, layers: Sequence[CacheLayer]) -> LayerTable | None:
        """None where a layer's halves are not contiguous or the layers differ."""
        shapes = set()
        for layer in layers:
            block = layer.block(0)
            if block.is_contiguous():
                v_offset = block.numel() // 2
            elif block.shape[0] == 2 and block[0].is_contiguous() and block[1].is_contiguous():
                v_offset = block.stride(0)
            else:
                return None
            shapes.add((layer.kv.stride(layer.block_dim), v_offset))
        if len(shapes) != 1:
            return None
        ((block_stride, v_offset),) = shapes
        addresses = torch.tensor([layer.kv.data_ptr() for layer in layers], dtype=torch.int64)
        return cls(addresses.to(layers[0].kv.device), block_stride, v_offset)


@dataclass(frozen=True)
class DeviceBlocks:
    """Every layer's cache as integers of its element size, and the dimension that indexes
    its blocks; with ``table``, moved by one Triton launch a chunk (else a few index
    kernels a layer)."""

    caches: tuple[torch.Tensor, ...]
    block_dims: tuple[int, ...]
    half: int
    """Values in half a block (its K or its V half)."""
    table: LayerTable | None = None

    @classmethod
    def of(cls, layers: Sequence[CacheLayer], backend: str = "auto") -> DeviceBlocks:
        """``backend``: ``auto`` (Triton on CUDA where the layers allow, torch otherwise),
        ``torch`` or ``triton`` (tests: under the interpreter on the CPU)."""
        bits = _BITS[layers[0].kv.element_size()]
        table = None
        if backend == "triton" or (backend == "auto" and layers[0].kv.is_cuda):
            table = LayerTable.of(layers)
            if table is None and backend == "triton":
                raise InvalidArgumentError("these caches' blocks are not two contiguous halves "
                                           "laid out alike in every layer")
        return cls(tuple(layer.kv.view(bits) for layer in layers),
                   tuple(layer.block_dim for layer in layers),
                   layers[0].block(0).numel() // 2, table)

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
        if self.table is not None:
            self._triton(out, first, idx, torch.arange(n, device=self.device), to_cache=False)
            return out
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
        if self.table is not None:
            self._triton(src.contiguous(), first, self._index([b for _, b in move.todo]),
                         self._index(js), to_cache=True)
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

    def _triton(self, chunk: torch.Tensor, first: int, ids: torch.Tensor, rows: torch.Tensor,
                to_cache: bool) -> None:
        from kvtier.gpu_pool.kernels.triton_layer_blocks import copy_layer_blocks

        table = self.table
        assert table is not None
        addresses = table.addresses[first : first + chunk.shape[0]]
        with device_guard(self.device):
            copy_layer_blocks(addresses, chunk, ids, rows, table.block_stride, table.v_offset,
                              to_cache)

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

