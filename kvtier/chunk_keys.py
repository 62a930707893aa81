"""Chunk keys: chained content hashes over ``chunk_tokens``-token chunks of a sequence.

``key_i = H(key_{i-1}, tokens of chunk i, model fingerprint)`` names the whole prefix, so
identical prefixes (system prompts, shared documents) dedupe across sessions in every tier,
and KV of another model can never match. A session's last, partial chunk (the tail) is keyed
the same way plus a tail marker; its key carries its length, and it is never shared with a
full chunk.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import InvalidArgumentError
from kvtier.hashing import chain_hash

TAIL_MARKER = b"|tail"
KEY_PATTERN = r"^[0-9A-Za-z_-]{2,200}$"
"""What a tier accepts as a chunk key: safe as a file name, a Redis key and a URL segment
(kvtier's own keys are hex digests; a connector may key chunks its own way)."""
KEY_RE = re.compile(KEY_PATTERN)
"""Use ``KEY_RE.fullmatch``: with ``match``, ``$`` also matches before a final newline."""


@dataclass(frozen=True)
class ChunkKey:
    key: str
    """Hex digest: safe as a file name and a Redis key."""
    start: int
    end: int
    is_tail: bool = False

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def chunk_keys(
    token_ids: Sequence[int], chunk_tokens: int, fingerprint: bytes, include_tail: bool = True
) -> list[ChunkKey]:
    """Keys of every full chunk of ``token_ids``, then of the tail (if any and asked)."""
    if chunk_tokens < 1:
        raise InvalidArgumentError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    out: list[ChunkKey] = []
    parent: bytes | None = None
    n = len(token_ids)
    full = n - n % chunk_tokens
    for start in range(0, full, chunk_tokens):
        parent = chain_hash(parent, token_ids[start : start + chunk_tokens], fingerprint)
        out.append(ChunkKey(parent.hex(), start, start + chunk_tokens))
    if include_tail and full < n:
        h = chain_hash(parent, token_ids[full:], fingerprint + TAIL_MARKER)
        out.append(ChunkKey(h.hex(), full, n, is_tail=True))
    return out
