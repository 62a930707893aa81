"""Cutting a Redis tier's batches into calls of at most ``max_batch_bytes``, each with a
deadline of its own: a batch of large chunks is not cut short on a loaded machine, while a
stalled server is still noticed. Reads of unknown sizes are budgeted by the largest chunk
seen so far."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.connectors.tiers.base import ChunkWrite

UNSEEN_CHUNK_BYTES = 1 << 20
"""What a read budgets per key before any chunk was seen."""


@dataclass
class BatchSizer:
    max_batch_bytes: int
    largest: int = 0
    """The largest chunk seen (0: none yet: reads are not split)."""

    def saw(self, nbytes: int | None) -> None:
        if nbytes is not None and nbytes > self.largest:
            self.largest = nbytes

    def writes(self, writes: Sequence[ChunkWrite]) -> list[list[ChunkWrite]]:
        """``writes`` in calls of at most ``max_batch_bytes`` (a bigger chunk goes alone)."""
        batches: list[list[ChunkWrite]] = [[]]
        size = 0
        for write in writes:
            self.saw(write.nbytes)
            if batches[-1] and size + write.nbytes > self.max_batch_bytes:
                batches.append([])
                size = 0
            batches[-1].append(write)
            size += write.nbytes
        return [b for b in batches if b]

    def keys(self, keys: Sequence[str]) -> list[Sequence[str]]:
        """``keys`` in reads of about ``max_batch_bytes`` each."""
        if not self.largest:
            return [keys]
        per = max(1, self.max_batch_bytes // self.largest)
        return [keys[i : i + per] for i in range(0, len(keys), per)] or [keys]

    def budget(self, n: int) -> int:
        """Bytes a read of ``n`` keys may move (its deadline's share)."""
        return n * (self.largest or UNSEEN_CHUNK_BYTES)
