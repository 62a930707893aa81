"""The disk tier's read path into reused buffers (``DiskTier.lease``): what lands in the
buffer is exactly the chunk (or the layer range) that was written, buffered or with
O_DIRECT, for chunks written in place and for older blobs alike; a torn, truncated,
padded or foreign file is never handed out as KV; buffers are reused, never shared
between live readers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvtier.chunk_format import chunk_layout, chunk_view, encode_chunk, encode_into
from kvtier.connectors.tiers.blobs import get_blobs, put_blobs
from kvtier.connectors.tiers.disk_layout import CHUNK_SUFFIX
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.manager import TierManager

FP = b"fingerprint-0001"
SHAPE = (6, 2, 64, 4, 32)


def _kv(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)


def _key(i: int) -> str:
    return f"{i:040x}"


def _in_place(i: int) -> bytes:
    key, kv = _key(i), _kv(i)
    buf = torch.empty(chunk_layout(key, FP, kv.dtype, SHAPE)[1], dtype=torch.uint8)
    n = encode_into(buf, key, FP, kv.dtype, SHAPE, lambda p: p.copy_(kv))
    return bytes(buf[:n].numpy())


def _legacy(i: int) -> bytes:
    return encode_chunk(_key(i), FP, _kv(i))  # payload offset not aligned to anything


def _path(tier: DiskTier, key: str) -> Path:
    return Path(tier.directory) / key[:2] / (key + CHUNK_SUFFIX)


@pytest.fixture(params=[False, True], ids=["buffered", "o_direct"])
def tier(request, tmp_path):
    t = DiskTier(tmp_path / "d", o_direct=request.param)
    yield t
    t.close()


@pytest.mark.parametrize("encode", [_in_place, _legacy], ids=["in_place", "legacy"])
@pytest.mark.parametrize("layers", [None, (0, 1), (2, 5), (5, 6)])
def test_lease_lands_exactly_the_written_layers(tier, encode, layers) -> None:
    keys = [_key(i) for i in range(3)]
    assert put_blobs(tier, {k: encode(i) for i, k in enumerate(keys)}).stored == keys
    with tier.lease([keys[0], _key(99), keys[2]], layers) as views:
        assert views[1] is None
        for i, view in ((0, views[0]), (2, views[2])):
            assert view is not None
            header, kv = chunk_view(view, keys[i], FP, layers)
            lo, hi = layers or (0, SHAPE[0])
            assert torch.equal(kv, _kv(i)[lo:hi]) and header.first_layer == lo
    assert tier.stats.hits == 2 and tier.stats.misses == 1


def test_buffers_are_reused_and_never_shared_between_live_leases(tier) -> None:
    keys = [_key(i) for i in range(2)]
    put_blobs(tier, {k: _in_place(i) for i, k in enumerate(keys)})
    with tier.lease(keys) as outer:
        with tier.lease(keys) as inner:
            outer_ptrs = {v.data_ptr() for v in outer if v is not None}
            assert outer_ptrs.isdisjoint(v.data_ptr() for v in inner if v is not None)
            for i, view in enumerate(inner):
                assert torch.equal(chunk_view(view, keys[i], FP)[1], _kv(i))
        # the inner buffers went back; the outer readers still see their own bytes
        for i, view in enumerate(outer):
            assert torch.equal(chunk_view(view, keys[i], FP)[1], _kv(i))
    made = tier.staging.allocations
    for _ in range(3):
        with tier.lease(keys):
            pass
    assert tier.staging.allocations == made


@pytest.mark.parametrize("damage", ["truncated", "padded", "torn_header"])
def test_a_torn_file_is_never_handed_out_and_is_deleted(tier, damage) -> None:
    key = _key(1)
    data = _in_place(1)
    put_blobs(tier, {key: data})
    path = _path(tier, key)
    if damage == "truncated":  # a write cut short by a crash or a full disk
        os.truncate(path, len(data) - 100)
    elif damage == "padded":  # a file longer than its header says
        with open(path, "ab") as f:
            f.write(b"\0" * 64)
    else:
        with open(path, "r+b") as f:
            f.write(b"XXXX")
    with tier.lease([key]) as views:
        assert views == [None]
    assert not path.exists() and len(tier) == 0 and tier.stats.corrupt == 1


def test_flipped_payload_bytes_are_rejected_by_the_manager_and_dropped(tier) -> None:
    """The tier hands out what it read (unverified, like the CPU arena); the manager's
    checksum check on the view rejects it, and the chunk is deleted from the disk."""
    key = _key(2)
    data = _in_place(2)
    put_blobs(tier, {key: data})
    path = _path(tier, key)
    with open(path, "r+b") as f:
        f.seek(len(data) - 10)
        f.write(b"\xff")
    manager = TierManager([tier], fingerprint=FP)
    with manager.lease([key]) as parts:
        assert parts == [None]
    assert not path.exists() and manager.stats.rejected == {"corrupt": 1}


def test_a_chunk_of_another_model_or_key_is_rejected(tier) -> None:
    key, other = _key(3), _key(4)
    put_blobs(tier, {key: _in_place(3)})
    os.replace(_path(tier, key), _path(tier, key).with_name(other + CHUNK_SUFFIX))
    put_blobs(tier, {key: _in_place(3)})
    tier._index.add(other, None, len(_in_place(3)))  # a file under the wrong name
    manager = TierManager([tier], fingerprint=FP)
    with manager.lease([other]) as parts:
        assert parts == [None]
    assert manager.stats.rejected == {"mismatch": 1}
    with TierManager([tier], fingerprint=b"another model").lease([key]) as parts:
        assert parts == [None]
    # Another model's reader misses, and deletes nothing: the chunk is still its writer's.
    mine = _key(5)
    put_blobs(tier, {mine: _in_place(5)})
    foreign = TierManager([tier], fingerprint=b"another model")
    with foreign.lease([mine]) as parts:
        assert parts == [None]
    assert get_blobs(foreign, [mine]) == [None]
    assert foreign.stats.rejected == {"mismatch": 2} and _path(tier, mine).exists()
    with TierManager([tier], fingerprint=FP).lease([mine]) as parts:
        assert parts[0] is not None
