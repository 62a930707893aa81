"""Which version of a key the stack holds: chunks are immutable, one version per key.

A chunk key names content, so a second write of a key (an upload, a derive) is either the
same chunk again or another one, which is refused: storing it would leave two versions in
the stack (the new one in RAM, the old one on disk) and the old one would come back, every
check passing, once the new one left RAM. Two chunks are the same when their identities
(the header checksum: key, model, shape and every layer's checksum) are equal. A stored
copy that fails its checks is no version: every tier's copy is deleted.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.chunk_format import ChunkHeader
from kvtier.connectors.tiers.lent_chunk import LentChunk
from kvtier.connectors.tiers.manager import TierManager
from kvtier.errors import ChunkFormatError
from kvtier.kv_codecs import CODEC_NAMES as ANY_CODEC


@dataclass(frozen=True)
class StoredVersion:
    """The chunk a key holds: its header (verified) and the fastest tier holding it."""

    header: ChunkHeader
    tier: int

    def same_as(self, other: ChunkHeader) -> bool:
        return self.header.identity_checksum() == other.identity_checksum()


def stored_version(manager: TierManager, key: str) -> StoredVersion | None:
    """The version stored under ``key`` (any tier, any codec), every layer checked; None
    where none is, or only a copy that failed its checks (then every tier's copy is
    deleted). Call with the key's writers kept out (one writer of a key at a time)."""
    loc = manager.lookup([key], ANY_CODEC)
    if not loc.length:
        return None
    with manager.lease_chunks([key], loc, ANY_CODEC) as (stored,):
        header = None if stored is None else _verified_header(stored)
    if header is None:
        manager.delete([key])
        return None
    return StoredVersion(header, loc.tiers[0])


def _verified_header(stored: LentChunk) -> ChunkHeader | None:
    """The stored chunk's header once every layer passed its check; None when one failed
    (the chunk is dropped from its tier when the lease ends)."""
    try:
        stored.verify()
    except ChunkFormatError:
        return None
    return stored.header
