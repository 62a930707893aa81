"""A chunk made from a stored one, inside the store: a run of its tokens, every layer.

A writer that knows the store holds a chunk whose first tokens are the ones it would
upload (a vLLM connector: another conversation saved the segment a shared system prompt
ends inside) asks the store to cut them out instead (``derive``): no byte crosses from the
writer, and the tiers hold the new chunk under its own key, found by its own lookups.

Only exact KV is cut: a source stored lossy (a codec), opaque (a client's own layout) or
holding a layer range is refused, and the writer uploads its own blocks; never wrong KV.
The source is read as any lease reads it (checksums verified) and the new chunk's
checksums are computed over the bytes written. A key holds one version
(:mod:`.stored_versions`): a derive onto a key that holds the same chunk finds it
``PRESENT``, onto one holding another chunk is a ``CONFLICT``, as an upload of it would be.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch

from kvtier.chunk_format import DTYPES, chunk_layout, encode_into, parse_header
from kvtier.connectors.tiers.base import ChunkWrite
from kvtier.connectors.tiers.manager import TierManager
from kvtier.connectors.tiers.stored_versions import stored_version
from kvtier.errors import ChunkError, InvalidArgumentError
from kvtier.policies.eviction import ChunkInfo

EXACT = frozenset({"none"})


class Derived(enum.Enum):
    """What a derive did."""

    STORED = "stored"
    PRESENT = "present"
    """The new key holds this very chunk already (one version per key): nothing written."""
    CONFLICT = "conflict"
    """The new key holds another chunk (immutable: delete it first): nothing written."""
    NO_SOURCE = "no_source"
    """No exact copy of the source is stored (never stored, evicted, or only lossy)."""
    NOT_KV = "not_kv"
    """The source is not plain KV of its shape (opaque, or a layer range of a model)."""
    FAILED = "failed"
    """No tier could store the new chunk."""


@dataclass(frozen=True)
class TokenRange:
    """Tokens ``[first, first + count)`` of a chunk."""

    first: int
    count: int

    def __post_init__(self) -> None:
        if self.first < 0 or self.count < 1:
            raise InvalidArgumentError(f"token range [{self.first}, +{self.count}) is empty "
                                       "or starts below 0")


def derive_chunk(manager: TierManager, key: str, source: str, tokens: TokenRange,
                 info: ChunkInfo | None = None, tier: int = 0) -> Derived:
    """Store under ``key`` tokens ``tokens`` of the chunk ``source`` (keys as the tiers
    hold them: namespaced where a tenant's). An :class:`InvalidArgumentError` where the
    range runs past the source's tokens. Call with the key's writers kept out."""
    existing = stored_version(manager, key)
    with manager.lease_chunks([source], codecs=EXACT) as lent:
        chunk = lent[0]
        if chunk is None:
            return Derived.NO_SOURCE
        header = chunk.header
        if header.opaque or header.first_layer or header.lossy:
            return Derived.NOT_KV
        layers, two, total, heads, dim = header.shape
        if tokens.first + tokens.count > total:
            raise InvalidArgumentError(
                f"tokens [{tokens.first}, {tokens.first + tokens.count}) of chunk {source}, "
                f"which holds {total}")
        try:
            chunk.verify()
        except ChunkError:
            return Derived.NO_SOURCE  # dropped from its tier when the lease ends
        part = chunk.kv[:, :, tokens.first : tokens.first + tokens.count]
        shape = (layers, two, tokens.count, heads, dim)

        def fill(dest: torch.Tensor) -> int:
            return encode_into(dest, key, header.fingerprint, DTYPES[header.dtype], shape,
                               lambda kv: kv.copy_(part))

        nbytes = chunk_layout(key, header.fingerprint, DTYPES[header.dtype], shape)[1]
        if existing is not None:  # the same chunk, or another version of the key
            scratch = torch.empty(nbytes, dtype=torch.uint8)
            made = parse_header(scratch[: fill(scratch)].numpy())[0]
            return Derived.PRESENT if existing.same_as(made) else Derived.CONFLICT
        if info is not None:
            info = replace(info, nbytes=nbytes)
        report = manager.store([ChunkWrite(key, nbytes, fill=fill, info=info)], tier)
    if not report.ok:
        return Derived.FAILED
    stored = any(key in res.stored for res in report.per_tier.values())
    return Derived.STORED if stored else Derived.PRESENT

