"""The block path's host copies: chunks checked and scattered, or gathered and hashed, by
the fused native kernels (each layer hashed while it is in cache from its copy, the GIL
released), or where they were not built, checked with the host hash and copied piece by
piece. A compressed chunk is checked and decoded straight into its blocks in one native
pass, or decoded into the worker's reused scratch and copied from there."""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.chunk_format import DTYPES
from kvtier.connectors.tiers.lent_chunk import LentChunk
from kvtier.errors import ChunkFormatError
from kvtier.gpu_pool.kernels import host_native
from kvtier.kv_codecs import Codec, layer_exponents_at, native_error, native_id
from kvtier.layer_sums import first_bad_layer, layer_sums
from kvtier.transfer.block_path.cache_blocks import CacheBlocks
from kvtier.transfer.block_path.pieces import Pieces

GROUP_BYTES = 4 << 20
"""A chunk still being read is checked and scattered this many bytes of layers at a time,
as its layers land."""
LOSSY_GROUP_BYTES = 256 << 10
"""Without the native decode, a compressed chunk is checked and decoded this many stored
bytes at a time into a scratch that stays in cache for the copy right after."""

_scratches = threading.local()


def scatter_whole(chunks: Sequence[LentChunk], pieces: Sequence[Pieces]) -> tuple[int, str] | None:
    """Whole chunks (read, exact, all of one size and block count) checked and scattered
    in order, in one native call; the first that failed (its index, why), after which
    nothing was copied."""
    if not host_native.AVAILABLE:
        for i, (chunk, plan) in enumerate(zip(chunks, pieces, strict=True)):
            failed = _scatter_checked_in_python(chunk, plan, plan.first, plan.last)
            if failed is not None:
                return i, failed
        return None
    first, last = pieces[0].first, pieces[0].last
    layers = last - first
    step = pieces[0].layer_bytes
    bases = np.array([c.payload.data_ptr() for c in chunks], dtype=np.uint64)
    starts = bases + np.uint64(first * step)
    segs = (starts[:, None] + np.arange(layers, dtype=np.uint64)[None, :] * np.uint64(step)).reshape(-1)
    expected = np.array([c.header.layer_checksums[first:last] for c in chunks], dtype=np.uint64).reshape(-1)
    srcs = np.concatenate([s + p.offsets.reshape(-1) for s, p in zip(starts, pieces, strict=True)])
    dsts = np.concatenate([p.cache.reshape(-1) for p in pieces])
    lens = np.concatenate([p.lens.reshape(-1) for p in pieces])
    bad = host_native.verify_scatter(segs, step, expected, srcs, dsts, lens, pieces[0].per_layer)
    if bad < 0:
        return None
    return bad // layers, _failed(chunks[bad // layers], first + bad % layers)


def scatter_reading(chunk: LentChunk, plan: Pieces) -> str | None:
    """An exact chunk still being read, checked and scattered a group of layers at a time
    as they land; why it failed, or None."""
    try:
        for a, b, _ in chunk.read_groups(GROUP_BYTES, start=plan.first, end=plan.last):
            part = _rows(plan, a, b)
            failed = scatter_whole([chunk], [part])
            if failed is not None:
                return failed[1]
    except ChunkFormatError as exc:
        return str(exc)
    return None


def scatter_lossy(chunk: LentChunk, plan: Pieces, cache: CacheBlocks) -> str | None:
    """A compressed chunk checked and decoded into its blocks; why it failed, or None."""
    header = chunk.header
    _, two, tokens, heads, dim = header.shape
    codec = Codec(header.codec)
    try:
        if host_native.CODEC_AVAILABLE and DTYPES[header.dtype] == cache.dtype:
            step = header.layer_nbytes
            at = layer_exponents_at(codec, (two, tokens, heads, dim), cache.dtype)
            rows = _decode_rows(plan, cache)
            group = LOSSY_GROUP_BYTES if chunk.reading is not None else 1 << 62
            for a, b, sums in chunk.read_groups(group, start=plan.first, end=plan.last):
                bad, status = host_native.verify_decode_pieces(
                    native_id(codec), cache.dtype, chunk.payload.data_ptr() + a * step, b - a,
                    step, at, (tokens, heads, dim), np.array(sums, dtype=np.uint64),
                    rows[a - plan.first : b - plan.first])
                if bad >= 0 and status > 0:  # its checksums passed: bytes no encoder writes
                    chunk.refuse(f"{codec.value} {native_error(status)} (layer {a + bad})")
                elif bad >= 0:
                    chunk.fail(a + bad)
            return None
        for a, b in chunk.checked_groups(LOSSY_GROUP_BYTES, start=plan.first, end=plan.last):
            kv = chunk.layer_kv(a, b, _scratch(chunk, b - a))
            _copy_pieces(kv.data_ptr(), _rows(plan, a, b))
    except ChunkFormatError as exc:
        why = str(exc)
        return why if header.key in why else f"chunk {header.key}: {why}"
    return None


