"""CPU-arena specifics: units reused, no growth, tails, chunks over a unit, too-large blobs,
pinning, close."""

from __future__ import annotations

import logging

import pytest
import torch

from kvtier.chunk_format import encode_chunk, max_chunk_bytes, validate_chunk
from kvtier.connectors.tiers.blobs import get_blobs, put_blobs
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.errors import InvalidArgumentError, TierError

FP = b"fp"
LAYERS, TOKENS, HEADS, DIM = 3, 8, 2, 4
SLOT = max_chunk_bytes(LAYERS, LAYERS * 2 * TOKENS * HEADS * DIM * 2)


def blob(i: int, tokens: int = TOKENS, layers: int = LAYERS) -> tuple[str, bytes]:
    key = f"{i:032x}"
    kv = torch.randn(layers, 2, tokens, HEADS, DIM, generator=torch.Generator().manual_seed(i))
    return key, encode_chunk(key, FP, kv.half())


def test_arena_is_preallocated_and_units_are_reused() -> None:
    tier = CPUTier(4 * SLOT + 100, SLOT)
    assert tier.num_units == 4 and tier.capacity_bytes == 4 * SLOT and tier.free_units == 4
    assert tier._arena is not None
    ptr, size = tier._arena.data_ptr(), tier._arena.numel()
    evicted: list[tuple[str, bytes | None]] = []
    handed: list[bool] = []

    def on_evict(key: str, view: memoryview | None, _info: object) -> None:
        assert view is not None
        handed.append(isinstance(view, memoryview))  # a view of the arena, not a copy
        evicted.append((key, bytes(view)))  # valid during the call: copied here

    tier.add_eviction_listener(on_evict)
    chunks = dict(blob(i) for i in range(12))
    for key, data in chunks.items():
        assert put_blobs(tier, {key: data}).stored == [key]
    assert tier._arena.data_ptr() == ptr and tier._arena.numel() == size
    assert len(tier) == 4 and tier.free_units == 0
    assert [k for k, _ in evicted] == list(chunks)[:8]
    assert all(handed) and all(b == chunks[k] for k, b in evicted)  # whole, unchanged
    assert get_blobs(tier, list(chunks)[8:]) == list(chunks.values())[8:]
    tier.close()


def test_a_tail_takes_one_unit_a_longer_chunk_several_and_only_past_the_arena_too_large() -> None:
    tier = CPUTier(6 * SLOT, SLOT)
    tail_key, tail = blob(1, tokens=3)
    big_key, big = blob(2, tokens=TOKENS * 8)  # a payload past one unit's header room
    huge_key, huge = blob(3, tokens=TOKENS * 32)  # more than the whole arena
    assert 2 * SLOT < len(big) < 6 * SLOT < len(huge)
    res = put_blobs(tier, {tail_key: tail, big_key: big, huge_key: huge})
    assert res.stored == [tail_key, big_key] and res.failed == {huge_key: "too_large"}
    assert tier.free_units == 6 - 1 - tier.units_for(len(big))
    assert tier.used_bytes == len(tail) + len(big)
    assert get_blobs(tier, [tail_key, big_key]) == [tail, big]
    validate_chunk(get_blobs(tier, [tail_key], layers=(1, 2))[0], key=tail_key)
    assert tier.stats.errors == {"too_large": 1}
    tier.close()


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="holds no unit"):
        CPUTier(100, 1000)
    tier = CPUTier(2 * SLOT, SLOT)
    key, data = blob(0)
    put_blobs(tier, {key: data})
    with pytest.raises(InvalidArgumentError, match="empty"):
        get_blobs(tier, [key], layers=(2, 2))
    assert get_blobs(tier, [key], layers=(0, LAYERS + 1)) == [None]  # more layers than it holds
    tier.close()


