"""A chunk derived inside the store from a stored one (``derive_chunk``): the source's
tokens exactly, checksummed, under the new key, with its session; refused, so that the
writer uploads its own KV, where the store holds no exact copy of the source."""

from __future__ import annotations

import pytest
import torch

from kvtier.chunk_format import chunk_view, encode_chunk, encode_into
from kvtier.connectors.tiers.base import ChunkWrite
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.derived import Derived, TokenRange, derive_chunk
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.errors import InvalidArgumentError
from kvtier.kv_codecs import Codec
from kvtier.policies.eviction import ChunkInfo

FP = b"model-fp"
SHAPE = (3, 2, 64, 2, 16)


def kv_of(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i))


def key_of(i: int) -> str:
    return f"{i:040x}"


def slot_bytes() -> int:
    return (len(encode_chunk(key_of(0), FP, kv_of(0))) // 4096 + 2) * 4096


def cpu_stack(chunks: int = 8) -> TierManager:
    slot = slot_bytes()
    return TierManager([CPUTier(chunks * slot, slot)], fingerprint=FP)


def put(manager: TierManager, key: str, kv: torch.Tensor) -> None:
    blob = encode_chunk(key, FP, kv)
    assert manager.store([ChunkWrite.of_blob(key, blob)]).ok


def read(manager: TierManager, key: str) -> torch.Tensor | None:
    with manager.lease([key]) as got:
        return None if got[0] is None else got[0].clone()


@pytest.mark.parametrize(("first", "count"), [(0, 32), (16, 16), (0, 64), (63, 1)])
def test_a_derived_chunk_holds_exactly_the_sources_tokens(first, count):
    manager = cpu_stack()
    kv = kv_of(1)
    put(manager, key_of(1), kv)
    info = ChunkInfo(0, "alice", 3)
    assert derive_chunk(manager, key_of(2), key_of(1), TokenRange(first, count), info) is Derived.STORED
    got = read(manager, key_of(2))
    assert got is not None and torch.equal(got, kv[:, :, first : first + count])
    assert read(manager, key_of(1)) is not None  # the source stays
    known = manager.tiers[0].chunk_info(key_of(2))
    assert known is not None and (known.session, known.index) == ("alice", 3)
    assert known.nbytes > 0
    # stored already: nothing written again
    assert derive_chunk(manager, key_of(2), key_of(1), TokenRange(first, count)) is Derived.PRESENT


def test_a_range_past_the_sources_tokens_is_refused_and_nothing_is_stored():
    manager = cpu_stack()
    put(manager, key_of(1), kv_of(1))
    with pytest.raises(InvalidArgumentError, match="holds 64"):
        derive_chunk(manager, key_of(2), key_of(1), TokenRange(40, 32))
    with pytest.raises(InvalidArgumentError):
        TokenRange(0, 0)
    assert manager.present([key_of(2)]) == [False]


def test_no_source_no_derived_chunk():
    manager = cpu_stack()
    assert derive_chunk(manager, key_of(2), key_of(1), TokenRange(0, 8)) is Derived.NO_SOURCE
    assert manager.present([key_of(2)]) == [False]


def test_a_corrupt_source_is_not_cut_and_is_dropped():
    manager = cpu_stack()
    put(manager, key_of(1), kv_of(1))
    with manager.tiers[0].lease([key_of(1)]) as views:  # flip a payload byte at rest
        views[0][-1] ^= 0xFF
    assert derive_chunk(manager, key_of(2), key_of(1), TokenRange(0, 8)) is Derived.NO_SOURCE
    assert manager.present([key_of(1), key_of(2)]) == [False, False]


def test_a_source_kept_lossy_is_never_cut_into_exact_kv(tmp_path):
    """A disk tier that keeps int8: its copy of the source is not exact KV, so the
    writer uploads its own."""
    slot = slot_bytes()
    disk = DiskTier(tmp_path / "d", None, fsync=False)
    disk.codec = Codec.INT8
    manager = TierManager([CPUTier(slot, slot), disk], fingerprint=FP)
    put(manager, key_of(1), kv_of(1))
    put(manager, key_of(3), kv_of(3))  # pushes the source's exact copy out of RAM
    assert manager.tiers[0].chunk_info(key_of(1)) is None
    assert derive_chunk(manager, key_of(2), key_of(1), TokenRange(0, 8)) is Derived.NO_SOURCE
    assert manager.present([key_of(2)]) == [False]


def test_an_opaque_source_is_not_kv_to_cut():
    manager = cpu_stack()
    kv = kv_of(1)
    blob = bytearray(len(encode_chunk(key_of(1), FP, kv)) + 4096)
    buf = torch.frombuffer(blob, dtype=torch.uint8)
    n = encode_into(buf, key_of(1), FP, kv.dtype, SHAPE, lambda out: out.copy_(kv))
    header, _ = chunk_view(buf[:n])
    assert not header.opaque
    from dataclasses import replace

    from kvtier.chunk_format import write_header
    opaque = replace(header, opaque=True)
    offset = n - header.payload_nbytes
    write_header(buf, opaque, offset)
    assert manager.store([ChunkWrite.of_blob(key_of(1), bytes(blob[:n]))]).ok
    assert derive_chunk(manager, key_of(2), key_of(1), TokenRange(0, 8)) is Derived.NOT_KV
