"""A whole chunk lent before its checksums are read, for a reader that checks each group
of layers right before it copies them.

A restore that verifies a whole chunk and then scatters it reads every byte from memory
twice; checking a group of layers and copying it at once reads it once, the second pass
hitting the cache (about a third faster on a 2-core host, docs/performance.md). The key,
model and length are checked before the chunk is lent, as for any lease; only the
per-layer checksums wait for :meth:`LentChunk.check`, and no byte of a layer may be used
before its check passed. A failed check is remembered: the manager drops the chunk from
its tier once the lease ends, as it does a chunk that fails up front.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.chunk_format import ChunkHeader, check_layers
from kvtier.errors import ChunkFormatError


@dataclass
class LentChunk:
    kv: torch.Tensor
    """The chunk's KV ``[layers, 2, tokens, heads, dim]``, a view of the lent buffer."""
    buf: torch.Tensor | None = None
    """The whole chunk's bytes to check against; None: verified already (read through a
    tier's ``get``, which verifies)."""
    header: ChunkHeader | None = None
    error: ChunkFormatError | None = None
    """The first failed check, if any."""

    def check(self, start: int, end: int) -> None:
        """Verify layers ``[start, end)``; raises :class:`ChunkFormatError` on a mismatch."""
        if self.buf is None or self.header is None:
            return
        try:
            check_layers(self.buf, self.header, start, end)
        except ChunkFormatError as exc:
            self.error = self.error or exc
            raise
