"""Bad input to the paged pool gets an error that says what to change, and changes nothing.

The pool's sharing rules on explicit examples are in test_pool_sharing.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvtier.config import PoolConfig
from kvtier.errors import (
    ConfigError,
    InvalidArgumentError,
    KVTierError,
    OutOfBlocksError,
    PoolError,
    SequenceExistsError,
    UnknownSequenceError,
)
from kvtier.gpu_pool import BlockPool, KVStorage, PagedKVPool
from tests.gpu_pool.pool_cases import make_pool, write_and_compute


def state(pool: PagedKVPool) -> Any:
    """Everything an erroring call must leave as it was."""
    bp, mgr = pool.block_pool, pool.manager
    return (
        list(bp._ref),
        list(bp._hash),
        list(bp._empty),
        list(bp._evictable),
        dict(bp._cached),
        bp.alloc_calls,
        {
            s.seq_id: (list(s.token_ids), list(s.block_ids), s.num_computed_tokens)
            for s in mgr.sequences()
        },
        mgr.prefix_query_tokens,
        mgr.prefix_hit_tokens,
    )



# --------------------------------------------------------------------- out of blocks
def test_block_pool_over_capacity_takes_nothing() -> None:
    bp = BlockPool(4, 16)
    held = bp.allocate(1)
    bp.cache_block(held[0], b"h" * 32)
    bp.free(held)  # one evictable cached block, three empty
    with pytest.raises(OutOfBlocksError, match=r"needs 5 free KV blocks but only 4") as exc:
        bp.allocate(5)
    assert (exc.value.requested, exc.value.available) == (5, 4)
    assert "size the pool larger" in str(exc.value) and "pool.num_blocks" in str(exc.value)
    assert isinstance(exc.value, PoolError) and isinstance(exc.value, KVTierError)
    assert bp.num_free == 4 and bp.num_cached == 1 and bp.evictions == 0
    assert bp.alloc_calls == 1  # the failed call is not counted
    bp.check_invariants()


def test_add_sequence_over_capacity_changes_nothing() -> None:
    pool = make_pool(num_blocks=4, block_size=4)
    pool.add_sequence("a", list(range(6)))
    before = state(pool)
    with pytest.raises(OutOfBlocksError, match=r"adding sequence 'b' needs 3 .* only 2"):
        pool.add_sequence("b", list(range(9)))
    assert state(pool) == before
    assert "b" not in pool
    pool.block_pool.check_invariants()


def test_add_sequence_counts_prefix_hits_that_leave_the_free_list() -> None:
    """A hit on a free cached block uses up a free block too: 2 hits (both free) + 2 new
    blocks do not fit in 3 free blocks, and the failed add leaves the hits evictable."""
    pool = make_pool(num_blocks=3, block_size=2)
    pool.add_sequence("a", [1, 2, 3, 4])
    write_and_compute(pool, "a", 10.0)
    pool.free_sequence("a")
    before = state(pool)
    with pytest.raises(OutOfBlocksError, match=r"needs 2 free KV blocks but only 1"):
        pool.add_sequence("b", [1, 2, 3, 4, 5, 6, 7])
    assert state(pool) == before
    assert pool.block_pool.num_evictable == 2


def test_append_over_capacity_changes_nothing() -> None:
    pool = make_pool(num_blocks=3, block_size=4)
    pool.add_sequence("a", [1, 2, 3, 4, 5])
    pool.fork("a", "b")  # the partial block is shared: an append needs a copy
    before = state(pool)
    kv = pool.storage.kv.clone()
    with pytest.raises(OutOfBlocksError, match=r"appending to sequence 'b' needs 2 .* only 1"):
        pool.append_tokens("b", [6, 7, 8, 9])
    assert state(pool) == before
    assert torch.equal(pool.storage.kv, kv)
    pool.block_pool.check_invariants()


# ------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize(
    "call",
    [
        lambda p: p.append_tokens("ghost", [1]),
        lambda p: p.mark_computed("ghost", 0),
        lambda p: p.fork("ghost", "child"),
        lambda p: p.free_sequence("ghost"),
        lambda p: p.sequence("ghost"),
        lambda p: p.slot_mapping("ghost", 0, 0),
        lambda p: p.block_tables(["a", "ghost"]),
        lambda p: p.context_lens(["ghost"]),
    ],
    ids=[
        "append_tokens",
        "mark_computed",
        "fork",
        "free_sequence",
        "sequence",
        "slot_mapping",
        "block_tables",
        "context_lens",
    ],
)
def test_unknown_sequence_id(call: Any) -> None:
    pool = make_pool()
    pool.add_sequence("a", [1, 2, 3])
    before = state(pool)
    with pytest.raises(UnknownSequenceError, match=r"unknown sequence id 'ghost'.*never added"):
        call(pool)
    assert state(pool) == before
    assert "child" not in pool


def test_freed_sequence_is_unknown_and_lookup_error() -> None:
    pool = make_pool()
    pool.add_sequence(7, [1, 2])
    pool.free_sequence(7)
    with pytest.raises(LookupError, match=r"unknown sequence id 7: .*already freed"):
        pool.free_sequence(7)
    assert pool.block_pool.num_free == pool.block_pool.num_blocks


def test_duplicate_sequence_ids() -> None:
    pool = make_pool()
    pool.add_sequence("a", [1, 2, 3, 4, 5])
    pool.add_sequence("b", [9])
    before = state(pool)
    with pytest.raises(SequenceExistsError, match=r"'a' is already in the pool; free it first"):
        pool.add_sequence("a", [1])
    with pytest.raises(SequenceExistsError, match=r"'b' is already in the pool"):
        pool.fork("a", "b")
    with pytest.raises(SequenceExistsError, match=r"'a' is already in the pool"):
        pool.fork("a", "a")
    assert state(pool) == before
    assert isinstance(SequenceExistsError("x"), ValueError)


@pytest.mark.parametrize("n", [-1, 1.5, "2", None])
def test_block_pool_allocate_bad_count(n: Any) -> None:
    bp = BlockPool(4, 16)
    with pytest.raises(InvalidArgumentError, match=r"cannot allocate .* the count must be >= 0"):
        bp.allocate(n)
    assert bp.num_free == 4 and bp.alloc_calls == 0


def test_block_pool_double_free_frees_nothing() -> None:
    bp = BlockPool(4, 16)
    a, b = bp.allocate(2)
    with pytest.raises(PoolError, match=rf"block {a} freed while not allocated \(double free\)"):
        bp.free([b, a, a])  # a has one reference: the second one is a double free
    assert (bp.ref_count(a), bp.ref_count(b), bp.num_free) == (1, 1, 2)
    bp.free([a])
    with pytest.raises(PoolError, match="double free"):
        bp.free([a])
    assert bp.num_free == 3
    bp.check_invariants()


@pytest.mark.parametrize("bad", [-1, 4, 1.5, None])
def test_block_pool_invalid_block_ids(bad: Any) -> None:
    bp = BlockPool(4, 16)
    held = bp.allocate(4)
    with pytest.raises(InvalidArgumentError, match=r"block ids are integers in \[0, 4\)"):
        bp.free([held[0], bad])
    with pytest.raises(InvalidArgumentError, match=r"cannot touch block"):
        bp.touch([held[1], bad])
    assert [bp.ref_count(b) for b in held] == [1, 1, 1, 1]
    assert bp.num_free == 0
    bp.check_invariants()


def test_block_pool_touch_of_empty_block_touches_nothing() -> None:
    bp = BlockPool(4, 16)
    (a,) = bp.allocate(1)
    bp.cache_block(a, b"a" * 32)
    bp.free([a])
    with pytest.raises(PoolError, match="is free and holds no cached content"):
        bp.touch([a, 3])  # a is evictable (fine), 3 is empty: nothing may change
    assert bp.ref_count(a) == 0 and bp.num_evictable == 1
    with pytest.raises(PoolError, match="cached while not allocated"):
        bp.cache_block(3, b"b" * 32)
    bp.check_invariants()


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([1, -2, 3], r"non-negative .* got -2"),
        ([1, 2**64], r"below 2\*\*64"),
        ([1, 1.5], r"token ids must be a sequence of integers"),
        ("abc", r"token ids must be a sequence of integers"),
        (5, r"token ids must be a sequence of integers, got int 5"),
        ([None], r"token ids must be a sequence of integers"),
    ],
)
def test_bad_token_ids(tokens: Any, match: str) -> None:
    pool = make_pool()
    pool.add_sequence("a", [1, 2, 3])
    before = state(pool)
    with pytest.raises(InvalidArgumentError, match=match):
        pool.add_sequence("b", tokens)
    with pytest.raises(InvalidArgumentError, match=match):
        pool.append_tokens("a", tokens)
    assert state(pool) == before


def test_integer_like_token_ids_are_accepted() -> None:
    pool = make_pool()
    pool.add_sequence("a", torch.tensor([1, 2, 3]))
    pool.append_tokens("a", [torch.tensor(4)])
    assert pool.sequence("a").token_ids == [1, 2, 3, 4]
    assert all(type(t) is int for t in pool.sequence("a").token_ids)


@pytest.mark.parametrize("block_size", [0, 3, 6, 12, -4])
def test_block_size_not_power_of_two(block_size: int) -> None:
    with pytest.raises(InvalidArgumentError, match=r"block_size must be a power of two"):
        BlockPool(8, block_size)
    with pytest.raises(InvalidArgumentError, match=r"block_size must be a power of two"):
        KVStorage(1, 8, block_size, 1, 2, "float32", "cpu")
    with pytest.raises(ValueError, match=r"block_size must be a power of two"):
        PoolConfig(block_size=block_size, num_blocks=8)


def test_block_pool_needs_a_block() -> None:
    with pytest.raises(InvalidArgumentError, match=r"at least one block"):
        BlockPool(0, 16)


@pytest.mark.parametrize("field", ["num_layers", "num_blocks", "num_kv_heads", "head_dim"])
def test_kv_storage_positive_sizes(field: str) -> None:
    args = {"num_layers": 1, "num_blocks": 4, "num_kv_heads": 1, "head_dim": 2}
    args[field] = 0
    with pytest.raises(InvalidArgumentError, match=rf"{field} must be a positive integer"):
        KVStorage(block_size=4, dtype="float32", device="cpu", **args)


def test_kv_storage_bad_dtype_and_device() -> None:
    with pytest.raises(ConfigError, match=r"unsupported KV dtype 'int8'; use one of"):
        KVStorage(1, 4, 4, 1, 2, "int8", "cpu")
    with pytest.raises(ConfigError, match=r"unsupported KV dtype"):
        KVStorage(1, 4, 4, 1, 2, torch.int32, "cpu")
    with pytest.raises(ConfigError, match=r"unknown device 'bogus'"):
        KVStorage(1, 4, 4, 1, 2, "float32", "bogus")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"CUDA is not available; use cpu or auto"):
            KVStorage(1, 4, 4, 1, 2, "float32", "cuda")


def test_memory_budget_smaller_than_one_block() -> None:
    per_block = KVStorage.bytes_per_block(2, 16, 2, 64, "float16")
    assert per_block == 2 * 2 * 16 * 2 * 64 * 2
    cfg = PoolConfig(memory_bytes=per_block - 1, device="cpu", dtype="float16")
    with pytest.raises(
        ConfigError, match=rf"smaller than one block .*raise it to at least {per_block}"
    ):
        KVStorage.from_config(cfg)
    storage = KVStorage.from_config(
        PoolConfig(memory_bytes=3 * per_block + 1, device="cpu", dtype="float16")
    )
    assert storage.num_blocks == 3 and storage.nbytes == 3 * per_block
    auto = KVStorage.from_config(PoolConfig(memory_bytes=3 * per_block, device="cpu"))
    assert auto.kv.dtype == torch.float32 and auto.num_blocks == 1  # auto: float32 on CPU
    with pytest.raises(ConfigError, match=r"set pool.num_blocks or pool.memory_bytes"):
        KVStorage.from_config(PoolConfig(device="cpu"))


@pytest.mark.parametrize("n", [-1, 6, 1.5, "3"])
def test_mark_computed_out_of_range(n: Any) -> None:
    pool = make_pool()
    pool.add_sequence("a", [1, 2, 3, 4, 5])
    pool.mark_computed("a", 2)
    before = state(pool)
    with pytest.raises(InvalidArgumentError, match=r"cannot mark .* computed .* it holds 5 tokens"):
        pool.mark_computed("a", n)
    assert state(pool) == before


@pytest.mark.parametrize(("start", "end"), [(-1, 2), (3, 2), (0, 6), (6, 6)])
def test_slot_mapping_out_of_range(start: int, end: int) -> None:
    pool = make_pool()
    pool.add_sequence("a", [1, 2, 3, 4, 5])
    with pytest.raises(InvalidArgumentError, match=r"outside sequence 'a' of 5 tokens"):
        pool.slot_mapping("a", start, end)


def test_hashing_rejects_bad_block_size() -> None:
    from kvtier.hashing import chain_hashes

    with pytest.raises(InvalidArgumentError, match="block_size must be a positive integer"):
        chain_hashes([1, 2, 3], 0)
