"""The vLLM connector worker's saves and loads for caches off the host (a GPU's).

A save gathers a chunk's blocks of every layer on the device (:class:`DeviceBlocks`, one
Triton launch), copies them to the host slot a group of layers at a time on the saving
thread's own stream, and checksums each group on the restore workers as soon as it lands
(xxh3 over bytes a DMA just wrote runs at a few GB/s a core). Into a tier that keeps chunks
compressed it encodes them on the device, so only the encoded bytes cross. A load copies
each chunk's stored bytes to the device as soon as they are read while the restore workers
verify them, decodes them there where lossy, and scatters a chunk into its blocks only once
verified: a corrupt chunk's blocks are never written. Every copy is done before the lent
memory goes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import torch

from kvtier.chunk_format import encode_chunk
from kvtier.connectors.tiers.chunk_workers import map_restore, start_restore
from kvtier.connectors.tiers.lent_chunk import LentChunk
from kvtier.connectors.vllm_device_blocks import (
    BlockMove,
    DeviceBlocks,
    decode_on_device,
    refuse_bad,
)
from kvtier.errors import ChunkError
from kvtier.kv_codecs import Codec
from kvtier.layer_sums import layer_sums

GROUP_BYTES = 4 << 20
"""A save copies and checksums this many bytes of layers at a time."""
WINDOW_BYTES = 256 << 20
"""A load copies at most this many stored bytes over before scattering them (the device
memory a load borrows beside vLLM's)."""
ENCODABLE = (torch.float32, torch.bfloat16, torch.float16)
"""Cache dtypes a codec encodes (an fp8 cache is stored as it is)."""


class DeviceIO:
    """Saves and loads of one worker's device caches (``blocks``, of ``dtype``)."""

    def __init__(self, blocks: DeviceBlocks, dtype: torch.dtype, layers: int) -> None:
        self.blocks = blocks
        self.dtype = dtype
        self.layers = layers
        self._streams = threading.local()

    @property
    def on_cuda(self) -> bool:
        return self.blocks.device.type == "cuda"

    def encodes(self, codec: Codec) -> bool:
        """Whether a save into a tier of ``codec`` is encoded here (on a GPU)."""
        return self.on_cuda and codec is not Codec.NONE and self.dtype in ENCODABLE

    # ---------------------------------------------------------------------- saves
    def fill(self, part: torch.Tensor, ids: Sequence[int]) -> tuple[int, ...]:
        """Every layer of blocks ``ids`` into ``part`` (the host slot, the chunk's payload);
        returns the layers' checksums."""
        blocks = self.blocks
        host = part.view(blocks.bits).view(self.layers, 2, len(ids), blocks.half)
        step = host[0].numel() * host.element_size()
        per = max(1, GROUP_BYTES // step)
        groups = [(a, min(a + per, self.layers)) for a in range(0, self.layers, per)]
        landed: list[torch.cuda.Event | None] = []
        with self._save_stream():
            staging = blocks.gather(0, self.layers, ids)
            for a, b in groups:
                host[a:b].copy_(staging[a:b], non_blocking=True)
                landed.append(torch.cuda.Event() if staging.is_cuda else None)
                if landed[-1] is not None:
                    landed[-1].record()
        mem = part.view(torch.uint8).numpy().reshape(-1)

        def group_sums(k: int) -> tuple[int, ...]:
            a, b = groups[k]
            if landed[k] is not None:
                landed[k].synchronize()  # type: ignore[union-attr]
            return layer_sums(mem[a * step : b * step], b - a)

        return tuple(x for sums in map_restore(group_sums, range(len(groups))) for x in sums)

    def encoded(self, key: str, fingerprint: bytes, ids: Sequence[int],
                shape: tuple[int, ...], codec: Codec) -> bytes:
        """The chunk of blocks ``ids`` encoded by ``codec`` on the device."""
        with self._save_stream():
            kv = self.blocks.gather(0, self.layers, ids).view(self.dtype).view(shape)
            return encode_chunk(key, fingerprint, kv, codec)

    def _save_stream(self) -> contextlib.AbstractContextManager[object]:
        """On CUDA, this thread's save stream (the save already waited for the step's
        work), so saves do not queue behind the next forward pass or each other."""
        if not self.on_cuda:
            return contextlib.nullcontext()
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            stream = self._streams.stream = torch.cuda.Stream(self.blocks.device)
        return torch.cuda.stream(stream)

    # ---------------------------------------------------------------------- loads
    def scatter(self, chunks: Sequence[LentChunk], moves: Sequence[BlockMove]
                ) -> list[ChunkError | None]:
        """Each chunk (its key, model, layout and shape checked) into the blocks of its
        move, a window at a time; why one could not be, or None."""
        out: list[ChunkError | None] = [None] * len(chunks)
        window: list[int] = []
        size = 0
        try:
            for i, chunk in enumerate(chunks):
                window.append(i)
                size += chunk.payload.numel()
                if size >= WINDOW_BYTES:
                    self._window(chunks, moves, window, out)
                    window, size = [], 0
            if window:
                self._window(chunks, moves, window, out)
        finally:  # whatever happened, no copy still reads lent memory once it is let go
            if self.on_cuda:
                torch.cuda.current_stream(self.blocks.device).synchronize()
        return out

    def _window(self, chunks: Sequence[LentChunk], moves: Sequence[BlockMove],
                window: list[int], out: list[ChunkError | None]) -> None:
        blocks = self.blocks
        part = [chunks[i] for i in window]
        checks = start_restore(_verify, part)
        copies: list[torch.Tensor | None] = []
        for i, chunk in zip(window, part, strict=True):
            try:
                chunk.wait_read(chunk.header.num_layers)
            except ChunkError as exc:
                out[i] = exc
                copies.append(None)
                continue
            copies.append(chunk.payload.to(blocks.device, non_blocking=True) if self.on_cuda
                          else None)
        for i, error in zip(window, checks.result(), strict=True):
            out[i] = out[i] or error
        ok = [k for k, i in enumerate(window) if out[i] is None]
        kvs: dict[int, torch.Tensor] = {}
        lossy = [k for k in ok if part[k].header.lossy]
        if not self.on_cuda:  # a strided host cache: the verified chunk's KV, decoded natively
            kvs = {k: part[k].kv for k in ok}
        elif lossy:
            statuses = torch.zeros(len(lossy), dtype=torch.int32, device=blocks.device)
            kvs = {k: decode_on_device(part[k], copies[k], statuses[n : n + 1])  # type: ignore[arg-type]
                   for n, k in enumerate(lossy)}
            for k, error in zip(lossy, refuse_bad([part[k] for k in lossy], statuses), strict=True):
                out[window[k]] = error
        for k, i in enumerate(window):
            if out[i] is None:
                kv = kvs.get(k, copies[k])
                blocks.scatter(blocks.as_blocks(kv, moves[i].blocks), 0, moves[i])  # type: ignore[arg-type]


def _verify(chunk: LentChunk) -> ChunkError | None:
    try:
        chunk.verify()
    except ChunkError as exc:
        return exc
    return None
