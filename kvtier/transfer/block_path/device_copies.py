"""The block path's device copies: a window of chunks at a time, checked where the bytes land.

A window's stored bytes cross to the device back to back, on a copy stream, into one of two
reused staging buffers (DMA from the lent host slots, which the host does not touch) while
the window before is checked and scattered; one hash launch checks every
layer of every chunk there against its stored xxh3, bit-exact with the host's
(:mod:`kvtier.gpu_pool.kernels.triton_xxh3`); a compressed chunk is decoded on the device;
one launch then copies every half-block piece of the window into the cache
(:mod:`kvtier.gpu_pool.kernels.triton_pieces`). Nothing waits for the check before the
scatter: the caller serves only the chunks before the first that failed, and the blocks of
that chunk and every later one are recomputed, so the bytes that landed there are
overwritten before attention reads them. The host's cores stay off the critical path.

A save mirrors it (:class:`DeviceGather`): a window of chunks' blocks gathered into staging
in one launch, hashed there in one more, then one copy per chunk into its host slot while
the next window is gathered; the host writes only the headers.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.chunk_format import DTYPES
from kvtier.connectors.tiers.lent_chunk import LentChunk
from kvtier.errors import ChunkFormatError
from kvtier.gpu_pool.kernels.api import DECODE_ERRORS, scatter_decoded
from kvtier.gpu_pool.kernels.triton_pieces import copy_pieces
from kvtier.gpu_pool.kernels.triton_xxh3 import check_ranges, xxh3_ranges
from kvtier.transfer.block_path.cache_blocks import CacheBlocks
from kvtier.transfer.block_path.pieces import Pieces

WINDOW_BYTES = 256 << 20
"""A window holds about this many bytes of device memory (stored bytes, and decoded KV for
compressed chunks); a restore alternates between two, kept for reuse by the thread: the
device memory it borrows beside the cache's."""
ALIGN = 256
"""Each chunk's place in the staging buffer starts on this boundary (wide words for the
piece copies)."""

_buffers = threading.local()
_interpreter = threading.Lock()
"""Triton's interpreter (device copies of a host cache, in tests) keeps one launch's state
in globals: its launches take turns."""


def _buffer(name: str, device: torch.device, nbytes: int) -> torch.Tensor:
    """This thread's reused device buffer ``name`` of at least ``nbytes`` (grown, never
    shrunk)."""
    key = (name, str(device))
    bufs = getattr(_buffers, "bufs", None)
    if bufs is None:
        bufs = _buffers.bufs = {}
    buf = bufs.get(key)
    if buf is None or buf.numel() < nbytes:
        buf = bufs[key] = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    return buf


def _tables(device: torch.device, *values: np.ndarray) -> list[torch.Tensor]:
    """int64 tables on the device, all in one copy (from pinned memory on CUDA: the copy
    is queued, the host goes on; torch's pinned allocator keeps the memory until it ran)."""
    arrays = [np.ascontiguousarray(v).reshape(-1).view(np.int64) for v in values]
    host = torch.from_numpy(np.concatenate(arrays) if arrays else np.empty(0, np.int64))
    if device.type == "cuda":
        dev = host.pin_memory().to(device, non_blocking=True)
    else:
        dev = host.to(device)
    out, at = [], 0
    for a in arrays:
        out.append(dev[at : at + len(a)])
        at += len(a)
    return out


def _word(*tables: np.ndarray) -> int:
    """The widest word (8, 4, 2 or 1 bytes) every address and length is a multiple of."""
    bits = np.uint64(0)
    for t in tables:
        if t.size:
            bits |= np.bitwise_or.reduce(t.reshape(-1))
    for word in (8, 4, 2):
        if int(bits) % word == 0:
            return word
    return 1


