"""One version per key: chunks are immutable once stored.

A chunk key names content (chained hashes of tokens and model), so a second PUT of a key is
either the same chunk again or a mistake. Storing it anyway left the stack with two
versions: the new one in RAM, the old one on disk, and the old one came back, every check
passing, once the new one left RAM (or after a restart). So a PUT of a key stored in any
tier is compared with the stored copy's identity (the header checksum, which covers the
key, the model, the shape and every layer's checksum): the same chunk is ``present``
(200, nothing written), another one a 409 (``DELETE`` it first to replace it). A stored
copy that fails its checks is no version: every tier's copy is deleted and the new chunk
stored. Concurrent PUTs of one key are serialised (:class:`KeyLocks`), so two writers
cannot both find the key absent and leave one version each.
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum

from kvtier.chunk_format import ChunkHeader, logical_key
from kvtier.connectors.tiers.manager import TierManager
from kvtier.connectors.tiers.stored_versions import stored_version
from kvtier.server.errors import RouteError


class Version(Enum):
    """How an upload relates to what the stack holds under its key."""

    NEW = "new"
    """Not stored (or only a copy that failed its checks, now deleted): store it."""
    SAME = "same"
    """The same chunk is stored already: nothing to write."""


@dataclass(frozen=True)
class Settled:
    version: Version
    tier: str | None = None
    """Where the same chunk is stored (``SAME``)."""


class KeyLocks:
    """Striped locks: PUTs of one key run one at a time (different keys rarely wait).
    Reentrant, so a worker holding a key's lock may call a helper that takes it again."""

    def __init__(self, stripes: int = 256) -> None:
        self._locks = [threading.RLock() for _ in range(stripes)]

    def _stripe(self, key: str) -> int:
        return zlib.crc32(key.encode()) % len(self._locks)

    @contextlib.contextmanager
    def holding(self, keys: Iterable[str]) -> Iterator[None]:
        stripes = sorted({self._stripe(k) for k in keys})  # one order: no deadlock
        with contextlib.ExitStack() as stack:
            for s in stripes:
                stack.enter_context(self._locks[s])
            yield


def settle(manager: TierManager, where: str, upload: ChunkHeader) -> Settled:
    """Whether ``upload`` (verified, to be stored under ``where``) is new, the chunk already
    stored, or (409) another version of a stored key. Call with the key's lock held."""
    stored = stored_version(manager, where)  # a copy that fails its checks is none
    if stored is None:
        return Settled(Version.NEW)
    if stored.same_as(upload):
        return Settled(Version.SAME, manager.tiers[stored.tier].name)
    raise RouteError(409, f"chunk {logical_key(where)} is stored already with other content; "
                     "chunks are immutable: DELETE it first to replace it", "chunk_exists")
