"""Chained content hashes for KV blocks and chunks.

``h_i = H(h_{i-1}, tokens of block i, extra)``: a block's hash names the whole prefix up to and
including it, so equal hashes mean equal prefixes and identical prefixes dedupe everywhere.
BLAKE2b over a fixed binary encoding makes hashes stable across processes and machines
(Python's ``hash()`` is randomised per process and must never be used for this).
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Sequence

from kvtier.errors import InvalidArgumentError

BlockHash = bytes
HASH_BYTES = 32
_ROOT = b"\x00" * HASH_BYTES
TOKEN_BYTES = array("Q").itemsize
"""Bytes of one encoded token id (:func:`encode_tokens`)."""


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    # Unsigned: a negative id is rejected instead of silently encoded (ids < 2**63 encode to
    # the same bytes as a signed 64-bit array, so existing hashes are unchanged).
    try:
        return array("Q", token_ids).tobytes()
    except (TypeError, OverflowError) as exc:
        raise InvalidArgumentError(
            f"token ids must be integers in [0, 2**64), got {list(token_ids)[:8]}...: {exc}"
        ) from None


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as the hashes take them (unsigned 64-bit, little-endian here): encode a
    sequence once and hash any run of it with :func:`chain_hash_encoded`."""
    return _token_bytes(token_ids)


def chain_hash(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash of one block given its parent's hash (None for the first block)."""
    return chain_hash_encoded(parent, _token_bytes(token_ids), len(token_ids), extra)


def chain_hash_encoded(parent: BlockHash | None, token_bytes: bytes | memoryview, n_tokens: int,
                       extra: bytes = b"") -> BlockHash:
    """:func:`chain_hash` of ``n_tokens`` tokens already encoded (:func:`encode_tokens`):
    the hashes of a sequence's every prefix from one encoding of it."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(parent if parent is not None else _ROOT)
    h.update(n_tokens.to_bytes(4, "little"))
    h.update(token_bytes)
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    return h.digest()


def chain_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes = b"",
    parent: BlockHash | None = None,
    full_blocks_only: bool = True,
) -> list[BlockHash]:
    """Hashes of consecutive blocks of ``token_ids`` (full blocks only unless asked)."""
    if not isinstance(block_size, int) or block_size < 1:
        raise InvalidArgumentError(f"block_size must be a positive integer, got {block_size!r}")
    n = len(token_ids)
    end = n - n % block_size if full_blocks_only else n
    out: list[BlockHash] = []
    for start in range(0, end, block_size):
        parent = chain_hash(parent, token_ids[start : start + block_size], extra)
        out.append(parent)
    return out


def file_sha256(path: str | os.PathLike[str], piece: int = 8 << 20) -> str:
    """Hex SHA-256 of a file's contents, read in pieces (for files of any size)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(piece):
            h.update(data)
    return h.hexdigest()
