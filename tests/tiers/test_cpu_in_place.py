"""The CPU tier's in-place data path: chunks written straight into the arena, read as
views under leases that keep their units from being evicted or reused."""

from __future__ import annotations

import pytest
import torch

from kvtier.chunk_format import chunk_layout, chunk_view, encode_into
from kvtier.connectors.tiers.base import ChunkWrite
from kvtier.connectors.tiers.blobs import get_blobs
from kvtier.connectors.tiers.cpu_tier import CPUTier

FP = b"fp"
SHAPE = (2, 2, 16, 2, 8)


def _key(i: int) -> str:
    return f"{i:064x}"


def _kv(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i))


def _store(tier: CPUTier, i: int) -> str:
    key = _key(i)
    _, total = chunk_layout(key, FP, torch.float32, SHAPE)
    return _store_one(tier, key, total, lambda room: encode_into(
        room, key, FP, torch.float32, SHAPE, lambda p: p.copy_(_kv(i))))


def _store_one(tier: CPUTier, key: str, nbytes: int, fill) -> str:
    return tier.store_in_place([ChunkWrite(key, nbytes, fill=fill)]).outcome(key)


def _tier(chunks: int) -> CPUTier:
    _, total = chunk_layout(_key(0), FP, torch.float32, SHAPE)
    return CPUTier(chunks * total, total)


def test_a_chunk_stored_in_place_reads_back_as_a_view_of_the_arena():
    tier = _tier(2)
    try:
        assert _store(tier, 1) == "stored" and _store(tier, 1) == "present"
        assert get_blobs(tier, [_key(1)])[0] is not None  # every reader takes it
        with tier.lease([_key(1), _key(9)]) as views:
            assert views[1] is None
            _, kv = chunk_view(views[0], _key(1), FP)
            assert torch.equal(kv, _kv(1))
            arena = tier._arena
            assert arena.data_ptr() <= kv.data_ptr() < arena.data_ptr() + arena.numel()
    finally:
        tier.close()


def test_a_failed_fill_leaves_nothing_visible_and_frees_its_units():
    tier = _tier(1)
    try:
        def broken(room):
            room[:10] = 7
            raise RuntimeError("gather failed")

        with pytest.raises(RuntimeError, match="gather failed"):
            _store_one(tier, _key(1), 100, broken)
        assert len(tier) == 0 and tier.free_units == 1
        assert _store_one(tier, _key(2), 10**9, broken) == "too_large"
    finally:
        tier.close()


def test_a_leased_chunk_is_not_evicted_when_the_tier_wants_room():
    tier = _tier(2)
    try:
        _store(tier, 1)
        _store(tier, 2)
        with tier.lease([_key(1)]) as views:  # 1 is the LRU victim, but it is leased
            assert _store(tier, 3) == "stored"
            assert tier.contains_prefix([_key(1)]) == 1 and tier.contains_prefix([_key(2)]) == 0
            assert _store(tier, 4) == "stored"  # evicts 3: 1 is still leased
            assert tier.contains_prefix([_key(1)]) == 1
            assert torch.equal(chunk_view(views[0], _key(1), FP)[1], _kv(1))
        assert _store(tier, 5) == "stored"  # the lease is over: 1 may go now
        assert tier.contains_prefix([_key(1)]) == 0
    finally:
        tier.close()


def test_a_deleted_leased_chunks_units_are_never_reused_under_its_reader():
    tier = _tier(2)
    try:
        _store(tier, 1)
        with tier.lease([_key(1)]) as views:
            assert tier.delete([_key(1)]) == 1
            assert tier.contains_prefix([_key(1)]) == 0  # new readers miss it at once
            assert _store(tier, 2) == "stored"
            assert _store(tier, 3) == "stored"  # evicts 2, not the doomed units
            assert _store(tier, 4) == "stored"
            _, kv = chunk_view(views[0], _key(1), FP)
            assert torch.equal(kv, _kv(1)), "the old reader saw another chunk's bytes"
            assert tier.free_units == 0
        assert tier.free_units == 1  # freed when the lease ended
        with tier.lease([_key(1)]) as views:
            assert views == [None]
    finally:
        tier.close()


def test_a_tier_whose_every_chunk_is_leased_is_full():
    tier = _tier(1)
    try:
        _store(tier, 1)
        with tier.lease([_key(1)]):
            assert _store(tier, 2) == "full"
        assert _store(tier, 2) == "stored"
    finally:
        tier.close()


def test_a_closed_arena_is_a_miss_through_the_manager_not_an_error():
    from kvtier.connectors.tiers.manager import Location, TierManager

    tier = _tier(2)
    manager = TierManager([tier], fingerprint=FP)
    _store(tier, 1)
    where = manager.lookup([_key(1)])
    tier.close()
    with manager.lease([_key(1)], None, Location(1, where.tiers)) as parts:
        assert parts == [None]
    assert tier.stats.errors == {"TierError": 1} and manager.stats.misses == 1


def test_a_chunk_on_its_way_down_stays_readable_and_its_reader_keeps_its_units():
    """An evicted chunk is handed to the listeners before it leaves: meanwhile it is still
    present (a concurrent lookup never finds it in no tier at all) and can be leased; a
    reader that leased it then keeps its units, and the writer evicts another chunk."""
    tier = _tier(3)
    seen: dict = {}
    held = []

    def on_evict(key, blob, _info):
        seen.setdefault("victims", []).append(key)
        if held:
            return
        seen["present"] = key in tier and tier.contains_prefix([key]) == 1
        seen["copy"] = get_blobs(tier, [key])[0]
        lease = tier.lease([key])
        (view,) = lease.__enter__()
        held.append((lease, view))

    try:
        assert [_store(tier, i) for i in (1, 2, 3)] == ["stored"] * 3
        tier.add_eviction_listener(on_evict)
        with tier.lease([_key(2)]):  # 2 stays
            assert _store(tier, 4) == "stored"
        assert seen["victims"] == [_key(1), _key(3)]  # 1's reader kept its units: 3 went too
        assert seen["present"] and seen["copy"] is not None
        assert _key(1) not in tier and tier.contains_prefix([_key(1)]) == 0  # it has left
        lease, view = held[0]
        assert torch.equal(chunk_view(view, _key(1), FP)[1], _kv(1))  # never overwritten
        assert sorted(k for k in (_key(i) for i in range(1, 5)) if k in tier) == [_key(2), _key(4)]
        assert tier.free_units == 0
        lease.__exit__(None, None, None)
        assert tier.free_units == 1  # freed when its reader let go
    finally:
        tier.close()
