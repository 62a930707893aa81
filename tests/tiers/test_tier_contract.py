"""The contract every storage tier keeps, run against each tier in TIER_SPECS.

To add a tier (e.g. Redis), append a TierSpec: how to build one over a directory with a
given capacity, and how to corrupt one stored chunk in place (a real flipped byte in the
medium, not a mock), so the corruption test can check detection.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvtier.chunk_format import (
    decode_chunk,
    encode_chunk,
    max_chunk_bytes,
    parse_header,
    validate_chunk,
)
from kvtier.connectors.tiers.base import Tier
from kvtier.connectors.tiers.blobs import get_blobs, put_blobs
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.disk_tier import DiskTier

FP = b"model-fingerprint"
LAYERS, TOKENS, HEADS, DIM = 4, 16, 2, 8


def make_blob(i: int, dtype: torch.dtype = torch.float16, tokens: int = TOKENS) -> tuple[str, bytes]:
    """A real chunk blob of random KV under a hex key."""
    key = f"{i:040x}"
    g = torch.Generator().manual_seed(i)
    kv = torch.randn(LAYERS, 2, tokens, HEADS, DIM, generator=g).to(dtype)
    return key, encode_chunk(key, FP, kv)


CHUNK_BYTES = len(make_blob(0)[1])
SLOT = max_chunk_bytes(LAYERS, 2 * LAYERS * TOKENS * HEADS * DIM * 4)
"""Room for one chunk of any dtype used here (fp32 is the largest)."""


@dataclass
class TierSpec:
    name: str
    make: Callable[[Path, int | None], Tier]
    """(scratch directory, capacity in fp16 test chunks, or None = roomy) -> a fresh tier."""
    corrupt: Callable[[Tier, str], None]
    """Flip one payload byte of a stored chunk in the medium itself."""


def _make_cpu(path: Path, capacity: int | None) -> Tier:
    return CPUTier((capacity or 64) * SLOT, unit_bytes=SLOT)


def _corrupt_cpu(tier: Tier, key: str) -> None:
    assert isinstance(tier, CPUTier)
    slot, length = tier._index.get(key, touch=False)  # type: ignore[misc]
    assert tier._arena is not None
    tier._arena[slot * tier.slot_bytes + length - 1] ^= 0xFF


def _make_disk(path: Path, capacity: int | None) -> Tier:
    # Byte-capacity tiers: room for ``capacity`` fp16 test chunks (headers vary by a few bytes).
    return DiskTier(path / "disk", capacity_bytes=capacity and capacity * (CHUNK_BYTES + 32))


def _corrupt_disk(tier: Tier, key: str) -> None:
    assert isinstance(tier, DiskTier)
    path = tier._path(key)
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


TIER_SPECS: list[TierSpec] = [
    TierSpec("cpu", _make_cpu, _corrupt_cpu),
    TierSpec("disk", _make_disk, _corrupt_disk),
]


@pytest.fixture(params=TIER_SPECS, ids=lambda s: s.name)
def spec(request: pytest.FixtureRequest) -> TierSpec:
    return request.param


@pytest.fixture
def make_tier(spec: TierSpec, tmp_path: Path):
    made: list[Tier] = []

    def make(capacity: int | None = None) -> Tier:
        tier = spec.make(tmp_path, capacity)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_trip_is_bit_exact(make_tier, dtype: torch.dtype) -> None:
    tier = make_tier()
    chunks = dict(make_blob(i, dtype) for i in range(5))
    res = put_blobs(tier, chunks)
    assert res.ok and sorted(res.stored) == sorted(chunks) and not res.present
    got = get_blobs(tier, list(chunks))
    assert got == list(chunks.values())
    for key, blob in zip(chunks, got, strict=True):
        _, kv = decode_chunk(blob, key=key, fingerprint=FP)
        assert kv.dtype == dtype
    assert len(tier) == 5
    assert tier.used_bytes == sum(len(b) for b in chunks.values())


def test_batch_put_reports_present_and_misses_are_none(make_tier) -> None:
    tier = make_tier()
    first = dict(make_blob(i) for i in range(3))
    assert put_blobs(tier, first).ok
    second = dict(make_blob(i) for i in range(2, 5))
    res = put_blobs(tier, second)
    assert res.present == [make_blob(2)[0]]
    assert sorted(res.stored) == sorted(k for k in second if k != make_blob(2)[0])
    missing = make_blob(99)[0]
    got = get_blobs(tier, [make_blob(0)[0], missing, make_blob(4)[0]])
    assert got[0] == first[make_blob(0)[0]] and got[1] is None and got[2] == second[make_blob(4)[0]]
    assert tier.stats.misses >= 1 and tier.stats.hits >= 2


def test_invalid_blobs_are_refused_not_stored(make_tier) -> None:
    tier = make_tier()
    key, blob = make_blob(1)
    other, _ = make_blob(2)
    res = put_blobs(tier, {key: b"not a chunk", other: blob, make_blob(3)[0]: blob[:-3]})
    assert set(res.failed) == {key, other, make_blob(3)[0]}
    assert all(r.startswith("invalid") for r in res.failed.values())
    assert len(tier) == 0 and get_blobs(tier, [key, other]) == [None, None]


@pytest.mark.parametrize("layers", [(0, 1), (1, 3), (0, LAYERS), (3, 4)])
def test_layer_range_get_equals_slice_of_full_chunk(make_tier, layers: tuple[int, int]) -> None:
    tier = make_tier()
    chunks = dict(make_blob(i, torch.bfloat16) for i in range(3))
    put_blobs(tier, chunks)
    parts = get_blobs(tier, list(chunks), layers=layers)
    for key, part in zip(chunks, parts, strict=True):
        header = validate_chunk(part, key=key, fingerprint=FP)
        assert header.first_layer == layers[0] and header.num_layers == layers[1] - layers[0]
        _, full = decode_chunk(chunks[key])
        _, sliced = decode_chunk(part)
        assert torch.equal(sliced.view(torch.int16), full[layers[0] : layers[1]].view(torch.int16))


def test_contains_prefix_stops_at_first_gap(make_tier) -> None:
    tier = make_tier()
    keys = [make_blob(i)[0] for i in range(6)]
    put_blobs(tier, dict(make_blob(i) for i in (0, 1, 2, 4, 5)))
    assert tier.contains_prefix(keys) == 3
    assert tier.contains_prefix(keys[3:]) == 0
    assert tier.contains_prefix(keys[4:]) == 2
    assert tier.contains_prefix([]) == 0
    assert tier.contains_each(keys) == [True, True, True, False, True, True]


def test_a_manager_locates_each_key_in_its_fastest_tier(tmp_path: Path) -> None:
    from kvtier.connectors.tiers.manager import TierManager

    cpu, disk = _make_cpu(tmp_path, None), _make_disk(tmp_path, None)
    manager = TierManager([cpu, disk])
    try:
        keys = [make_blob(i)[0] for i in range(4)]
        put_blobs(cpu, dict(make_blob(i) for i in (0, 1)))
        put_blobs(disk, dict(make_blob(i) for i in (1, 3)))
        assert manager.locate(keys) == [0, 0, None, 1]
        assert manager.present(keys) == [True, True, False, True]
    finally:
        manager.close()


def test_delete(make_tier) -> None:
    tier = make_tier()
    chunks = dict(make_blob(i) for i in range(4))
    put_blobs(tier, chunks)
    keys = list(chunks)
    assert tier.delete([keys[0], keys[2], make_blob(77)[0]]) == 2
    assert get_blobs(tier, keys) == [None, chunks[keys[1]], None, chunks[keys[3]]]
    assert len(tier) == 2 and tier.used_bytes == len(chunks[keys[1]]) + len(chunks[keys[3]])
    assert put_blobs(tier, {keys[0]: chunks[keys[0]]}).stored == [keys[0]]


def test_capacity_evicts_lru_and_tells_listeners(make_tier) -> None:
    tier = make_tier(4)
    evicted: list[tuple[str, bytes | None]] = []
    # the bytes are valid during the call (the CPU tier lends a view of the slot)
    tier.add_eviction_listener(lambda k, b, _info: evicted.append((k, None if b is None else bytes(b))))
    chunks = [make_blob(i) for i in range(6)]
    assert put_blobs(tier, dict(chunks[:4])).ok
    assert get_blobs(tier, [chunks[0][0]])[0] == chunks[0][1]  # 0 becomes most recently used
    assert put_blobs(tier, dict(chunks[4:6])).ok
    assert [k for k, _ in evicted] == [chunks[1][0], chunks[2][0]]
    for key, blob in evicted:
        assert blob is None or blob == dict(chunks)[key]
    assert tier.contains_prefix([chunks[0][0]]) == 1
    assert len(tier) == 4 and tier.used_bytes <= tier.capacity_bytes
    assert tier.stats.evictions == 2


def test_batch_larger_than_tier_stores_what_fits(make_tier) -> None:
    tier = make_tier(3)
    res = put_blobs(tier, dict(make_blob(i) for i in range(5)))
    assert len(res.stored) == 3
    assert res.failed == {make_blob(3)[0]: "full", make_blob(4)[0]: "full"}
    assert get_blobs(tier, res.stored) == [dict([make_blob(i)])[k] for i, k in enumerate(res.stored)]


def test_corrupt_chunk_is_a_miss_and_deleted(make_tier, spec: TierSpec) -> None:
    tier = make_tier()
    chunks = dict(make_blob(i) for i in range(3))
    put_blobs(tier, chunks)
    keys = list(chunks)
    spec.corrupt(tier, keys[1])
    assert get_blobs(tier, keys, layers=(LAYERS - 1, LAYERS))[1] is None  # checksum of the last layer
    assert tier.stats.corrupt == 1
    assert tier.contains_prefix(keys) == 1 and len(tier) == 2
    spec.corrupt(tier, keys[2])
    assert get_blobs(tier, keys) == [chunks[keys[0]], None, None]
    assert tier.stats.corrupt == 2 and len(tier) == 1


def test_concurrent_puts_and_gets_verify(make_tier) -> None:
    tier = make_tier(24)  # smaller than the working set: evictions race too
    blobs = dict(make_blob(i) for i in range(40))
    keys = list(blobs)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            rng = torch.Generator().manual_seed(seed)
            for _ in range(60):
                pick = [keys[int(j)] for j in torch.randint(0, len(keys), (4,), generator=rng)]
                pick = list(dict.fromkeys(pick))
                if int(torch.randint(0, 2, (1,), generator=rng)):
                    res = put_blobs(tier, {k: blobs[k] for k in pick})
                    assert not res.failed, res.failed
                for k, got in zip(pick, get_blobs(tier, pick), strict=True):
                    if got is not None:
                        assert got == blobs[k]
                        validate_chunk(got, key=k, fingerprint=FP)
                for k, got in zip(pick, get_blobs(tier, pick, layers=(1, 2)), strict=True):
                    if got is not None:
                        assert parse_header(got)[0].key == k
                        validate_chunk(got, key=k)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert tier.stats.corrupt == 0
    assert len(tier) <= 24 and tier.used_bytes <= 24 * SLOT
