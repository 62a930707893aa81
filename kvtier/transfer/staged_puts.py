"""Storing chunks through staging buffers, for a tier that lends no memory of its own
(disk, Redis): each chunk is encoded into a reused staging buffer and the buffers go to the
tier in batches of about ``PUT_BATCH_BYTES`` (the disk tier writes from them, Redis sends
them), each batch on the putter thread while the next is encoded. No chunk-sized bytes
object is made, and at most about two batches of buffers are out at once."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvtier.connectors.tiers.base import ChunkWrite
from kvtier.connectors.tiers.chunk_workers import map_store
from kvtier.connectors.tiers.manager import PutReport, TierManager
from kvtier.policies.eviction import ChunkInfo
from kvtier.thread_start import thread_started
from kvtier.transfer.chunk_sources import ChunkSource

PUT_BATCH_BYTES = 128 << 20
"""Staged chunks are put in batches of about this many bytes, each while the next is being
encoded (a disk write or a Redis send overlaps the gather and checksums of the next)."""


@dataclass
class StagedResult:
    """What the staged puts stored: chunks, bytes, and the keys no tier took, with why."""

    stored: int = 0
    bytes: int = 0
    failed: dict[str, str] = field(default_factory=dict)


@dataclass
class _Batch:
    """One batch on its way: the put, its buffers (given back once it is done) and the
    encoded chunks it sends."""

    put: Future[PutReport]
    buffers: list[torch.Tensor]
    chunks: dict[str, memoryview]


class StagedPuts:
    def __init__(self, manager: TierManager, fingerprint: bytes) -> None:
        self.manager = manager
        self.fingerprint = fingerprint
        self._putter: ThreadPoolExecutor | None = None

    def put(self, sources: dict[str, ChunkSource], tier: int | str,
            info: Callable[[str, int], ChunkInfo], staged: dict[str, torch.Tensor]
            ) -> StagedResult:
        """Encode and put every chunk (``info(key, nbytes)``: its eviction info). A chunk of
        ``staged`` already lies in that buffer at its place (a snapshot's)."""
        result = StagedResult()
        batches: list[_Batch] = []
        held: list[torch.Tensor] = []
        try:
            for keys in self._cut(sources):
                todo = [(k, *self._buffer(k, sources[k], staged, held)) for k in keys]
                encoded = map_store(lambda item: self._encoded(*item), todo)
                chunks = dict(zip(keys, encoded, strict=True))
                writes = [ChunkWrite.of_blob(k, b, info(k, len(b))) for k, b in chunks.items()]
                batches.append(_Batch(self._put_later(writes, tier), held, chunks))
                held = []
                while len(batches) > 1:  # one batch being put while the next is encoded
                    self._settle(batches.pop(0), result)
        finally:
            self._finish(held, batches, result)
        return result

    def _buffer(self, key: str, source: ChunkSource, staged: dict[str, torch.Tensor],
                held: list[torch.Tensor]) -> tuple[ChunkSource, torch.Tensor]:
        buf = staged.get(key)
        if buf is not None:
            return source.already_in_place(), buf
        buf = self.manager.staging.acquire(source.nbytes(key, self.fingerprint))
        held.append(buf)
        return source, buf

    def _encoded(self, key: str, source: ChunkSource, buf: torch.Tensor) -> memoryview:
        return memoryview(buf[: source.encode(key, self.fingerprint, buf)].numpy())

    def _cut(self, sources: dict[str, ChunkSource]) -> list[list[str]]:
        """The keys in order, cut into batches of about ``PUT_BATCH_BYTES``."""
        out: list[list[str]] = [[]]
        size = 0
        for key, source in sources.items():
            if size >= PUT_BATCH_BYTES:
                out.append([])
                size = 0
            out[-1].append(key)
            size += source.nbytes(key, self.fingerprint)
        return [b for b in out if b]

    def _put_later(self, writes: list[ChunkWrite], tier: int | str) -> Future[PutReport]:
        """Put one batch on the putter thread (batches in order), with the caller's I/O
        priority (a background store stays one there)."""
        if self._putter is None:
            self._putter = ThreadPoolExecutor(1, thread_name_prefix="kvtier-put",
                                              initializer=thread_started)
        return self._putter.submit(contextvars.copy_context().run, self.manager.store, writes, tier)

    def _settle(self, batch: _Batch, result: StagedResult) -> None:
        try:
            res = batch.put.result()
            result.failed.update(res.failed)
            result.stored += len(batch.chunks) - len(res.failed)
            result.bytes += sum(len(b) for k, b in batch.chunks.items() if k not in res.failed)
        finally:  # a put finishes before its buffers go back
            for buf in batch.buffers:
                self.manager.staging.release(buf)

    def _finish(self, held: list[torch.Tensor], batches: list[_Batch], result: StagedResult
                ) -> None:
        """Every batch settled, whatever another raised (re-raised after); buffers of a
        batch whose encoding failed go back."""
        for buf in held:
            self.manager.staging.release(buf)
        failure: BaseException | None = None
        for batch in batches:
            try:
                self._settle(batch, result)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                failure = failure or exc
        if failure is not None:
            raise failure

    def close(self) -> None:
        if self._putter is not None:
            self._putter.shutdown(wait=True)
            self._putter = None
