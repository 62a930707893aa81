"""Physical block allocator: free lists, reference counts and the prefix cache.

The vLLM v1 model: a block whose reference count drops to zero keeps its content and its
hash, and stays findable in the prefix cache until the allocator needs it again. Free blocks
live in two places:

* ``_empty``: blocks with no cached content, a stack (batch pop is one slice);
* ``_evictable``: blocks whose content is still cached, in LRU order (oldest first).

Allocation takes empty blocks first and evicts cached ones only when it must, so a prefix
stays cached as long as memory allows. Every operation is O(1) per block, and a batch of n
blocks is one call.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import islice
from time import perf_counter_ns as _now

from kvtier.errors import InvalidArgumentError, OutOfBlocksError, PoolError
from kvtier.hashing import BlockHash


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0

_TIME_MASK = 15
"""One ``allocate`` call in 16 (the 1st, 17th ...) is timed for ``alloc_ns``: two clock
reads would otherwise cost more than a small allocation itself."""


class BlockPool:
    """Allocates block ids ``0 .. num_blocks-1``; holds no tensors."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise InvalidArgumentError(
                f"num_blocks must be a positive integer, got {num_blocks!r}; a pool needs "
                "at least one block (raise the memory budget or the block count)"
            )
        if not isinstance(block_size, int) or not is_power_of_two(block_size):
            raise InvalidArgumentError(
                f"block_size must be a power of two (1, 2, 4 ... 128), got {block_size!r}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref: list[int] = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        # Stack with the lowest id on top, so a fresh pool hands out 0, 1, 2 ...
        self._empty: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, int] = {}
        # Counters for stats; alloc_ns is estimated from sampled calls (see _TIME_MASK).
        self.alloc_calls = 0
        self.alloc_blocks = 0
        self._timed_ns = 0
        self._timed_blocks = 0
        self.evictions = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (empty plus cached-but-unreferenced)."""
        return len(self._empty) + len(self._evictable)

    @property
    def num_empty(self) -> int:
        """Blocks holding nothing (free without evicting any cached content)."""
        return len(self._empty)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks whose content is registered in the prefix cache (in use or free)."""
        return len(self._cached)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def alloc_ns(self) -> int:
        """Estimated ns spent in ``allocate`` so far: the per-block time of the timed calls
        times all blocks allocated."""
        if not self._timed_blocks:
            return 0
        return round(self._timed_ns * self.alloc_blocks / self._timed_blocks)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash[block_id]

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block holding content with this hash, if cached."""
        return self._cached.get(block_hash)

    def is_free(self, block_id: int) -> bool:
        return self._ref[block_id] == 0

    # -------------------------------------------------------------- mutations
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (reference count 1 each) or raise with nothing taken."""
        empty = self._empty
        calls = self.alloc_calls + 1
        if n.__class__ is not int or n <= 0 or n > len(empty) or calls & _TIME_MASK == 1:
            return self._allocate_slow(n)
        # Fast path: enough empty blocks, no eviction, not a timed call.
        self.alloc_calls = calls
        self.alloc_blocks += n
        if n == 1:
            b = empty.pop()
            self._ref[b] = 1
            return [b]
        blocks = empty[: -n - 1 : -1]
        del empty[-n:]
        ref = self._ref
        for b in blocks:
            ref[b] = 1
        return blocks

    def _allocate_slow(self, n: int) -> list[int]:
        """Argument checks, zero blocks, allocations that must evict cached blocks, and the
        timed sample of ``alloc_ns``."""
        if not isinstance(n, int) or n < 0:
            raise InvalidArgumentError(f"cannot allocate {n!r} blocks: the count must be >= 0")
        empty, evictable = self._empty, self._evictable
        free = len(empty) + len(evictable)
        if n > free:
            raise OutOfBlocksError(n, free)
        calls = self.alloc_calls + 1
        timed = calls & _TIME_MASK == 1
        t0 = _now() if timed else 0
        k = len(empty) if n > len(empty) else n
        if k:
            blocks = empty[: -k - 1 : -1]
            del empty[-k:]
        else:
            blocks = []
        m = n - k
        if m:
            # Oldest first; only canonical blocks carry a hash, so cached[h] is this block.
            if m == 1:
                b = next(iter(evictable))
                del evictable[b]
                victims = [b]
            else:
                victims = list(islice(evictable, m))
                if m == len(evictable):
                    evictable.clear()
                else:
                    for b in victims:
                        del evictable[b]
            cached, hashes = self._cached, self._hash
            for b in victims:
                del cached[hashes[b]]
                hashes[b] = None
            blocks += victims
            self.evictions += m
        ref = self._ref
        for b in blocks:
            ref[b] = 1
        if timed:
            self._timed_ns += _now() - t0
            self._timed_blocks += n
        self.alloc_calls = calls
        self.alloc_blocks += n
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block. Blocks reaching zero become free; cached ones
        enter the LRU in the order given (so pass tail blocks first to evict them first).
        An invalid id or a double free raises and frees nothing."""
        if blocks.__class__ is not list:
            blocks = list(blocks)
        ref, hashes, evictable, empty = self._ref, self._hash, self._evictable, self._empty
        n_empty = len(empty)
        push = empty.append
        bad = False
        try:
            for b in blocks:
                r = ref[b] - 1
                ref[b] = r
                if r == 0 and b >= 0:
                    if hashes[b] is None:
                        push(b)
                    else:
                        evictable[b] = None
                elif r < 0 or b < 0:  # double free, or a negative id indexing from the end
                    bad = True
        except (IndexError, TypeError):
            bad = True
        if bad:
            self._undo_free(blocks, n_empty)

    def _undo_free(self, blocks: list[int], n_empty: int) -> None:
        """Undo what a failed :meth:`free` did (rare, so not fast), then raise."""
        ref, evictable = self._ref, self._evictable
        del self._empty[n_empty:]
        for b in blocks:  # the same indexing as free(): stops where free() stopped
            try:
                ref[b] += 1
            except (IndexError, TypeError):
                break
            if b in evictable:  # none of the blocks being freed was free before
                del evictable[b]
        seen: dict[int, int] = {}
        for b in blocks:
            i = self._block_id(b, "free")
            seen[i] = seen.get(i, 0) + 1
            if seen[i] > ref[i]:
                raise PoolError(f"block {i} freed while not allocated (double free)")
        raise AssertionError("free() failed without an invalid or double-freed block")

    def _block_id(self, b: object, what: str) -> int:
        """``b`` as a valid block id, or a clear error (a negative id would silently index
        from the end of the Python lists)."""
        if b.__class__ is int and 0 <= b < self.num_blocks:  # type: ignore[operator]
            return b  # type: ignore[return-value]
        try:
            i = operator.index(b)  # type: ignore[arg-type]
        except TypeError:
            i = -1
        if not 0 <= i < self.num_blocks:
            raise InvalidArgumentError(
                f"cannot {what} block {b!r}: block ids are integers in [0, {self.num_blocks})"
            )
        return i

    def touch(self, blocks: Iterable[int]) -> None:
        """Add a reference to blocks found in the prefix cache or shared by a fork; a free
        cached block leaves the LRU. An invalid block raises and touches nothing."""
        blocks = [self._block_id(b, "touch") for b in blocks]
        ref, evictable = self._ref, self._evictable
        for b in blocks:
            if ref[b] == 0 and b not in evictable:
                raise PoolError(f"block {b} is free and holds no cached content")
        for b in blocks:
            if ref[b] == 0:
                del evictable[b]
            ref[b] += 1

    def free_after_touch(self, blocks: Sequence[int]) -> int:
        """How many free blocks would remain after touching ``blocks`` (for capacity checks)."""
        ref = self._ref
        return self.num_free - sum(1 for b in set(blocks) if ref[b] == 0)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full, computed block under its content hash. Returns False when prefix
        caching is off or another block already holds the same content (it stays canonical)."""
        if not self.enable_prefix_caching:
            return False
        block_id = self._block_id(block_id, "cache")
        if self._ref[block_id] <= 0:
            raise PoolError(f"block {block_id} cached while not allocated")
        if block_hash in self._cached or self._hash[block_id] is not None:
            return False
        self._hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    def uncache_block(self, block_id: int) -> None:
        """Forget a block's cached content (before it is modified in place)."""
        block_id = self._block_id(block_id, "uncache")
        h = self._hash[block_id]
        if h is None:
            return
        if self._cached.get(h) == block_id:
            del self._cached[h]
        self._hash[block_id] = None
        if self._ref[block_id] == 0:
            del self._evictable[block_id]
            self._empty.append(block_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no sequence uses; returns how many were dropped."""
        dropped = list(self._evictable)
        for b in dropped:
            self.uncache_block(b)
        return len(dropped)

    def check_invariants(self) -> None:
        """Full consistency scan (tests and debugging): free lists, hashes and refcounts agree."""
        empty, evictable = set(self._empty), set(self._evictable)
        assert len(empty) == len(self._empty), "duplicate block in the empty list"
        assert not empty & evictable, "block both empty and evictable"
        for b in range(self.num_blocks):
            free = self._ref[b] == 0
            assert self._ref[b] >= 0, f"negative refcount on block {b}"
            assert free == (b in empty or b in evictable), f"block {b} free-list mismatch"
            if b in evictable:
                assert self._hash[b] is not None, f"evictable block {b} without a hash"
            if b in empty:
                assert self._hash[b] is None, f"empty block {b} still has a hash"
        for h, b in self._cached.items():
            assert self._hash[b] == h, f"cache entry for block {b} disagrees with its hash"
        hashed = sum(h is not None for h in self._hash)
        assert hashed == len(self._cached), "a block carries a hash the cache does not map to it"
