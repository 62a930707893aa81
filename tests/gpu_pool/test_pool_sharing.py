"""The paged pool's sharing rules on explicit examples: copy-on-write after fork, no prefix
hits with caching off, and the eviction order of the prefix cache (empty blocks first, then
LRU, tail blocks first).
"""

from __future__ import annotations

import pytest

from kvtier.gpu_pool import PagedKVPool
from tests.gpu_pool.pool_cases import make_pool, write_and_compute


def read(pool: PagedKVPool, seq_id: object) -> list[float]:
    """K of layer 1 / head 0 / dim 0 at each position, read through the block table."""
    seq = pool.sequence(seq_id)
    bs = pool.block_size
    slots = pool.slot_mapping(seq_id, 0, seq.num_tokens).tolist()
    return [pool.storage.kv[1, s // bs, 0, s % bs, 0, 0].item() for s in slots]



# ------------------------------------------------------------------ copy-on-write
def test_fork_then_append_on_each_side_copies_on_write() -> None:
    pool = make_pool(num_blocks=8, block_size=4)
    pool.add_sequence("p", [1, 2, 3, 4, 5, 6])
    write_and_compute(pool, "p", 100.0)
    child = pool.fork("p", "c")
    assert child.block_ids == pool.sequence("p").block_ids
    assert child.num_computed_tokens == 6
    shared_tail = child.block_ids[-1]
    assert pool.block_pool.ref_count(shared_tail) == 2

    res = pool.append_tokens("p", [7])
    p_tail = pool.sequence("p").block_ids[-1]
    assert res.copies == [(shared_tail, p_tail)] and p_tail != shared_tail
    assert pool.block_pool.ref_count(shared_tail) == 1  # now the child's alone
    assert read(pool, "p")[:6] == [100.0 + i for i in range(6)]  # the copy carried the KV
    write_and_compute(pool, "p", 200.0)

    res = pool.append_tokens("c", [8])
    assert res.copies == []  # the child's block is no longer shared: written in place
    assert pool.sequence("c").block_ids[-1] == shared_tail
    write_and_compute(pool, "c", 300.0)

    assert read(pool, "p") == [100.0 + i for i in range(6)] + [206.0]
    assert read(pool, "c") == [100.0 + i for i in range(6)] + [306.0]
    # The full first block is still shared, its KV written once before the fork.
    assert pool.sequence("p").block_ids[0] == pool.sequence("c").block_ids[0]
    assert pool.block_pool.ref_count(pool.sequence("p").block_ids[0]) == 2
    pool.free_sequence("p")
    pool.free_sequence("c")
    assert pool.block_pool.num_free == 8
    pool.block_pool.check_invariants()


def test_append_into_shared_partial_block_spanning_blocks() -> None:
    """An append that fills the copied block and needs more gets copy + new blocks."""
    pool = make_pool(num_blocks=8, block_size=4)
    pool.add_sequence("p", [1, 2])
    write_and_compute(pool, "p", 0.0)
    pool.fork("p", "c")
    res = pool.append_tokens("c", [3, 4, 5, 6, 7])
    c_blocks = pool.sequence("c").block_ids
    assert len(c_blocks) == 2 and res.new_block_ids == c_blocks[1:]
    assert res.copies == [(pool.sequence("p").block_ids[0], c_blocks[0])]
    assert read(pool, "c")[:2] == [0.0, 1.0]
    assert pool.block_pool.num_free == 8 - 3


# ---------------------------------------------------------------- prefix caching
def test_prefix_caching_disabled_gives_no_hits() -> None:
    pool = make_pool(caching=False)
    tokens = list(range(12))
    pool.add_sequence("a", tokens)
    write_and_compute(pool, "a", 0.0)
    assert pool.block_pool.num_cached == 0
    assert pool.manager.match_prefix(tokens) == []
    pool.free_sequence("a")
    assert pool.add_sequence("b", tokens).num_cached_tokens == 0
    assert pool.block_pool.num_evictable == 0
    assert pool.stats().prefix_hit_rate == 0.0
    assert pool.block_pool.cache_block(pool.sequence("b").block_ids[0], b"x" * 32) is False


def test_prefix_hit_after_free_reuses_the_same_blocks() -> None:
    pool = make_pool(num_blocks=8, block_size=4)
    tokens = list(range(10))
    pool.add_sequence("a", tokens)
    write_and_compute(pool, "a", 50.0)
    a_blocks = list(pool.sequence("a").block_ids)
    pool.free_sequence("a")
    res = pool.add_sequence("b", tokens + [99])
    assert res.num_cached_tokens == 8  # two full blocks; the partial third is recomputed
    assert res.block_ids[:2] == a_blocks[:2]
    assert read(pool, "b")[:8] == [50.0 + i for i in range(8)]
    assert pool.sequence("b").num_computed_tokens == 8


def test_match_prefix_stops_at_the_first_missing_block() -> None:
    pool = make_pool(num_blocks=8, block_size=2)
    tokens = [5, 6, 7, 8, 9, 10]
    pool.add_sequence("a", tokens)
    write_and_compute(pool, "a", 0.0)
    blocks = list(pool.sequence("a").block_ids)
    assert pool.manager.match_prefix(tokens) == blocks
    pool.block_pool.uncache_block(blocks[1])  # a hole in the middle of the chain
    assert pool.manager.match_prefix(tokens) == blocks[:1]
    pool.block_pool.uncache_block(blocks[0])
    assert pool.manager.match_prefix(tokens) == []
    assert pool.manager.match_prefix(tokens, extra=b"other model") == []


# --------------------------------------------------------------------- eviction
def cached_sequence(pool: PagedKVPool, seq_id: str, tokens: list[int]) -> list[int]:
    """Add, compute and free a sequence; its blocks stay cached. Returns them."""
    pool.add_sequence(seq_id, tokens)
    write_and_compute(pool, seq_id, 0.0)
    blocks = list(pool.sequence(seq_id).block_ids)
    pool.free_sequence(seq_id)
    return blocks


def test_empty_blocks_are_used_before_cached_ones() -> None:
    pool = make_pool(num_blocks=5, block_size=2)
    a = cached_sequence(pool, "a", [1, 2, 3, 4])
    bp = pool.block_pool
    assert bp.num_evictable == 2 and bp.num_free == 5
    got = bp.allocate(3)
    assert not set(got) & set(a)
    assert bp.evictions == 0 and bp.num_cached == 2
    assert pool.manager.match_prefix([1, 2, 3, 4]) == a
    (evicted,) = bp.allocate(1)
    assert evicted == a[1] and bp.evictions == 1  # tail block first


@pytest.mark.parametrize("warm_calls", [0, 1, 15])
def test_allocation_evicts_only_what_empty_blocks_cannot_cover(warm_calls: int) -> None:
    """One call that needs more than the empty blocks takes all of them and evicts only the
    rest (whichever allocate call it is: some calls are timed for the stats)."""
    pool = make_pool(num_blocks=5 + warm_calls, block_size=2)
    bp = pool.block_pool
    for _ in range(warm_calls):
        bp.allocate(1)
    a = cached_sequence(pool, "a", [1, 2, 3, 4])
    got = bp.allocate(4)
    assert len(got) == 4 and a[1] in got and a[0] not in got
    assert bp.evictions == 1 and bp.num_cached == 1
    assert pool.manager.match_prefix([1, 2, 3, 4]) == a[:1]


def test_eviction_is_lru_and_tail_first() -> None:
    pool = make_pool(num_blocks=6, block_size=2)
    bp = pool.block_pool
    a = cached_sequence(pool, "a", [1, 1, 2, 2, 3, 3])
    b = cached_sequence(pool, "b", [4, 4, 5, 5, 6, 6])
    assert bp.num_evictable == 6 and bp.num_free == 6
    # a was freed first: its blocks are older, and within a, the tail goes first.
    assert bp.allocate(1) == [a[2]]
    assert pool.manager.match_prefix([1, 1, 2, 2, 3, 3]) == a[:2]
    assert bp.allocate(2) == [a[1], a[0]]
    assert pool.manager.match_prefix([1, 1]) == []
    assert bp.allocate(1) == [b[2]]


def test_prefix_hit_refreshes_lru_position() -> None:
    pool = make_pool(num_blocks=4, block_size=2)
    bp = pool.block_pool
    a = cached_sequence(pool, "a", [1, 1, 2, 2])
    b = cached_sequence(pool, "b", [3, 3, 4, 4])
    # Using a's prefix again makes it the most recently used.
    assert pool.add_sequence("a2", [1, 1, 2, 2]).num_cached_tokens == 4
    pool.free_sequence("a2")
    assert bp.allocate(2) == [b[1], b[0]]
    assert bp.allocate(2) == [a[1], a[0]]


def test_an_add_never_evicts_its_own_prefix_hit() -> None:
    """The hit blocks are the oldest in the LRU and no block is empty: the new blocks of
    the same add must come from other cached blocks."""
    pool = make_pool(num_blocks=4, block_size=2)
    a = cached_sequence(pool, "a", [1, 1, 2, 2])
    b = cached_sequence(pool, "b", [3, 3, 4, 4])
    res = pool.add_sequence("c", [1, 1, 2, 2, 9])
    assert res.num_cached_tokens == 4
    assert res.block_ids[:2] == a and res.block_ids[2] == b[1]
    assert read(pool, "c")[:4] == [0.0, 1.0, 2.0, 3.0]
    pool.block_pool.check_invariants()


def test_reset_prefix_cache_drops_only_unreferenced_blocks() -> None:
    pool = make_pool(num_blocks=8, block_size=2)
    bp = pool.block_pool
    cached_sequence(pool, "a", [1, 2, 3, 4])
    pool.add_sequence("b", [5, 6, 7])
    write_and_compute(pool, "b", 0.0)
    assert bp.num_cached == 3
    assert bp.reset_prefix_cache() == 2
    assert bp.num_cached == 1 and bp.num_evictable == 0 and bp.num_free == 6
    assert pool.manager.match_prefix([1, 2]) == []
    assert pool.manager.match_prefix([5, 6]) == pool.sequence("b").block_ids[:1]
    bp.check_invariants()
