"""The CPU arena holds chunks of any size its capacity allows: each takes a contiguous run
of units, evictions free only the bytes a store needs, holes are joined by sliding chunks
(never a leased one), and only a chunk larger than the whole arena is refused."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from kvtier.chunk_format import encode_chunk, namespaced_key, with_namespace
from kvtier.connectors.tiers.base import CHUNK_OVERHEAD_BYTES, ChunkWrite
from kvtier.connectors.tiers.blobs import get_blobs, get_each, put_blobs
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.manager import TierManager

UNIT = 4096
FP = b"f" * 16


def _key(i: int) -> str:
    return f"{i:064x}"


def _pattern(i: int, nbytes: int) -> torch.Tensor:
    return torch.full((nbytes,), i % 251, dtype=torch.uint8)


def _write(i: int, nbytes: int, reserved: int | None = None) -> ChunkWrite:
    """A chunk of ``nbytes`` bytes of value ``i % 251`` (the tier's layout is under test,
    not the chunk format: a fill is its writer's to get right)."""

    def fill(dest: torch.Tensor) -> int:
        dest[:nbytes].copy_(_pattern(i, nbytes))
        return nbytes

    return ChunkWrite(_key(i), reserved or nbytes, fill=fill)


def _store(tier: CPUTier, i: int, nbytes: int) -> str:
    return tier.store_in_place([_write(i, nbytes)]).outcome(_key(i))


def _intact(tier: CPUTier, i: int, nbytes: int) -> bool:
    with tier.lease([_key(i)]) as (view,):
        return view is not None and torch.equal(view, _pattern(i, nbytes))


def _consistent(tier: CPUTier) -> None:
    """Every unit is free or in exactly one extent, and the free runs never touch."""
    runs = tier._extents.free_runs()  # noqa: SLF001
    taken = tier._extents.taken()  # noqa: SLF001
    assert sum(r.units for r in runs) == tier.free_units
    assert sum(e.units for e in runs + taken) == tier.num_units
    spans = sorted(runs + taken, key=lambda e: e.start)
    assert all(a.end == b.start for a, b in zip(spans, spans[1:], strict=False))
    assert all(a.end < b.start for a, b in zip(runs, runs[1:], strict=False))


class Evictions:
    """What the tier handed down: keys and whether each view was the chunk whole."""

    def __init__(self, tier: CPUTier, sizes: dict[str, tuple[int, int]]) -> None:
        self.keys: list[str] = []
        self.whole: list[bool] = []
        self.sizes = sizes
        tier.add_eviction_listener(self)

    def __call__(self, key: str, view: memoryview | None, _info: object) -> None:
        i, nbytes = self.sizes[key]
        self.keys.append(key)
        assert view is not None
        self.whole.append(bytes(view) == bytes(_pattern(i, nbytes).numpy()))


def test_chunks_of_any_size_share_one_arena_and_read_back_whole():
    """A tail, a chunk the size of a unit and chunks of several units, real chunk blobs:
    each takes whole units, contiguous, page-aligned, and reads back byte for byte."""
    tier = CPUTier(160 * UNIT, UNIT)
    try:
        blobs = {}
        for i, tokens in enumerate((3, 16, 100, 150, 200)):
            kv = torch.randn(2, 2, tokens, 2, 64, generator=torch.Generator().manual_seed(i))
            blobs[_key(i)] = encode_chunk(_key(i), FP, kv.half())
        assert max(len(b) for b in blobs.values()) > 20 * UNIT
        assert put_blobs(tier, blobs).stored == list(blobs)
        assert get_blobs(tier, list(blobs)) == list(blobs.values())
        taken = sum(tier.units_for(len(b)) for b in blobs.values())
        assert tier.free_units == 160 - taken and len(tier) == 5
        for key in blobs:
            with tier.lease([key]) as (view,):
                assert view.data_ptr() % UNIT == 0  # O_DIRECT as it lies
        _consistent(tier)
    finally:
        tier.close()


def test_only_a_chunk_larger_than_the_whole_arena_is_too_large():
    tier = CPUTier(8 * UNIT, UNIT)
    try:
        sizes = {_key(i): (i, UNIT) for i in range(8)}
        evicted = Evictions(tier, sizes | {_key(9): (9, 8 * UNIT)})
        assert [_store(tier, i, UNIT) for i in range(8)] == ["stored"] * 8
        assert _store(tier, 10, 8 * UNIT + 1) == "too_large"
        assert evicted.keys == [] and len(tier) == 8  # refused before anything left
        assert _store(tier, 9, 8 * UNIT) == "stored"  # the whole arena: everyone else leaves
        assert len(evicted.keys) == 8 and all(evicted.whole) and _intact(tier, 9, 8 * UNIT)
        assert tier.stats.errors == {"too_large": 1}
    finally:
        tier.close()


def test_a_big_chunk_in_a_full_arena_evicts_only_what_its_bytes_need_and_slides_the_rest():
    """The least recently used chunks lie apart: the three evicted free three units in
    three holes; the survivors slide together (read back intact) rather than a fourth
    chunk being evicted for want of a contiguous run."""
    tier = CPUTier(8 * UNIT, UNIT)
    try:
        sizes = {_key(i): (i, UNIT - 7) for i in range(8)}
        evicted = Evictions(tier, sizes)
        for i in range(8):
            assert _store(tier, i, UNIT - 7) == "stored"
        for i in (1, 3, 5, 6, 7):  # 0, 2 and 4 are now the coldest
            assert _intact(tier, i, UNIT - 7)
        assert _store(tier, 20, 3 * UNIT) == "stored"
        assert evicted.keys == [_key(0), _key(2), _key(4)] and all(evicted.whole)
        assert tier.moved_bytes > 0
        assert all(_intact(tier, i, UNIT - 7) for i in (1, 3, 5, 6, 7))
        assert _intact(tier, 20, 3 * UNIT) and tier.free_units == 0
        _consistent(tier)
    finally:
        tier.close()


def test_a_leased_chunk_is_neither_evicted_nor_moved_and_a_store_it_blocks_evicts_nothing():
    tier = CPUTier(8 * UNIT, UNIT)
    try:
        sizes = {_key(i): (i, UNIT) for i in range(8)}
        evicted = Evictions(tier, sizes)
        for i in range(8):
            _store(tier, i, UNIT)
        with tier.lease([_key(1), _key(5)]) as (one, five):
            where = (one.data_ptr(), five.data_ptr())
            # Units 1 and 5 are pinned: the longest run anything could make is 2..4.
            assert _store(tier, 30, 4 * UNIT) == "full"
            assert evicted.keys == [] and len(tier) == 8  # nothing thrown away for nothing
            assert _store(tier, 31, 3 * UNIT) == "stored"
            assert _key(1) in tier and _key(5) in tier
            assert (one.data_ptr(), five.data_ptr()) == where
            assert torch.equal(one, _pattern(1, UNIT)) and torch.equal(five, _pattern(5, UNIT))
            assert all(evicted.whole) and _key(1) not in evicted.keys and _key(5) not in evicted.keys
        assert _store(tier, 30, 4 * UNIT) == "stored"  # the leases are over: room is made
        _consistent(tier)
    finally:
        tier.close()


def test_a_victim_leased_on_its_way_down_keeps_its_bytes_until_its_reader_lets_go():
    """A store evicting two chunks for one big one: a reader leases the first on its way
    down; it is not overwritten (the writer takes more room), and its units are free again
    once the reader lets go."""
    tier = CPUTier(6 * UNIT, UNIT)
    held: list = []

    def lease_first(key, _view, _info):
        if not held:
            lease = tier.lease([key])
            held.append((lease, lease.__enter__()[0]))

    try:
        for i in range(6):
            _store(tier, i, UNIT)
        tier.add_eviction_listener(lease_first)
        assert _store(tier, 40, 2 * UNIT) == "stored"
        lease, view = held[0]
        assert torch.equal(view, _pattern(0, UNIT))  # never overwritten under its reader
        assert _key(0) not in tier and len(tier) == 6 - 3 + 1  # it left; two more went
        assert tier.free_units == 0
        lease.__exit__(None, None, None)
        assert tier.free_units == 1  # freed when its reader let go
        _consistent(tier)
    finally:
        tier.close()


def test_one_models_chunks_each_evict_exactly_one_and_move_nothing():
    """Chunks of one size in page units (a sidecar's default): a full arena gives up
    exactly one chunk per store, whose hole the next chunk fits: no thrash, no copies."""
    full = 10 * UNIT + 100
    tier = CPUTier(100 * UNIT, UNIT)
    try:
        sizes = {_key(i): (i, full) for i in range(200)}
        evicted = Evictions(tier, sizes)
        for i in range(200):
            before = len(evicted.keys)
            assert _store(tier, i, full) == "stored"
            assert len(evicted.keys) - before == (1 if i >= 9 else 0)
        assert tier.moved_bytes == 0 and all(evicted.whole) and len(tier) == 9
    finally:
        tier.close()


def test_tails_among_full_chunks_keep_the_arena_full_without_thrashing():
    """Conversations of whole chunks and a tail of any length, stored for many turns of
    the arena: every store succeeds, evictions free no more than a store needs (after any
    store, fewer units are free than one full chunk takes), and every chunk still held
    reads back intact after all the sliding."""
    full = 10 * UNIT + 100
    full_units = 11
    tier = CPUTier(400 * UNIT, UNIT)
    rng = random.Random(7)
    sizes: dict[str, tuple[int, int]] = {}
    evicted = Evictions(tier, sizes)
    try:
        i = 0
        for _ in range(600):
            for nbytes in [full] * rng.randint(0, 5) + [rng.randint(200, full - 1)]:
                sizes[_key(i)] = (i, nbytes)
                assert _store(tier, i, nbytes) == "stored"
                if len(evicted.keys):
                    assert tier.free_units < full_units
                i += 1
        assert len(evicted.keys) > 5 * len(tier)  # the arena turned over many times
        assert all(evicted.whole)
        held = [k for k in sizes if k in tier]
        assert held and all(_intact(tier, *sizes[k]) for k in held)
        _consistent(tier)
    finally:
        tier.close()


def test_a_fill_that_writes_less_than_it_reserved_keeps_only_the_units_it_used():
    tier = CPUTier(16 * UNIT, UNIT)
    try:
        outcome = tier.store_in_place([_write(1, UNIT + 10, reserved=5 * UNIT)]).outcome(_key(1))
        assert outcome == "stored" and tier.free_units == 16 - 2 and _intact(tier, 1, UNIT + 10)
        _consistent(tier)
    finally:
        tier.close()


def test_the_reserve_keeps_free_units_for_chunks_of_any_size(tmp_path):
    """With ``reserve_units`` and a lower tier, chunks of several sizes into a full arena:
    the coldest go down on the reserve's thread, never the storing one, and every chunk
    stays readable from one tier or the other."""
    cpu = CPUTier(40 * UNIT, UNIT, reserve_units=8)
    manager = TierManager([cpu, DiskTier(tmp_path / "d", fsync=False)], fingerprint=FP)
    demoted_on: list[str] = []
    cpu.add_eviction_listener(lambda *_: demoted_on.append(threading.current_thread().name))
    try:
        blobs = {}
        for i in range(30):
            kv = torch.full((2, 2, 16 * (1 + i % 4), 2, 16), float(i))  # 1 to 4 units
            blobs[_key(i)] = encode_chunk(_key(i), FP, kv.half())
            assert put_blobs(manager, {_key(i): blobs[_key(i)]}).ok
            assert cpu._reserve is None or cpu._reserve.wait_idle(30)  # noqa: SLF001
            assert cpu.free_units >= 8 or not demoted_on
        assert demoted_on and set(demoted_on) == {"kvtier-cpu-reserve"}
        assert [b for b, _ in get_each(manager, list(blobs))] == list(blobs.values())
    finally:
        manager.close()


def _tenant_chunk(tenant: str, i: int, tokens: int) -> tuple[str, bytes]:
    kv = torch.full((2, 2, tokens, 1, 8), float(i % 97))
    return namespaced_key(tenant, _key(i)), with_namespace(encode_chunk(_key(i), FP, kv), tenant)


def test_quotas_charge_the_whole_units_a_chunk_takes(tmp_path):
    """A chunk of several units is charged its units and an index entry; a tenant past
    its quota pushes its own coldest chunks down, never another's."""
    unit = 1024
    cpu = CPUTier(64 * unit, unit)
    manager = TierManager([cpu, DiskTier(tmp_path / "d", fsync=False)], fingerprint=FP)
    try:
        alice = [_tenant_chunk("alice", i, 64) for i in range(3)]
        size = len(alice[0][1])
        charge = cpu.units_for(size) * unit + CHUNK_OVERHEAD_BYTES
        assert cpu.units_for(size) > 1 and cpu.occupancy(size) == charge
        manager.quotas = {"alice": {"cpu": 2 * charge}}
        bob = dict(_tenant_chunk("bob", 100 + i, 64) for i in range(3))
        assert put_blobs(manager, bob).ok
        for k, b in alice:
            assert put_blobs(manager, {k: b}).ok
        assert cpu.namespace_held("alice")[0] == 2 * charge
        assert cpu.namespace_held("bob")[0] == 3 * charge
        assert cpu.contains_prefix([alice[0][0]]) == 0
        assert manager.tiers[1].contains_prefix([alice[0][0]]) == 1  # down, not away
        assert [b for b, _ in get_each(manager, [k for k, _ in alice])] == [b for _, b in alice]
    finally:
        manager.close()


# ------------------------------------------------------------------ the property
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

TENANTS = ["alice", "bob", "mallory"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["lru", "slru", "lfu", "arc", "cost-aware", "session-aware"]),
    shares=st.lists(st.integers(1, 4), min_size=3, max_size=3),
    ops=st.lists(st.tuples(st.sampled_from(TENANTS), st.integers(1, 64), st.integers(1, 3)),
                 min_size=1, max_size=40),
)
def test_no_tenant_within_its_share_evicts_another_even_when_chunks_span_units(
        policy, shares, ops):
    """As tests/tiers/test_tenant_quotas.py's property, with units smaller than the chunks
    (1 to 8 units each, a sidecar's layout): holes left by one tenant's chunks never make
    another tenant's chunk leave, because holes are joined by sliding, not by evicting."""
    unit = 1024
    biggest = len(_tenant_chunk("mallory", 0, 64)[1])
    units = -(-biggest // unit)
    charge = units * unit + CHUNK_OVERHEAD_BYTES
    cpu = CPUTier(sum(shares) * units * unit, unit, eviction=policy)
    manager = TierManager([cpu], fingerprint=FP)
    manager.quotas = {t: {"cpu": n * charge} for t, n in zip(TENANTS, shares, strict=True)}
    try:
        held: dict[str, set[str]] = {t: set() for t in TENANTS}
        counter = 0
        for tenant, tokens, count in ops:
            batch = dict(_tenant_chunk(tenant, counter + j, tokens) for j in range(count))
            counter += count
            before = {t: {k for k in held[t] if k in cpu} for t in TENANTS if t != tenant}
            put_blobs(manager, batch)
            held[tenant].update(batch)
            for other, keys in before.items():
                assert {k for k in keys if k in cpu} == keys, (
                    f"{tenant}'s put removed {other}'s chunks ({policy})")
        for t in TENANTS:
            assert cpu.namespace_held(t)[0] <= manager.quotas[t]["cpu"]
        _consistent(cpu)
    finally:
        manager.close()


@pytest.mark.parametrize("unit", [UNIT, 1 << 20])
def test_occupancy_is_whole_units(unit):
    tier = CPUTier(4 * unit, unit)
    try:
        assert tier.occupancy(1) == unit + CHUNK_OVERHEAD_BYTES
        assert tier.occupancy(unit + 1) == 2 * unit + CHUNK_OVERHEAD_BYTES
        assert tier.slot_bytes == tier.unit_bytes == unit  # the unit, under its former name
    finally:
        tier.close()
