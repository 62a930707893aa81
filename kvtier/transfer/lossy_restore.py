"""Restoring compressed chunks into a host pool (issue 33): one native pass per chunk that
checks each layer's stored bytes and decodes them straight into the pool's blocks, or,
where that kernel does not apply (a GPU pool, no native build), each checked group of
layers decoded into the restore worker's reused scratch and copied on."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch

from kvtier.chunk_format import DTYPES
from kvtier.connectors.tiers.lent_chunk import LentChunk
from kvtier.gpu_pool.kernels import host_native
from kvtier.gpu_pool.kernels.host_native import scatter_decoded_verified
from kvtier.kv_codecs import Codec, layer_exponents_at, native_error, native_id

LOSSY_GROUP_BYTES = 256 << 10
"""A lossy chunk is checked and decoded this many stored bytes at a time, into a scratch
buffer of the restore worker's that stays in cache for the scatter right after."""

_scratches = threading.local()


def decode_scratch(part: LentChunk, layers: int) -> torch.Tensor:
    """This thread's reused buffer for ``layers`` decoded layers of ``part`` (grown, never
    shrunk: a restore faults in no fresh pages per chunk)."""
    _, two, tokens, heads, dim = part.header.shape
    shape = (layers, two, tokens, heads, dim)
    dtype = DTYPES[part.header.dtype]
    need = math.prod(shape) * dtype.itemsize
    buf = getattr(_scratches, "buf", None)
    if buf is None or buf.numel() < need:
        buf = _scratches.buf = torch.empty(need, dtype=torch.uint8)
    return buf[:need].view(dtype).view(shape)


def fused_decode(part: LentChunk, kv: torch.Tensor) -> bool:
    """Whether a lossy chunk is checked, decoded and scattered into the pool by one native
    pass (a host pool of the chunk's dtype), else decoded into a scratch and copied."""
    return (host_native.CODEC_AVAILABLE and not kv.is_cuda
            and DTYPES[part.header.dtype] == kv.dtype)


def scatter_lossy(part: LentChunk, first: int, end: int, offset: int, kv: torch.Tensor,
                  block_ids: Sequence[int]) -> None:
    """Layers ``first``..``end`` of a lossy chunk into ``block_ids`` of the host pool
    ``kv`` (``[layers, blocks, 2, block_size, H, D]``), its tokens from ``offset`` on: each
    layer checked, then decoded in place (a chunk in memory in one call; one still being
    read, group by group as its layers land). A failed check or decode is recorded on the
    chunk and raised (:class:`ChunkFormatError`)."""
    header = part.header
    _, _, tokens, heads, dim = header.shape
    codec = Codec(header.codec)
    step = header.layer_nbytes
    at = layer_exponents_at(codec, (2, tokens, heads, dim), kv.dtype)
    group = LOSSY_GROUP_BYTES if part.reading is not None else 1 << 62
    for a, b, sums in part.read_groups(group, start=first, end=end):
        bad, status = scatter_decoded_verified(part.payload[a * step : b * step],
                                               native_id(codec), sums, offset, kv[a:b],
                                               block_ids, tokens, at)
        if bad >= 0 and status > 0:  # checksums passed: bytes no encoder writes
            part.refuse(f"{codec.value} {native_error(status)} (layer {a + bad})")
        elif bad >= 0:
            part.fail(a + bad)