def test_delete_frees_units_and_a_lease_lends_the_raw_bytes() -> None:
    tier = CPUTier(2 * SLOT, SLOT)
    key, data = blob(0)
    put_blobs(tier, {key: data})
    assert tier._arena is not None
    tier._arena[len(data) - 10] ^= 1  # corrupt in place (unit 0, in the payload)
    with tier.lease([key]) as (lent,):  # unverified: the bytes as they lie
        raw = bytes(lent.numpy())
    assert raw != data and len(raw) == len(data) and len(tier) == 1
    assert get_blobs(tier, [key]) == [None] and len(tier) == 0 and tier.free_units == 2
    assert tier.stats.corrupt == 1
    tier.close()


def test_close_releases_the_arena() -> None:
    tier = CPUTier(2 * SLOT, SLOT)
    put_blobs(tier, dict([blob(0)]))
    tier.close()
    assert tier._arena is None and not tier.pinned
    with pytest.raises(TierError, match="closed"):
        put_blobs(tier, dict([blob(1)]))
    with pytest.raises(TierError, match="closed"), tier.lease([blob(0)[0]]):
        pass
    assert get_blobs(tier, [blob(0)[0]]) == [None]  # through the stack: a failing tier misses
    tier.close()  # idempotent


def test_arena_is_pinned_exactly_when_cuda_is_present(caplog: pytest.LogCaptureFixture) -> None:
    """With CUDA: pinned, and unpinned on close (no leaked pins). Without: pageable, and
    asking for pinning says so."""
    if not torch.cuda.is_available():
        with caplog.at_level(logging.WARNING):
            tier = CPUTier(SLOT, SLOT, pin=True)
        assert not tier.pinned and "pageable" in caplog.text
        tier.close()
        return
    tier = CPUTier(4 * SLOT, SLOT)
    assert tier.pinned and tier._arena is not None and tier._arena.is_pinned()
    key, data = blob(0)
    put_blobs(tier, {key: data})
    assert get_blobs(tier, [key]) == [data]
    arena = tier._arena
    tier.close()
    assert not arena.is_pinned()
    assert not CPUTier(SLOT, SLOT, pin=False).pinned


def test_a_reserve_of_free_units_hands_the_coldest_chunks_down_in_the_background(tmp_path) -> None:
    """With ``reserve_units`` and a lower tier, stores into a full arena find free room:
    the coldest chunks go down on the reserve's thread, not the storing one, and every
    chunk stays readable (from the arena or the tier below)."""
    import threading

    from kvtier.connectors.tiers.disk_tier import DiskTier
    from kvtier.connectors.tiers.manager import TierManager

    cpu = CPUTier(6 * SLOT, SLOT, reserve_units=2)
    mgr = TierManager([cpu, DiskTier(tmp_path / "d", fsync=False)], fingerprint=FP)
    demoted_on: list[str] = []
    cpu.add_eviction_listener(lambda key, view, _info: demoted_on.append(threading.current_thread().name))
    try:
        chunks = dict(blob(i) for i in range(12))
        for i, (key, data) in enumerate(chunks.items()):
            assert not put_blobs(mgr, {key: data}).failed
            assert cpu._reserve is None or cpu._reserve.wait_idle(10)
            assert cpu.free_units >= min(2, 6 - (i + 1)) if i < 4 else cpu.free_units == 2
        assert demoted_on and set(demoted_on) == {"kvtier-cpu-reserve"}  # never inline
        assert len(demoted_on) == 12 - 4  # the arena keeps 4 chunks, 2 units free
        assert get_blobs(mgr, list(chunks)) == list(chunks.values())  # nothing lost
    finally:
        mgr.close()
    assert cpu._reserve is not None and not cpu._reserve._thread.is_alive()


def test_without_a_lower_tier_the_reserve_evicts_nothing_early() -> None:
    cpu = CPUTier(4 * SLOT, SLOT, reserve_units=2)
    try:
        chunks = dict(blob(i) for i in range(4))
        assert not put_blobs(cpu, chunks).failed
        assert cpu._reserve is None and cpu.free_units == 0
        assert get_blobs(cpu, list(chunks)) == list(chunks.values())
    finally:
        cpu.close()
