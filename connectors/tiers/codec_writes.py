"""Writes into a tier that keeps chunks encoded (``tiers.<tier>_codec``, issue 33).

A chunk on its way into such a tier (a demotion, a store, a promotion) is re-encoded by
the tier's codec, once: its KV decoded from whatever it holds, each layer encoded, new
checksums over the encoded bytes, the same key, model and tenant. What a chunk holds is
never made larger or, once lossy, re-encoded by the same codec, and an opaque chunk (a
client's bytes in a layout of its own, LMCache's) is never encoded: a lossy chunk goes into a
lossless tier as it is (the KV it gives back is already the decoded one), and into a tier
of another codec only where that codec's bytes are fewer. A chunk given as bytes (at
rest until now) is verified first, so re-encoding never blesses corrupted bytes with new
checksums; a chunk filled by its writer (a gather from the pool) is its writer's.

This is the torch reference: the KV crosses memory a few times (a decode, an encode);
fusing the encode into the store's gather is the fast path's job.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtier.chunk_format import (
    DTYPES,
    byte_view,
    decode_layers,
    encode_chunk,
    parse_header,
    validate_chunk,
)
from kvtier.connectors.tiers.base import ChunkWrite
from kvtier.connectors.tiers.host_buffers import StagingPool
from kvtier.errors import ChunkError
from kvtier.kv_codecs import Codec, layout


@dataclass
class EncodedWrites:
    writes: list[ChunkWrite] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    """key -> why it could not be encoded (``invalid: ...``: the bytes failed their checks)."""
    encoded: dict[str, EncodedChunk] = field(default_factory=dict)
    """key -> what encoding it made (the writes that were re-encoded here)."""


@dataclass(frozen=True)
class EncodedChunk:
    codec: str
    stored_bytes: int
    kv_bytes: int


def target_codec(current: str, tier_codec: Codec, shape: tuple[int, ...],
                 dtype: torch.dtype) -> Codec | None:
    """The codec a chunk holding ``current`` is re-encoded into for a tier of
    ``tier_codec``, or None: it goes in as it is."""
    if tier_codec is Codec.NONE or current == tier_codec.value:
        return None
    if current == Codec.NONE.value:
        return tier_codec
    now = layout(Codec(current), shape, dtype).nbytes
    return tier_codec if layout(tier_codec, shape, dtype).nbytes < now else None


def encode_writes(writes: Sequence[ChunkWrite], codec: Codec, staging: StagingPool
                  ) -> EncodedWrites:
    """``writes`` as the tier of ``codec`` stores them (see the module)."""
    out = EncodedWrites()
    if codec is Codec.NONE:
        out.writes = list(writes)
        return out
    for w in writes:
        try:
            if w.data is not None:
                got = _encoded(w, memoryview(w.data).cast("B"), codec, True)
            else:
                with staging.borrowed(w.nbytes) as buf:
                    n = w.write_into(buf)
                    got = _encoded(w, memoryview(buf[:n].numpy()), codec, False)
            out.writes.append(got[0])
            if got[1] is not None:
                out.encoded[w.key] = got[1]
        except ChunkError as exc:
            out.failed[w.key] = f"invalid: {exc}"
    return out


def _encoded(w: ChunkWrite, blob: memoryview, codec: Codec, verify: bool
             ) -> tuple[ChunkWrite, EncodedChunk | None]:
    header, offset = parse_header(blob)
    if verify:
        validate_chunk(blob, key=w.key)
    dtype = DTYPES[header.dtype]
    target = None if header.opaque else target_codec(header.codec, codec, tuple(header.shape), dtype)
    if target is None:
        same = w if w.data is not None else ChunkWrite.of_blob(w.key, bytes(blob), w.info)
        if header.lossy and header.codec == codec.value:  # its writer encoded it already
            kv_bytes = dtype.itemsize * math.prod(header.shape)
            return same, EncodedChunk(codec.value, len(blob), kv_bytes)
        return same, None
    if header.first_layer:
        raise ChunkError(f"chunk {header.key} holds layers from {header.first_layer}: "
                         "only whole chunks are re-encoded")
    payload = byte_view(blob[offset:])
    if header.lossy:
        kv = decode_layers(payload, header)
    else:
        kv = (payload if payload.storage_offset() % dtype.itemsize == 0 else payload.clone()
              ).view(dtype).view(header.shape)
    blob_out = encode_chunk(w.key, header.fingerprint, kv, target)
    kv_bytes = kv.numel() * kv.element_size()
    return (ChunkWrite.of_blob(w.key, blob_out, w.info),
            EncodedChunk(target.value, len(blob_out), kv_bytes))

