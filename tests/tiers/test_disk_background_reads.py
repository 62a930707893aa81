"""Whole chunks lent by the disk tier while their later layers are still being read
(``DiskTier.lease(background=True)``, what a host restore uses so that scattering one chunk
overlaps reading the next): every layer a reader checks is the written one, a read that
fails or lands changed bytes is a failed check (the chunk is dropped, never used), and no
buffer goes back to the pool while a read may still land in it."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kvtier.chunk_format import encode_chunk
from kvtier.connectors.tiers.blobs import put_blobs
from kvtier.connectors.tiers.disk_layout import CHUNK_SUFFIX
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.lent_chunk import LentChunk, ReadingBuffer
from kvtier.connectors.tiers.manager import TierManager
from kvtier.errors import ChunkFormatError
from tests.tiers.test_disk_lease import FP, SHAPE, _in_place, _key, _kv

LAYERS = SHAPE[0]  # 32 KiB a layer


@pytest.fixture(params=[False, True], ids=["buffered", "o_direct"])
def manager(request, tmp_path):
    # the header and layer 0 in the head read, the other 5 layers in the background
    tier = DiskTier(tmp_path / "d", o_direct=request.param, max_workers=1, head_bytes=64 << 10)
    m = TierManager([tier], fingerprint=FP, staging=tier.staging)
    yield m
    m.close()


def _tier(manager: TierManager) -> DiskTier:
    return manager.tiers[0]  # type: ignore[return-value]


def _path(tier: DiskTier, key: str) -> str:
    return os.path.join(tier.directory, key[:2], key + CHUNK_SUFFIX)


class _Held:
    """Keeps the tier's only read worker busy, so reads handed to it wait until let go."""

    def __init__(self, tier: DiskTier):
        self.go = threading.Event()
        self.busy = threading.Event()
        tier._pool.submit(self._hold)  # noqa: SLF001 - the tier's own read worker

    def _hold(self) -> None:
        self.busy.set()
        self.go.wait(30)

    def __enter__(self) -> _Held:
        assert self.busy.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self.go.set()


@pytest.mark.parametrize("encode", [_in_place, lambda i: encode_chunk(_key(i), FP, _kv(i))],
                         ids=["in_place", "legacy"])
def test_every_checked_layer_is_the_written_one(manager, encode) -> None:
    keys = [_key(i) for i in range(4)]
    assert put_blobs(_tier(manager), {k: encode(i) for i, k in enumerate(keys)}).stored == keys
    with manager.lease_chunks(keys) as parts:
        assert all(isinstance(p, LentChunk) for p in parts)
        for i, part in enumerate(parts):
            part.check(0, LAYERS)
            assert torch.equal(part.kv, _kv(i))
    assert _tier(manager).stats.hits == 4


def test_the_disk_tier_lends_reading_buffers_for_whole_chunks_only(manager) -> None:
    tier = _tier(manager)
    put_blobs(tier, {_key(1): _in_place(1)})
    with tier.lease([_key(1)], background=True) as (whole,):
        assert isinstance(whole, ReadingBuffer) and whole.ready_bytes < whole.buf.numel()
        assert whole.done.result(10) is True
    with tier.lease([_key(1)], (0, 2), background=True) as (part,):
        assert isinstance(part, torch.Tensor)  # a layer range is read at once


def test_a_file_truncated_while_its_later_layers_are_read_is_never_used(manager) -> None:
    tier, key = _tier(manager), _key(2)
    put_blobs(tier, {key: _in_place(2)})
    with _Held(tier) as held, manager.lease_chunks([key]) as (part,):
        assert isinstance(part, LentChunk) and part.reading is not None
        os.truncate(_path(tier, key), os.path.getsize(_path(tier, key)) // 2)
        part.check(0, 1)  # layer 0 was read before the chunk was lent
        held.go.set()
        with pytest.raises(ChunkFormatError, match="truncated|read failed"):
            part.check(1, LAYERS)
    assert tier.contains_prefix([key]) == 0 and not os.path.exists(_path(tier, key))
    assert manager.lookup([key]).length == 0


def test_bytes_changed_under_a_background_read_fail_their_check(manager) -> None:
    tier, key = _tier(manager), _key(3)
    put_blobs(tier, {key: _in_place(3)})
    size = os.path.getsize(_path(tier, key))
    with _Held(tier) as held, manager.lease_chunks([key]) as (part,):
        with open(_path(tier, key), "r+b") as f:  # a byte of the last layer flipped on disk
            f.seek(size - 100)
            b = f.read(1)
            f.seek(size - 100)
            f.write(bytes([b[0] ^ 0xFF]))
            f.flush()
            os.fsync(f.fileno())
        held.go.set()
        part.check(0, LAYERS - 1)
        with pytest.raises(ChunkFormatError, match="checksum"):
            part.check(LAYERS - 1, LAYERS)
    assert tier.contains_prefix([key]) == 0  # dropped once the lease ended


def test_a_lease_ends_only_after_its_reads_landed(manager) -> None:
    tier, key = _tier(manager), _key(4)
    put_blobs(tier, {key: _in_place(4)})
    ended = threading.Event()
    with _Held(tier) as held:
        lease = manager.lease_chunks([key])
        lease.__enter__()

        def leave() -> None:
            lease.__exit__(None, None, None)
            ended.set()

        leaver = threading.Thread(target=leave)
        leaver.start()
        assert not ended.wait(0.3)  # its read is still queued: the buffer stays taken
        assert tier.staging.lent == 1
        held.go.set()
        leaver.join(10)
    assert ended.is_set() and tier.staging.lent == 0


def test_a_file_whose_head_is_not_a_chunk_is_a_miss_and_deleted(manager) -> None:
    tier, key = _tier(manager), _key(5)
    put_blobs(tier, {key: _in_place(5)})
    size = os.path.getsize(_path(tier, key))
    with open(_path(tier, key), "r+b") as f:  # the header's bytes overwritten
        f.write(bytes(64))
    with manager.lease_chunks([key]) as (part,):
        assert part is None
    assert tier.contains_prefix([key]) == 0 and not os.path.exists(_path(tier, key))
    assert size > 64 << 10  # (the file was longer than the head read)
