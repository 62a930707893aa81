"""Which cache blocks a chunk's blocks go to, or come from: the block path's one span type."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockSpan:
    """Block ``j`` of a chunk (``block_tokens`` tokens from token ``j * block_tokens``)
    goes to, or comes from, cache block ``blocks[j]``; None leaves it alone (blocks the
    cache holds already: a pool's cached prefix, blocks vLLM computed)."""

    blocks: tuple[int | None, ...]

    @classmethod
    def of(cls, blocks: Sequence[int | None], skip: int = 0) -> BlockSpan:
        """``blocks`` after ``skip`` chunk blocks left alone."""
        return cls((None,) * skip + tuple(blocks))

    @property
    def moved(self) -> int:
        """Blocks this span moves."""
        return sum(b is not None for b in self.blocks)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The chunk's block indices that move, and their cache blocks (int64)."""
        pairs = [(j, b) for j, b in enumerate(self.blocks) if b is not None]
        js = np.array([j for j, _ in pairs], dtype=np.int64)
        ids = np.array([b for _, b in pairs], dtype=np.int64)
        return js, ids
