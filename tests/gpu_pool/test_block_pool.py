"""BlockPool unit tests, PagedKVPool stats and tensors on hand-computable cases, and a smoke
run of the allocator benchmark CLI."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.gpu_pool import BlockPool, KVStorage, PagedKVPool, PoolStats

H1, H2, H3 = b"1" * 32, b"2" * 32, b"3" * 32


def make_pool(num_blocks: int = 8, block_size: int = 4, caching: bool = True) -> PagedKVPool:
    return PagedKVPool(
        KVStorage(1, num_blocks, block_size, 1, 2, "float32", "cpu"),
        enable_prefix_caching=caching,
    )


# ------------------------------------------------------------------------- BlockPool
def test_fresh_pool_hands_out_low_ids_first() -> None:
    bp = BlockPool(8, 16)
    assert bp.allocate(1) == [0]
    assert bp.allocate(3) == [1, 2, 3]
    assert (bp.num_free, bp.num_used) == (4, 4)
    assert [bp.ref_count(b) for b in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert [bp.is_free(b) for b in (3, 4)] == [False, True]


def test_allocate_zero_and_everything() -> None:
    bp = BlockPool(5, 2)
    assert bp.allocate(0) == []
    blocks = bp.allocate(5)
    assert sorted(blocks) == [0, 1, 2, 3, 4]
    assert bp.num_free == 0
    assert (bp.alloc_calls, bp.alloc_blocks) == (2, 5)
    bp.check_invariants()


def test_freed_blocks_are_reused_first() -> None:
    bp = BlockPool(8, 16)
    blocks = bp.allocate(4)
    bp.free([blocks[1], blocks[3]])
    assert bp.allocate(1) == [blocks[3]]  # a stack: the last freed comes back first
    assert bp.allocate(1) == [blocks[1]]
    assert bp.allocate(1) == [4]


def test_free_takes_any_iterable_and_counts_references() -> None:
    bp = BlockPool(4, 16)
    a, b = bp.allocate(2)
    bp.touch([a])
    assert bp.ref_count(a) == 2
    bp.free(iter([a, b]))
    assert (bp.ref_count(a), bp.ref_count(b), bp.num_free) == (1, 0, 3)
    bp.free((a,))
    assert bp.num_free == 4
    bp.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=40))
def test_random_batches_are_distinct_and_balance(ops: list[tuple[bool, int]]) -> None:
    """Random batch allocations and partial frees: ids never handed out twice while held,
    and every block comes back."""
    bp = BlockPool(64, 4)
    held: list[int] = []
    for alloc, k in ops:
        if alloc and k <= bp.num_free:
            got = bp.allocate(k)
            assert len(got) == len(set(got)) == k
            assert not set(got) & set(held)
            held += got
        elif not alloc:
            k = min(k, len(held))
            bp.free(held[:k])
            del held[:k]
        assert bp.num_free == 64 - len(held)
    bp.free(held)
    assert bp.num_free == 64
    bp.check_invariants()


def test_cache_lookup_and_canonical_block() -> None:
    bp = BlockPool(4, 4)
    a, b = bp.allocate(2)
    assert bp.cache_block(a, H1) is True
    assert bp.lookup(H1) == a and bp.block_hash(a) == H1
    assert bp.cache_block(b, H1) is False  # same content elsewhere: a stays canonical
    assert bp.block_hash(b) is None
    assert bp.cache_block(a, H2) is False  # a block holds one content
    assert bp.lookup(H2) is None
    assert bp.num_cached == 1
    bp.free([a, b])
    assert (bp.num_evictable, bp.num_free) == (1, 4)  # a keeps its content, b is empty
    bp.check_invariants()


def test_touch_takes_a_cached_block_off_the_lru() -> None:
    bp = BlockPool(4, 4)
    (a,) = bp.allocate(1)
    bp.cache_block(a, H1)
    bp.free([a])
    assert (bp.num_free, bp.num_evictable, bp.free_after_touch([a, a])) == (4, 1, 3)
    bp.touch([a])
    assert (bp.ref_count(a), bp.num_free, bp.num_evictable) == (1, 3, 0)
    assert bp.lookup(H1) == a  # still cached while in use
    bp.touch([a])
    assert bp.ref_count(a) == 2 and bp.free_after_touch([a]) == 3
    bp.check_invariants()


def test_uncache_block() -> None:
    bp = BlockPool(4, 4)
    a, b = bp.allocate(2)
    bp.cache_block(a, H1)
    bp.cache_block(b, H2)
    bp.free([b])
    bp.uncache_block(a)  # in use: forgotten, still held
    assert bp.lookup(H1) is None and bp.block_hash(a) is None and bp.ref_count(a) == 1
    bp.uncache_block(b)  # free and cached: becomes an empty block
    assert bp.lookup(H2) is None and bp.num_evictable == 0 and bp.num_free == 3
    bp.uncache_block(b)  # nothing cached: no-op
    assert bp.cache_block(a, H1) is True  # can be cached again
    bp.check_invariants()


def test_reset_prefix_cache_counts() -> None:
    bp = BlockPool(6, 4)
    blocks = bp.allocate(3)
    for b, h in zip(blocks, (H1, H2, H3), strict=True):
        bp.cache_block(b, h)
    bp.free(blocks[:2])
    assert bp.reset_prefix_cache() == 2
    assert (bp.num_cached, bp.num_evictable, bp.num_free) == (1, 0, 5)
    assert bp.lookup(H3) == blocks[2]
    assert bp.reset_prefix_cache() == 0
    bp.check_invariants()


def test_eviction_counters() -> None:
    bp = BlockPool(4, 4)
    blocks = bp.allocate(4)
    for b, h in zip(blocks, (H1, H2, H3, b"4" * 32), strict=True):
        bp.cache_block(b, h)
    bp.free(blocks)
    assert bp.evictions == 0
    got = bp.allocate(3)
    assert got == blocks[:3]  # LRU: freed in that order
    assert (bp.evictions, bp.num_cached, bp.alloc_calls, bp.alloc_blocks) == (3, 1, 2, 7)
    assert all(bp.block_hash(b) is None for b in got)
    assert bp.alloc_ns > 0  # the first call of a pool is always timed
    bp.check_invariants()


# ----------------------------------------------------------------------- stats
def test_stats_on_a_hand_computed_case() -> None:
    pool = make_pool(num_blocks=8, block_size=4)
    pool.add_sequence("a", [1, 2, 3, 4, 5, 6])  # 2 blocks, 6 tokens
    pool.add_sequence("b", [7, 8, 9])  # 1 block, 3 tokens
    s = pool.stats()
    assert isinstance(s, PoolStats)
    assert (s.num_blocks, s.block_size, s.blocks_used, s.blocks_free) == (8, 4, 3, 5)
    assert (s.num_sequences, s.tokens_stored) == (2, 9)
    assert s.utilisation == pytest.approx(9 / 12)
    assert (s.prefix_query_tokens, s.prefix_hit_tokens, s.prefix_hit_rate) == (9, 0, 0.0)
    assert (s.alloc_calls, s.alloc_blocks, s.evictions) == (2, 3, 0)
    assert s.alloc_ns_per_block > 0

    pool.mark_computed("a")  # publishes a's one full block
    pool.fork("a", "c")  # shares both blocks: stored tokens and blocks unchanged
    s = pool.stats()
    assert (s.blocks_used, s.tokens_stored, s.num_sequences) == (3, 9, 3)
    assert (s.blocks_cached, s.blocks_evictable) == (1, 0)

    pool.free_sequence("a")
    pool.free_sequence("c")
    s = pool.stats()
    assert (s.blocks_used, s.blocks_free, s.blocks_cached, s.blocks_evictable) == (1, 7, 1, 1)
    assert s.utilisation == pytest.approx(3 / 4)

    res = pool.add_sequence("d", [1, 2, 3, 4, 0, 0])  # hits the cached block
    assert res.num_cached_tokens == 4
    s = pool.stats()
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (15, 4)
    assert s.prefix_hit_rate == pytest.approx(4 / 15)
    assert (s.blocks_used, s.tokens_stored) == (3, 9)
    assert s.as_dict()["prefix_hit_tokens"] == 4


def test_stats_of_an_empty_pool() -> None:
    s = make_pool().stats()
    assert (s.blocks_used, s.blocks_free, s.tokens_stored) == (0, 8, 0)
    assert (s.utilisation, s.prefix_hit_rate, s.alloc_ns_per_block) == (0.0, 0.0, 0.0)


# ---------------------------------------------------------------------- tensors
def test_slot_mapping_through_a_scattered_block_table() -> None:
    pool = make_pool(num_blocks=8, block_size=4)
    pool.add_sequence("x", [0])  # block 0
    pool.add_sequence("a", list(range(8)))  # blocks 1, 2
    pool.free_sequence("x")
    pool.append_tokens("a", [8, 9])  # block 0 again
    assert pool.sequence("a").block_ids == [1, 2, 0]
    slots = pool.slot_mapping("a", 2, 10)
    assert slots.dtype == torch.int64 and slots.device.type == "cpu"
    assert slots.tolist() == [6, 7, 8, 9, 10, 11, 0, 1]
    assert pool.slot_mapping("a", 5, 5).tolist() == []


def test_block_tables_and_context_lens() -> None:
    pool = make_pool(num_blocks=8, block_size=4)
    pool.add_sequence("a", list(range(9)))  # 3 blocks
    pool.add_sequence("b", [1])  # 1 block
    pool.add_sequence("e", [])  # no block
    bt = pool.block_tables(["a", "b", "e"])
    assert bt.dtype == torch.int32 and bt.shape == (3, 3)
    assert bt.tolist() == [[0, 1, 2], [3, 0, 0], [0, 0, 0]]
    assert pool.block_tables(["b"], pad_to=5).tolist() == [[3, 0, 0, 0, 0]]
    assert pool.block_tables(["a"], pad_to=2).shape == (1, 3)  # never truncates
    assert pool.block_tables([]).shape == (0, 1)
    lens = pool.context_lens(["a", "b", "e"])
    assert lens.dtype == torch.int32 and lens.tolist() == [9, 1, 0]


# -------------------------------------------------------------- benchmark CLI
def test_allocator_benchmark_quick_run_writes_json(tmp_path: Path) -> None:
    from kvtier.benchmarks import allocator

    parser = argparse.ArgumentParser()
    allocator.register(parser.add_subparsers())
    out = tmp_path / "allocator.json"
    args = parser.parse_args(["allocator", "--quick", "--out", str(out)])
    assert args.func is allocator.run
    assert allocator.run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "allocator" and "cpu" in doc["machine"]
    assert doc["config"]["quick"] is True
    assert [b["n"] for b in doc["batch"]] == list(allocator.QUICK_BATCH_SIZES)
    assert [b["n"] for b in doc["batch_evict"]] == list(allocator.QUICK_BATCH_SIZES)
    for b in doc["batch"]:
        assert b["ns_per_block"] > 0 and isinstance(b["meets_target"], bool)
        assert b["ratio_vs_ref"] == pytest.approx(
            b["ns_per_block"] / doc["reference"]["ns_per_element"]
        )
    assert doc["reference"]["ns_per_element"] > 0
    target = doc["target"]
    assert target["ns_per_block"] == 1000.0 and isinstance(target["met"], bool)
    assert target["worst_batch_ns_per_block"] == max(b["ns_per_block"] for b in doc["batch"])
    assert doc["single"]["ns_per_block"] > 0 and doc["single_evict"]["ns_per_block"] > 0
    manager = doc["manager"]
    assert set(manager) >= {
        "add_free_ns_per_block",
        "add_free_prefix_hit_ns_per_block",
        "decode_append_ns_per_token",
        "decode_append_ns_per_block",
    }
    assert all(v > 0 for k, v in manager.items() if k.endswith(("block", "token")))


def test_allocator_benchmark_rejects_bad_arguments(tmp_path: Path) -> None:
    from kvtier.benchmarks import allocator
    from kvtier.errors import InvalidArgumentError

    parser = argparse.ArgumentParser()
    allocator.register(parser.add_subparsers())
    args = parser.parse_args(["allocator", "--repeats", "0", "--out", str(tmp_path / "x.json")])
    with pytest.raises(InvalidArgumentError, match="--repeats must be >= 1"):
        allocator.run(args)
    assert not (tmp_path / "x.json").exists()


def test_refcounts_match_block_table_references() -> None:
    """Refcounts equal the number of block-table references after fork and prefix hits."""
    pool = make_pool(num_blocks=8, block_size=2)
    pool.add_sequence("a", [1, 2, 3, 4, 5])
    pool.mark_computed("a")
    pool.fork("a", "b")
    pool.add_sequence("c", [1, 2, 3, 4])
    refs = Counter(b for s in pool.manager.sequences() for b in s.block_ids)
    assert all(pool.block_pool.ref_count(b) == refs[b] for b in range(8))
    assert refs[pool.sequence("a").block_ids[0]] == 3
