"""Block tables for sequences on top of the :class:`BlockPool`.

Pure metadata, no tensors: it decides which physical block holds each token of each sequence,
shares full blocks through the prefix cache, shares everything on ``fork`` and asks for a
copy (copy-on-write) before a sequence appends into a block another sequence still uses.
The caller (``PagedKVPool``) performs the copies it returns.

Every mutating call checks capacity and arguments first, so an error leaves the manager
exactly as it was.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Hashable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from kvtier.errors import (
    InvalidArgumentError,
    OutOfBlocksError,
    SequenceExistsError,
    UnknownSequenceError,
)
from kvtier.gpu_pool.block_pool import BlockPool
from kvtier.hashing import BlockHash, chain_hash, chain_hashes

SeqId = Hashable


@dataclass
class Sequence:
    """One sequence's tokens and the blocks that hold their KV."""

    seq_id: SeqId
    token_ids: list[int]
    block_ids: list[int]
    extra: bytes = b""
    block_hashes: list[BlockHash] = field(default_factory=list)
    """Chained hashes of the leading full blocks whose KV is computed."""
    num_computed_tokens: int = 0
    """Tokens whose KV is in the pool (from the prefix cache or written by the caller)."""
    num_cached_tokens: int = 0
    """Tokens that the prefix cache supplied when the sequence was added."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class AddResult:
    num_cached_tokens: int
    """Leading tokens whose KV was found in the prefix cache; compute only the rest."""
    block_ids: list[int]


@dataclass(frozen=True)
class AppendResult:
    new_block_ids: list[int]
    copies: list[tuple[int, int]]
    """(src, dst) block copies the caller must perform before writing (copy-on-write)."""


class KVBlockManager:
    """Maps sequence ids to block tables over one :class:`BlockPool`."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        self._seqs: dict[SeqId, Sequence] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # ------------------------------------------------------------------ queries
    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def sequence(self, seq_id: SeqId) -> Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequenceError(seq_id) from None

    def sequences(self) -> Iterable[Sequence]:
        return self._seqs.values()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: Seq[int], extra: bytes = b"") -> list[int]:
        """Blocks holding the longest cached prefix of ``token_ids`` (full blocks only).
        Read-only: takes no references."""
        if not self.pool.enable_prefix_caching:
            return []
        blocks: list[int] = []
        parent: BlockHash | None = None
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = chain_hash(parent, token_ids[start : start + bs], extra)
            b = self.pool.lookup(parent)
            if b is None:
                break
            blocks.append(b)
        return blocks

    # -------------------------------------------------------------- mutations
    def add_sequence(self, seq_id: SeqId, token_ids: Seq[int], extra: bytes = b"") -> AddResult:
        """Create a sequence holding ``token_ids``: the cached prefix is shared, blocks for
        the rest are allocated. Only the cached prefix counts as computed."""
        if seq_id in self._seqs:
            raise SequenceExistsError(seq_id)
        tokens = _validated_tokens(token_ids)
        cached = self.match_prefix(tokens, extra)
        need = self.blocks_needed(len(tokens)) - len(cached)
        available = self.pool.free_after_touch(cached)
        if need > available:
            raise OutOfBlocksError(need, available, f"adding sequence {seq_id!r}")
        self.pool.touch(cached)
        blocks = cached + self.pool.allocate(need)
        n_cached = len(cached) * self.block_size
        hashes = [self.pool.block_hash(b) for b in cached]
        seq = Sequence(seq_id, tokens, blocks, extra, hashes, n_cached, n_cached)  # type: ignore[arg-type]
        self._seqs[seq_id] = seq
        self.prefix_query_tokens += len(tokens)
        self.prefix_hit_tokens += n_cached
        return AddResult(n_cached, list(blocks))

    def append_tokens(self, seq_id: SeqId, token_ids: Seq[int]) -> AppendResult:
        """Append tokens, allocating blocks on block boundaries. If the last block is
        partial and shared, it is replaced by a private copy first (copy-on-write)."""
        seq = self.sequence(seq_id)
        tokens = _validated_tokens(token_ids)
        if not tokens:
            return AppendResult([], [])
        bs = self.block_size
        n_old = seq.num_tokens
        partial = n_old % bs != 0
        cow = partial and self.pool.ref_count(seq.block_ids[-1]) > 1
        new = self.blocks_needed(n_old + len(tokens)) - len(seq.block_ids)
        need = new + (1 if cow else 0)
        if need > self.pool.num_free:
            raise OutOfBlocksError(need, self.pool.num_free, f"appending to sequence {seq_id!r}")
        copies: list[tuple[int, int]] = []
        fresh = self.pool.allocate(need) if need else []
        if cow:
            src = seq.block_ids[-1]
            dst = fresh.pop(0)
            self.pool.free([src])
            seq.block_ids[-1] = dst
            copies.append((src, dst))
        seq.block_ids.extend(fresh)
        seq.token_ids.extend(tokens)
        return AppendResult(fresh, copies)

    def mark_computed(self, seq_id: SeqId, num_tokens: int | None = None) -> None:
        """Record that KV for the first ``num_tokens`` tokens (default: all) is written, and
        publish the now-complete full blocks in the prefix cache."""
        seq = self.sequence(seq_id)
        n = seq.num_tokens if num_tokens is None else num_tokens
        if not isinstance(n, int) or n < 0 or n > seq.num_tokens:
            raise InvalidArgumentError(
                f"cannot mark {n!r} tokens computed for sequence {seq_id!r}: it holds "
                f"{seq.num_tokens} tokens"
            )
        if n <= seq.num_computed_tokens:
            return
        seq.num_computed_tokens = n
        bs = self.block_size
        start = len(seq.block_hashes) * bs
        end = n - n % bs
        if end <= start:
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i, h in enumerate(
            chain_hashes(seq.token_ids[start:end], bs, seq.extra, parent), start // bs
        ):
            seq.block_hashes.append(h)
            self.pool.cache_block(seq.block_ids[i], h)

    def fork(self, parent_id: SeqId, child_id: SeqId) -> Sequence:
        """A new sequence sharing all of the parent's blocks (copy-on-write on append)."""
        parent = self.sequence(parent_id)
        if child_id in self._seqs:
            raise SequenceExistsError(child_id)
        self.pool.touch(parent.block_ids)
        child = Sequence(
            child_id,
            list(parent.token_ids),
            list(parent.block_ids),
            parent.extra,
            list(parent.block_hashes),
            parent.num_computed_tokens,
            parent.num_cached_tokens,
        )
        self._seqs[child_id] = child
        return child

    def free_sequence(self, seq_id: SeqId) -> None:
        """Release a sequence's blocks; its tail blocks are the first to be evicted."""
        seq = self.sequence(seq_id)
        del self._seqs[seq_id]
        self.pool.free(reversed(seq.block_ids))

    # ------------------------------------------------------------- addressing
    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Physical slot (block * block_size + offset) of each token position in [start, end)."""
        seq = self.sequence(seq_id)
        if not (0 <= start <= end <= seq.num_tokens):
            raise InvalidArgumentError(
                f"positions [{start}, {end}) are outside sequence {seq_id!r} "
                f"of {seq.num_tokens} tokens"
            )
        bs, blocks = self.block_size, seq.block_ids
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]


def _validated_tokens(token_ids: Seq[int]) -> list[int]:
    """Plain Python ints in [0, 2**64) (numpy / torch integer scalars are accepted): the
    range chained hashing encodes, checked here so a bad id can never fail later inside
    ``mark_computed`` with the sequence half-updated."""
    try:
        tokens = [operator.index(t) for t in token_ids]
    except TypeError:
        raise InvalidArgumentError(
            f"token ids must be a sequence of integers, got {_preview(token_ids)}"
        ) from None
    try:
        array("Q", tokens)  # C-speed range check: raises on < 0 and >= 2**64
    except OverflowError:
        bad = next(t for t in tokens if not 0 <= t < 2**64)
        raise InvalidArgumentError(
            f"token ids must be non-negative integers below 2**64, got {bad}"
        ) from None
    return tokens


def _preview(token_ids: object) -> str:
    """A short repr of a bad ``token_ids`` argument, whatever its type."""
    if isinstance(token_ids, (list, tuple)):
        return repr(list(token_ids[:8])) + ("..." if len(token_ids) > 8 else "")
    return f"{type(token_ids).__name__} {token_ids!r:.60}"