def gather(pieces: Pieces, out: torch.Tensor) -> tuple[int, ...]:
    """The pieces copied one after another into ``out`` (a contiguous host buffer of
    their bytes: the chunk's payload, or the layers ``pieces`` covers); each layer's xxh3."""
    lens = pieces.lens.reshape(-1)
    if int(lens.sum()) != out.numel() * out.element_size() or not out.is_contiguous():
        raise ValueError(f"gather of {int(lens.sum())} bytes into {out.numel() * out.element_size()}")
    srcs = np.ascontiguousarray(pieces.cache.reshape(-1))
    if host_native.AVAILABLE:
        return tuple(host_native.gather_hash(out.data_ptr(), srcs, lens, pieces.per_layer).tolist())
    dst = out.data_ptr()
    for src, n in zip(srcs.tolist(), lens.tolist(), strict=True):
        ctypes.memmove(dst, src, n)
        dst += n
    return layer_sums(out.view(torch.uint8).numpy(), pieces.last - pieces.first)


class HostGather:
    """Chunks gathered out of a host cache, each when its slot is there (:meth:`into`: one
    fused native copy and hash per chunk, on the calling thread)."""

    def __init__(self, plans: Sequence[Pieces], hashed: bool) -> None:
        self.plans, self.hashed = plans, hashed

    def into(self, i: int, out: torch.Tensor) -> tuple[int, ...]:
        """Chunk ``i``'s bytes into ``out``; its layers' xxh3 (``()`` where not hashed)."""
        sums = gather(self.plans[i], out)
        return sums if self.hashed else ()


def _scatter_checked_in_python(chunk: LentChunk, plan: Pieces, a: int, b: int) -> str | None:
    """Without the native kernels: each layer checked with the host hash, then copied."""
    step = plan.layer_bytes
    payload = chunk.payload
    mem = payload[a * step : b * step].numpy()
    bad = first_bad_layer(mem, chunk.header.layer_checksums[a:b])
    good = b - a if bad < 0 else bad
    _copy_pieces(payload.data_ptr() + a * step, _rows(plan, a, a + good))
    return None if bad < 0 else _failed(chunk, a + bad)


def _copy_pieces(base: int, plan: Pieces) -> None:
    """Each piece copied from ``base`` + its offset to its cache address (Python; the
    paths without a native kernel)."""
    for off, dst, n in zip(plan.offsets.reshape(-1).tolist(), plan.cache.reshape(-1).tolist(),
                           plan.lens.reshape(-1).tolist(), strict=True):
        if n:
            ctypes.memmove(dst, base + off, n)


def _rows(plan: Pieces, a: int, b: int) -> Pieces:
    """The same plan cut to layers ``[a, b)`` (offsets from layer ``a``)."""
    i, j = a - plan.first, b - plan.first
    shift = np.uint64(i * plan.layer_bytes)
    return Pieces(plan.offsets[i:j] - shift, plan.cache[i:j], plan.lens[i:j], plan.layer_bytes, a, b)


def _decode_rows(plan: Pieces, cache: CacheBlocks) -> np.ndarray:
    """The native decode's rows ``[layers, pieces, 4]``: K/V half, first token, end token,
    destination, for the pieces that move."""
    layers, _, blocks = plan.lens.shape
    moved = plan.lens[0, 0] > 0
    tb, bs = np.uint64(cache.token_bytes), cache.block_tokens
    j = np.nonzero(moved)[0].astype(np.uint64)
    t0 = j * np.uint64(bs)
    t1 = t0 + plan.lens[0, 0][moved] // tb
    rows = np.empty((layers, 2, len(j), 4), dtype=np.uint64)
    rows[..., 0] = np.arange(2, dtype=np.uint64)[None, :, None]
    rows[..., 1] = t0[None, None, :]
    rows[..., 2] = t1[None, None, :]
    rows[..., 3] = plan.cache[:, :, moved]
    return rows.reshape(layers, 2 * len(j), 4)


def _scratch(chunk: LentChunk, layers: int) -> torch.Tensor:
    """This thread's reused buffer for ``layers`` decoded layers of ``chunk`` (grown,
    never shrunk: a restore faults in no fresh pages per chunk)."""
    _, two, tokens, heads, dim = chunk.header.shape
    shape = (layers, two, tokens, heads, dim)
    dtype = DTYPES[chunk.header.dtype]
    need = math.prod(shape) * dtype.itemsize
    buf = getattr(_scratches, "buf", None)
    if buf is None or buf.numel() < need:
        buf = _scratches.buf = torch.empty(need, dtype=torch.uint8)
    return buf[:need].view(dtype).view(shape)


def _failed(chunk: LentChunk, layer: int) -> str:
    """Record a failed check of ``layer`` on the chunk (its tier drops it); the reason."""
    try:
        chunk.fail(layer)
    except ChunkFormatError as exc:
        return str(exc)
    return f"chunk {chunk.header.key}: layer {layer} failed its check"