@dataclass(frozen=True)
class _Moves:
    """The pieces of one copy launch: addresses and lengths in words of ``word`` bytes."""

    srcs: np.ndarray
    dsts: np.ndarray
    words: np.ndarray
    word: int

    @classmethod
    def of(cls, srcs: np.ndarray, dsts: np.ndarray, lens: np.ndarray) -> _Moves:
        """Every piece with a nonzero length (uint64 device addresses, byte lengths)."""
        keep = lens > 0
        srcs, dsts, lens = srcs[keep], dsts[keep], lens[keep]
        word = _word(srcs, dsts, lens)
        return cls(srcs, dsts, lens // np.uint64(word), word)

    def launch(self, srcs: torch.Tensor, dsts: torch.Tensor, words: torch.Tensor) -> None:
        """The copy, given this move's tables on the device."""
        if len(self.words):
            copy_pieces(srcs, dsts, words, self.word, int(self.words.max()))


def move_pieces(srcs: np.ndarray, dsts: np.ndarray, lens: np.ndarray, device: torch.device) -> None:
    """One launch copying every piece with a nonzero length (uint64 tables of device
    addresses and byte lengths)."""
    moves = _Moves.of(srcs, dsts, lens)
    moves.launch(*_tables(device, moves.srcs, moves.dsts, moves.words))


@contextlib.contextmanager
def _synced(device: torch.device, wait: bool = True) -> Iterator[None]:
    """Whatever happens inside, every queued copy has finished on the way out (lent host
    memory may go once this returns; not ``wait``: the caller waits). On the host (the
    interpreter), one at a time."""
    if device.type != "cuda":
        with _interpreter:
            yield
        return
    try:
        yield
    finally:
        if wait:
            torch.cuda.current_stream(device).synchronize()


@dataclass
class _Staged:
    """One chunk of a window in the staging buffer."""

    index: int
    chunk: LentChunk
    plan: Pieces
    at: int
    """Its stored bytes' offset in the staging buffer."""
    nbytes: int


def scatter(chunks: Sequence[LentChunk], plans: Sequence[Pieces], cache: CacheBlocks
            ) -> tuple[int, str] | None:
    """The chunks into the cache along their plans, a window at a time; the first that
    failed (its index, why), or None. Every copy is done when this returns.

    On CUDA a window's copies to the device run on a copy stream into one of two staging
    buffers while the window before is checked and scattered on the current stream, and
    nothing is read back until the last window was queued: one wait per restore."""
    device = cache.device
    lanes = _Lanes(device)
    queued: list[tuple[list[_Staged], torch.Tensor, torch.Tensor]] = []
    stop: tuple[int, str] | None = None
    with _synced(device):
        for start, end in _windows(chunks, plans):
            staged, stop = _staged(chunks, plans, start, end)
            if staged:
                staging = lanes.stage(staged)
                queued.append((staged, *_check_and_scatter(staging, staged, cache)))
                lanes.queued()
            if stop is not None:
                break
    for staged, bad, statuses in queued:
        failed = _first_failure(staged, bad.cpu().numpy(), statuses.cpu().tolist())
        if failed is not None:
            return failed
    return stop


def _stored_bytes(chunk: LentChunk, plan: Pieces) -> int:
    return (plan.last - plan.first) * chunk.header.layer_nbytes


def _footprint(chunk: LentChunk, plan: Pieces) -> int:
    """Device bytes a chunk takes in a window: its stored bytes, and its KV decoded."""
    decoded = plan.layer_bytes * (plan.last - plan.first) if chunk.header.lossy else 0
    return _stored_bytes(chunk, plan) + decoded


def _windows(chunks: Sequence[LentChunk], plans: Sequence[Pieces]) -> list[tuple[int, int]]:
    """Consecutive chunks of about :data:`WINDOW_BYTES` of device memory (stored bytes, and
    decoded KV for compressed chunks; at least one chunk each)."""
    out, start, size = [], 0, 0
    for i, (chunk, plan) in enumerate(zip(chunks, plans, strict=True)):
        if i > start and size + _footprint(chunk, plan) > WINDOW_BYTES:
            out.append((start, i))
            start, size = i, 0
        size += _footprint(chunk, plan)
    if start < len(chunks):
        out.append((start, len(chunks)))
    return out


def _staged(chunks: Sequence[LentChunk], plans: Sequence[Pieces], start: int, end: int
            ) -> tuple[list[_Staged], tuple[int, str] | None]:
    """The window's chunks as placed in staging, up to the first whose read failed."""
    staged: list[_Staged] = []
    at = 0
    for i in range(start, end):
        chunk, plan = chunks[i], plans[i]
        try:
            chunk.wait_read(plan.last)
        except ChunkFormatError as exc:
            return staged, (i, str(exc))
        n = _stored_bytes(chunk, plan)
        staged.append(_Staged(i, chunk, plan, at, n))
        at += -(-n // ALIGN) * ALIGN
    return staged, None


class _Lanes:
    """Two staging buffers a restore alternates between, and on CUDA the copy stream that
    fills one while the current stream checks and scatters the other."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.turn = 0
        self.copies = _copy_stream(device) if device.type == "cuda" else None
        self.used: dict[int, torch.cuda.Event] = {}
        if self.copies is not None:  # blocks just freed may still be read by queued kernels
            self.copies.wait_stream(torch.cuda.current_stream(device))

    def stage(self, staged: Sequence[_Staged]) -> torch.Tensor:
        """The window's stored bytes copied into the next staging buffer (queued once that
        buffer's last window was scattered; on CUDA the current stream waits for them)."""
        turn = self.turn
        last = staged[-1]
        staging = _buffer(f"load{turn}", self.device, last.at + last.nbytes)
        if self.copies is None:
            _copy_in(staging, staged)
            return staging
        if turn in self.used:
            self.copies.wait_event(self.used[turn])
        with torch.cuda.stream(self.copies):
            _copy_in(staging, staged)
        staging.record_stream(self.copies)
        torch.cuda.current_stream(self.device).wait_stream(self.copies)
        return staging

    def queued(self) -> None:
        """The current stream's work on the buffer just staged is queued: the copies into
        it next time wait for that work, not for anything after."""
        if self.copies is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.used[self.turn] = event
        self.turn ^= 1


def _copy_in(staging: torch.Tensor, staged: Sequence[_Staged]) -> None:
    for s in staged:
        step = s.chunk.header.layer_nbytes
        src = s.chunk.payload[s.plan.first * step : s.plan.last * step]
        staging[s.at : s.at + s.nbytes].copy_(src, non_blocking=True)


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's stream for copies to ``device``."""
    streams = getattr(_buffers, "streams", None)
    if streams is None:
        streams = _buffers.streams = {}
    stream = streams.get(str(device))
    if stream is None:
        stream = streams[str(device)] = torch.cuda.Stream(device)
    return stream


def _check_and_scatter(staging: torch.Tensor, staged: Sequence[_Staged], cache: CacheBlocks
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Queue the window's check (one hash launch), its decodes and its scatter (one
    launch), their tables crossing in one copy; the per-layer failure flags and per-chunk
    decode statuses (on the device, read once everything was queued)."""
    device = cache.device
    statuses = torch.zeros(len(staged), dtype=torch.int32, device=device)
    lossy = [s for s in staged if s.chunk.header.lossy]
    sizes = [-(-s.plan.layer_bytes * (s.plan.last - s.plan.first) // ALIGN) * ALIGN for s in lossy]
    decoded = _buffer("decoded", device, sum(sizes)) if lossy else staging
    places = dict(zip((s.index for s in lossy), np.cumsum([0, *sizes]).tolist(), strict=False))
    sources = [_decoded(s, staging, decoded[places[s.index]:], statuses[k : k + 1])
               if s.chunk.header.lossy else staging.data_ptr() + s.at
               for k, s in enumerate(staged)]
    moves = _Moves.of(
        np.concatenate([np.uint64(b) + s.plan.offsets.reshape(-1) for b, s in zip(sources, staged, strict=True)]),
        np.concatenate([s.plan.cache.reshape(-1) for s in staged]),
        np.concatenate([s.plan.lens.reshape(-1) for s in staged]))
    starts, lengths, expected = _ranges(staged)
    tables = _tables(device, starts, lengths, expected, moves.srcs, moves.dsts, moves.words)
    bad = check_ranges(staging, *tables[:3], host_ranges=(starts, lengths))
    moves.launch(*tables[3:])
    return bad, statuses


def _ranges(staged: Sequence[_Staged]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each staged layer's offset and length in staging and its stored xxh3 (int64 bits)."""
    starts, lengths, expected = [], [], []
    for s in staged:
        step = s.chunk.header.layer_nbytes
        layers = s.plan.last - s.plan.first
        starts.append(s.at + np.arange(layers, dtype=np.int64) * step)
        lengths.append(np.full(layers, step, dtype=np.int64))
        expected.append(np.array(s.chunk.header.layer_checksums[s.plan.first : s.plan.last],
                                 dtype=np.uint64).view(np.int64))
    return np.concatenate(starts), np.concatenate(lengths), np.concatenate(expected)


def _decoded(s: _Staged, staging: torch.Tensor, room: torch.Tensor, status: torch.Tensor) -> int:
    """A compressed chunk's staged layers decoded on the device into ``room`` (its KV in
    the chunk's byte order); its address. What only a foreign writer puts in a payload
    lands in ``status``."""
    _, two, tokens, heads, dim = s.chunk.header.shape
    n = s.plan.last - s.plan.first
    dtype = DTYPES[s.chunk.header.dtype]
    need = n * two * tokens * heads * dim * dtype.itemsize
    out = room[:need]
    kv = out.view(dtype).view(n, 1, two, tokens, heads, dim)
    scatter_decoded(staging[s.at : s.at + s.nbytes], s.chunk.header.codec, kv, [0],
                    tokens=tokens, status=status)
    return out.data_ptr()


def _first_failure(staged: Sequence[_Staged], bad: np.ndarray, statuses: list[int]
                   ) -> tuple[int, str] | None:
    """The first staged chunk whose check or decode failed (recorded on it, so its tier
    drops it), with why."""
    at = 0
    for s, status in zip(staged, statuses, strict=True):
        layers = s.plan.last - s.plan.first
        flags = np.nonzero(bad[at : at + layers])[0]
        at += layers
        try:
            if len(flags):
                s.chunk.fail(s.plan.first + int(flags[0]))
            if status:
                s.chunk.refuse(f"{s.chunk.header.codec} "
                               f"{DECODE_ERRORS.get(status, 'payload does not decode')}")
        except ChunkFormatError as exc:
            return s.index, str(exc)
    return None


@dataclass
class _Window:
    """A window of chunks gathered into device staging (and hashed there), waiting to be
    copied out chunk by chunk."""

    staging: torch.Tensor
    at: list[int]
    """Each chunk's offset in staging."""
    sums: torch.Tensor | None
    ready: torch.cuda.Event | None
    left: int
    host_sums: np.ndarray | None = None


class DeviceGather:
    """Chunks gathered out of a device cache a window at a time: one launch gathers every
    piece of a window's chunks into staging, one hashes every layer there, on the stream
    current when this was made; :meth:`into` copies one chunk out (on the caller's current
    stream, after the window is ready) while the next window is gathered. At most two
    windows live at once unless the chunks are asked for far out of order."""

    def __init__(self, cache: CacheBlocks, plans: Sequence[Pieces], hashed: bool) -> None:
        self.cache, self.plans, self.hashed = cache, plans, hashed
        device = cache.device
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.spans: list[tuple[int, int]] = []
        start, size = 0, 0
        for i, plan in enumerate(plans):
            n = int(plan.lens.sum())
            if i > start and size + n > WINDOW_BYTES:
                self.spans.append((start, i))
                start, size = i, 0
            size += -(-n // ALIGN) * ALIGN
        if plans:
            self.spans.append((start, len(plans)))
        self.window_of = [w for w, (a, b) in enumerate(self.spans) for _ in range(a, b)]
        self.live: dict[int, _Window] = {}
        self.finished: set[int] = set()
        """Windows whose every chunk was copied out (never gathered again ahead of time)."""
        self.lock = threading.Lock()

    def into(self, i: int, out: torch.Tensor) -> tuple[int, ...]:
        """Chunk ``i``'s bytes into ``out`` (a contiguous buffer of exactly them: a host slot,
        or memory on the device); its layers' xxh3 (waited for), or ``()`` where not
        hashed (the copy only queued on the caller's current stream)."""
        plan = self.plans[i]
        nbytes = int(plan.lens.sum())
        if nbytes != out.numel() * out.element_size() or not out.is_contiguous():
            raise ValueError(f"gather of {nbytes} bytes into {out.numel() * out.element_size()}")
        w = self.window_of[i]
        with self.lock:
            win = self._launched(w)
            if w + 1 < len(self.spans) and w + 1 not in self.finished:
                self._launched(w + 1)  # gathered while this window's chunks are copied out
        at = win.at[i - self.spans[w][0]]
        flat = out.view(-1).view(torch.uint8)
        device = self.cache.device
        with _synced(device, wait=self.hashed):
            if win.ready is not None:
                torch.cuda.current_stream(device).wait_event(win.ready)
                win.staging.record_stream(torch.cuda.current_stream(device))
            flat.copy_(win.staging[at : at + nbytes], non_blocking=True)
        sums: tuple[int, ...] = ()
        if self.hashed:
            with self.lock:
                if win.host_sums is None:
                    assert win.sums is not None
                    win.host_sums = win.sums.cpu().numpy().view(np.uint64)
                layers = plan.last - plan.first
                first = (i - self.spans[w][0]) * layers
                sums = tuple(int(x) for x in win.host_sums[first : first + layers])
        with self.lock:
            win.left -= 1
            if win.left == 0:
                self.live.pop(w, None)
                self.finished.add(w)
        return sums

    def _launched(self, w: int) -> _Window:
        """Window ``w``, its gather (and hash) queued now if they were not (under the lock)."""
        win = self.live.get(w)
        if win is not None:
            return win
        device = self.cache.device
        a, b = self.spans[w]
        sizes = [int(p.lens.sum()) for p in self.plans[a:b]]
        at = np.cumsum([0, *(-(-n // ALIGN) * ALIGN for n in sizes)]).tolist()
        context = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with context, _synced(device, wait=False):
            staging = torch.empty(max(at[-1], 1), dtype=torch.uint8, device=device)
            base = np.uint64(staging.data_ptr())
            moves = _Moves.of(np.concatenate([p.cache.reshape(-1) for p in self.plans[a:b]]),
                              np.concatenate([base + np.uint64(o) + p.offsets.reshape(-1)
                                              for o, p in zip(at, self.plans[a:b], strict=False)]),
                              np.concatenate([p.lens.reshape(-1) for p in self.plans[a:b]]))
            starts, lengths = _layer_ranges(self.plans[a:b], at)
            tables = _tables(device, moves.srcs, moves.dsts, moves.words, starts, lengths)
            moves.launch(*tables[:3])
            sums = (xxh3_ranges(staging, *tables[3:], host_ranges=(starts, lengths))
                    if self.hashed else None)
            ready = None
            if self.stream is not None:
                ready = torch.cuda.Event()
                ready.record(self.stream)
        win = self.live[w] = _Window(staging, at[:-1], sums, ready, b - a)
        return win


def _layer_ranges(plans: Sequence[Pieces], at: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Each layer's offset and length in a window's staging."""
    starts = np.concatenate([o + np.arange(p.last - p.first, dtype=np.int64) * p.layer_bytes
                             for o, p in zip(at, plans, strict=False)])
    lengths = np.concatenate([np.full(p.last - p.first, p.layer_bytes, dtype=np.int64)
                              for p in plans])
    return starts.astype(np.int64), lengths
