"""A whole chunk lent before its checksums are read: the one place a read is verified.

Every chunk a tier lends reaches its reader as a :class:`LentChunk` whose key, model and
length were checked; its per-layer checksums are checked by :meth:`LentChunk.check` (or a
fused kernel that compares as it copies, :meth:`LentChunk.read_groups`), once per read,
by the reader that uses the bytes: a restore group by group, a blob reader all at once
(:meth:`LentChunk.verify`).

A restore that verifies a whole chunk and then scatters it reads every byte from memory
twice; checking a group of layers and copying it at once reads it once, the second pass
hitting the cache (about a third faster on a 2-core host, docs/performance.md). The key,
model and length are checked before the chunk is lent, as for any lease; only the
per-layer checksums wait for :meth:`LentChunk.check`, and no byte of a layer may be used
before its check passed. A failed check is remembered: the manager drops the chunk from
its tier once the lease ends, as it does a chunk that fails up front.

A chunk may also be lent while its tier still reads it (:class:`ReadingBuffer`: the disk
tier reads the head of every chunk first, header and first layer, the rest in the
background), so
that scattering one chunk overlaps reading the next; :meth:`LentChunk.check` then waits
for the layers it checks to have landed, and a read that fails is a failed check.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from functools import cached_property

import torch

from kvtier.chunk_format import DTYPES, ChunkHeader, check_layers, decode_layers, range_header
from kvtier.errors import ChunkFormatError


@dataclass
class ReadingBuffer:
    """A chunk's buffer whose bytes are still being read into it: the header and the first
    ``ready_bytes`` bytes are there; the rest are there once ``done`` is True (False or an
    exception: the read failed, and those bytes must never be used)."""

    buf: torch.Tensor
    ready_bytes: int
    done: Future[bool]


@dataclass(eq=False)
class LentChunk:
    buf: torch.Tensor
    """The whole chunk's bytes (uint8, header and payload), in the tier's lent memory."""
    header: ChunkHeader
    error: ChunkFormatError | None = None
    """The first failed check, if any."""
    reading: ReadingBuffer | None = None
    """Where the tier still reads the chunk's later layers (None: all read)."""

    @property
    def payload(self) -> torch.Tensor:
        """The payload's bytes (uint8, a view of ``buf``)."""
        return self.buf[self.buf.numel() - self.header.payload_nbytes :]

    @cached_property
    def kv(self) -> torch.Tensor:
        """The chunk's KV ``[layers, 2, tokens, heads, dim]``: a view of the lent buffer
        (a copy for an older chunk whose payload is not aligned for its dtype, taken once
        every layer was read; the decoded KV of a lossy chunk, whose layers are still
        checked by the reader before it uses them: bytes no encoder writes are a failed
        check)."""
        payload, dtype = self.payload, DTYPES[self.header.dtype]
        if self.header.lossy:
            try:
                self._wait(self.header.num_layers)
                return decode_layers(payload, self.header)
            except ChunkFormatError as exc:
                self.error = self.error or exc
                raise
        if payload.storage_offset() % dtype.itemsize:
            self._wait(self.header.num_layers)
            payload = payload.clone()
        return payload.view(dtype).view(self.header.shape)

    def layer_kv(self, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Layers ``[start, end)`` of the KV (the caller checked them first): a view of the
        lent buffer, or for a lossy chunk those layers decoded into ``out`` (contiguous,
        ``[end - start, 2, tokens, heads, dim]``: a reused scratch) or a new tensor."""
        if not self.header.lossy:
            return self.kv[start:end]
        self._wait(end)
        part = range_header(self.header, (start, end))
        step = self.header.layer_nbytes
        payload = self.payload[start * step : end * step]
        try:
            return decode_layers(payload, part, out)
        except ChunkFormatError as exc:
            self.error = self.error or exc
            raise

    def kv_nbytes(self, start: int = 0) -> int:
        """Bytes of KV (decoded) in layers ``start``..: what a restore of them delivers."""
        _, two, tokens, heads, dim = self.header.shape
        n = (self.header.num_layers - start) * two * tokens * heads * dim
        return n * DTYPES[self.header.dtype].itemsize

    def verify(self) -> None:
        """Check every layer (a reader that uses the whole chunk at once)."""
        self.check(0, self.header.num_layers)

    def check(self, start: int, end: int) -> None:
        """Verify layers ``[start, end)``, once they have been read; raises
        :class:`ChunkFormatError` on a mismatch or a failed read."""
        try:
            self._wait(end)
            check_layers(self.buf, self.header, start, end)
        except ChunkFormatError as exc:
            self.error = self.error or exc
            raise

    def checked_groups(self, group_bytes: int, start: int = 0, end: int | None = None
                       ) -> Iterator[tuple[int, int]]:
        """Layer ranges ``[a, b)`` of about ``group_bytes`` from ``start`` to ``end`` (default:
        the last layer), each yielded only once :meth:`check` passed on it, so a reader
        copies each group while it is still in cache; a failed check raises
        :class:`ChunkFormatError` before its group is yielded."""
        for a, b in self._groups(group_bytes, start, end):
            self.check(a, b)
            yield a, b

    def read_groups(self, group_bytes: int, start: int = 0, end: int | None = None
                    ) -> Iterator[tuple[int, int, tuple[int, ...]]]:
        """For a reader that checks as it copies (a fused native kernel), of a chunk lent
        unchecked (``buf`` and ``header`` set): layer ranges ``[a, b)`` as
        :meth:`checked_groups` cuts them, each yielded once its bytes were read but
        *unchecked*, with the checksums its layers must have. The reader must compare
        before using a byte and report a mismatch with :meth:`fail`; a failed read raises
        :class:`ChunkFormatError` here."""
        for a, b in self._groups(group_bytes, start, end):
            self.wait_read(b)
            yield a, b, self.header.layer_checksums[a:b]

    def wait_read(self, end: int) -> None:
        """Wait until layers ``[0, end)`` were read (unchecked: for a reader that copies
        them on and checks them beside the copy, never using them before the check passed);
        a failed read raises :class:`ChunkFormatError`."""
        try:
            self._wait(end)
        except ChunkFormatError as exc:
            self.error = self.error or exc
            raise

    def fail(self, layer: int) -> None:
        """Record that ``layer`` failed its checksum (found by the reader) and raise."""
        exc = ChunkFormatError(
            f"chunk {self.header.key}: checksum mismatch in layer {layer} (corrupted bytes)")
        self.error = self.error or exc
        raise exc

    def refuse(self, reason: str) -> None:
        """Record that the chunk's checked bytes do not decode (bytes no encoder writes,
        found by the reader) and raise: it is dropped as a corrupt one is."""
        exc = ChunkFormatError(f"chunk {self.header.key}: {reason}")
        self.error = self.error or exc
        raise exc

    def _groups(self, group_bytes: int, start: int, end: int | None) -> Iterator[tuple[int, int]]:
        layers, step = self.header.num_layers, self.header.layer_nbytes
        end = layers if end is None else end
        per = max(1, group_bytes // max(step, 1))
        for a in range(start, end, per):
            yield a, min(a + per, end)

    def _wait(self, end: int) -> None:
        """Wait until layers ``[0, end)`` lie in the buffer."""
        reading, header = self.reading, self.header
        if reading is None:
            return
        payload_at = self.buf.numel() - header.payload_nbytes
        if payload_at + end * header.layer_nbytes <= reading.ready_bytes:
            return
        try:
            ok = reading.done.result()
        except Exception as exc:  # noqa: BLE001 - an I/O error is a chunk that cannot be used
            raise ChunkFormatError(f"chunk {header.key}: read failed: {exc}") from exc
        if not ok:
            raise ChunkFormatError(f"chunk {header.key}: file ended early (truncated)")
        self.reading = None
