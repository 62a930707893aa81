"""Tiers that keep chunks encoded (``tiers.<tier>_codec``): chunks demoted into them are
re-encoded once, checksummed over the encoded bytes, served back decoded; a corrupt or
torn encoded chunk is a miss; a reader that takes exact KV never gets lossy KV; a second
trip through the tiers changes no byte; a tier of fixed bytes holds more tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.chunk_format import chunk_view, encode_chunk, parse_header, validate_chunk
from kvtier.connectors.tiers.base import ChunkWrite
from kvtier.connectors.tiers.blobs import get_blobs, put_blobs
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.disk_layout import CHUNK_SUFFIX
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.errors import ChunkFormatError
from kvtier.kv_codecs import Codec

FP = b"model-fp"
SHAPE = (4, 2, 64, 2, 64)  # layers, K/V, tokens, heads, head_dim
ERROR_BOUND = {Codec.FP8: 1 / 16, Codec.INT8: 1 / 127, Codec.INT4: 1 / 7}
"""Largest error of a decoded value, relative to the largest magnitude of its group."""


def kv_of(i: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)).to(dtype)


def key_of(i: int) -> str:
    return f"{i:040x}"


def disk(path: Path, codec: Codec, capacity: int | None = None) -> DiskTier:
    tier = DiskTier(path, capacity, fsync=False)
    tier.codec = codec
    return tier


def stack(tmp_path: Path, codec: Codec, cpu_chunks: int = 2) -> TierManager:
    """A CPU tier of ``cpu_chunks`` raw chunks over a disk tier keeping ``codec``."""
    slot = len(encode_chunk(key_of(0), FP, kv_of(0))) + 4096
    return TierManager([CPUTier(cpu_chunks * slot, slot), disk(tmp_path / "d", codec)],
                       fingerprint=FP)


def disk_files(tmp_path: Path) -> dict[str, bytes]:
    return {p.name[: -len(CHUNK_SUFFIX)]: p.read_bytes()
            for p in (tmp_path / "d").rglob(f"*{CHUNK_SUFFIX}")}


def assert_within_bound(got: torch.Tensor, want: torch.Tensor, codec: Codec) -> None:
    """Every value within the codec's bound of its group's largest magnitude (groups no
    larger than a token's head vector for K and V alike: a looser but codec-independent
    reference)."""
    err = (got.float() - want.float()).abs()
    amax = want.float().abs().amax(dim=(2, 4), keepdim=True)  # per layer, K/V, head
    assert torch.all(err <= amax * ERROR_BOUND[codec] + 1e-6)


@pytest.mark.parametrize("codec", [Codec.FP8, Codec.INT8, Codec.INT4])
def test_demoted_chunks_are_encoded_and_read_back_decoded(tmp_path, codec):
    mgr = stack(tmp_path, codec)
    kvs = {key_of(i): kv_of(i) for i in range(6)}
    try:
        for k, kv in kvs.items():  # the CPU tier holds two; the others go down, encoded
            assert mgr.store([ChunkWrite.of_blob(k, encode_chunk(k, FP, kv))]).ok
        on_disk = disk_files(tmp_path)
        assert len(on_disk) >= 4
        raw_len = len(encode_chunk(key_of(0), FP, kv_of(0)))
        for k, blob in on_disk.items():
            header = validate_chunk(blob, key=k, fingerprint=FP)  # checksums of encoded bytes
            assert header.codec == codec.value and header.dtype == "bfloat16"
            assert len(blob) < raw_len * (0.55 if codec is Codec.INT4 else 0.53 * 2)
        keys = list(on_disk)
        with mgr.lease(keys) as got:
            for k, kv in zip(keys, got, strict=True):
                assert kv is not None and kv.dtype == torch.bfloat16
                assert_within_bound(kv, kvs[k], codec)
        assert mgr.stats.hits_by_tier.get("disk", 0) == len(keys)
        st = mgr.stats  # per codec: what was stored, the KV it holds, the reads
        n = st.codec_chunks_stored[codec.value]
        assert n == len(keys) and st.codec_reads[codec.value] == len(keys)
        kv_bytes = kv_of(0).numel() * 2
        assert st.codec_kv_bytes_stored[codec.value] == n * kv_bytes
        assert st.codec_bytes_stored[codec.value] == sum(len(b) for b in on_disk.values())
        from kvtier.server.metrics import _manager_metrics
        from kvtier.server.state import manager_stats

        exported = {m.name: m for m in _manager_metrics(manager_stats(mgr))}
        sample = exported["kvtier_codec_kv_bytes_stored"].samples[0]
        assert sample.labels == {"codec": codec.value} and sample.value == n * kv_bytes
    finally:
        mgr.close()


def test_a_second_trip_through_the_tiers_changes_no_byte(tmp_path):
    mgr = stack(tmp_path, Codec.INT8, cpu_chunks=1)
    try:
        k0, k1, k2 = key_of(0), key_of(1), key_of(2)
        mgr.store([ChunkWrite.of_blob(k0, encode_chunk(k0, FP, kv_of(0)))])
        mgr.store([ChunkWrite.of_blob(k1, encode_chunk(k1, FP, kv_of(1)))])  # k0 goes down
        first = disk_files(tmp_path)[k0]
        assert parse_header(first)[0].codec == "int8"
        assert mgr.prefetch([k0]) == 1  # promoted into the CPU tier as it is (lossy, smaller)
        mgr.tiers[1].delete([k0])
        mgr.store([ChunkWrite.of_blob(k2, encode_chunk(k2, FP, kv_of(2)))])  # k0 down again
        assert disk_files(tmp_path)[k0] == first
        # and re-encoding the decoded KV, by any path, gives the same payload
        _, decoded = chunk_view(torch.frombuffer(bytearray(first), dtype=torch.uint8))
        assert encode_chunk(k0, FP, decoded, Codec.INT8) == first
    finally:
        mgr.close()


def test_a_corrupt_or_torn_encoded_chunk_is_a_miss_and_dropped(tmp_path):
    mgr = stack(tmp_path, Codec.INT4, cpu_chunks=1)
    try:
        keys = [key_of(i) for i in range(3)]
        for i, k in enumerate(keys):
            mgr.store([ChunkWrite.of_blob(k, encode_chunk(k, FP, kv_of(i)))])
        paths = {p.name[: -len(CHUNK_SUFFIX)]: p for p in (tmp_path / "d").rglob(f"*{CHUNK_SUFFIX}")}
        flipped, torn = keys[0], keys[1]
        data = bytearray(paths[flipped].read_bytes())
        data[-5] ^= 0x10  # one bit of the last layer's packed values
        paths[flipped].write_bytes(bytes(data))
        paths[torn].write_bytes(paths[torn].read_bytes()[:-100])
        for k in (flipped, torn):
            with mgr.lease([k]) as got:
                assert got == [None]
            with mgr.lease_chunks([k]) as lent:
                assert lent[0] is None or _fails(lent[0])
        for k in (flipped, torn):  # dropped from their tier (the torn one by the tier itself)
            assert not mgr.tiers[1].contains_prefix([k])
        assert mgr.stats.rejected.get("corrupt", 0) >= 1
    finally:
        mgr.close()


def _fails(chunk) -> bool:
    try:
        chunk.verify()
    except Exception:  # noqa: BLE001 - the check must fail, whichever way
        return True
    return False


def test_corrupt_bytes_are_never_re_encoded_into_a_valid_chunk(tmp_path):
    tier = disk(tmp_path / "d", Codec.INT8)
    mgr = TierManager([tier], fingerprint=FP)
    try:
        k = key_of(5)
        blob = bytearray(encode_chunk(k, FP, kv_of(5)))
        blob[-3] ^= 0x01
        report = mgr.store([ChunkWrite.of_blob(k, bytes(blob))])
        assert k in report.failed and "checksum" in report.failed[k]
        assert not disk_files(tmp_path)
    finally:
        mgr.close()


def test_a_reader_that_takes_exact_kv_never_gets_lossy_kv(tmp_path):
    writer = TierManager([disk(tmp_path / "d", Codec.FP8)], fingerprint=FP)
    k = key_of(3)
    assert writer.store([ChunkWrite.of_blob(k, encode_chunk(k, FP, kv_of(3)))]).ok
    writer.close()
    exact = TierManager([disk(tmp_path / "d", Codec.NONE)], fingerprint=FP)
    try:
        assert exact.lookup([k]).length == 1  # stored, but not for this reader
        with exact.lease([k]) as got:
            assert got == [None]
        with exact.lease_chunks([k]) as lent:
            assert lent == [None]
        assert exact.stats.rejected == {"mismatch": 2}
        assert exact.tiers[0].contains_prefix([k]) == 1  # left for readers that take it
        exact.accept_codecs = frozenset({"none", "fp8"})
        with exact.lease([k]) as got:
            assert got[0] is not None
            assert_within_bound(got[0], kv_of(3), Codec.FP8)
    finally:
        exact.close()


def test_blob_readers_get_the_encoded_chunk_as_stored(tmp_path):
    mgr = TierManager([disk(tmp_path / "d", Codec.INT8)], fingerprint=FP)
    try:
        k = key_of(4)
        put_blobs(mgr, {k: encode_chunk(k, FP, kv_of(4))})
        (blob,) = get_blobs(mgr, [k])
        assert blob is not None and parse_header(blob)[0].codec == "int8"
    finally:
        mgr.close()


@pytest.mark.parametrize(("codec", "ratio"), [(Codec.FP8, 1.9), (Codec.INT8, 1.9),
                                              (Codec.INT4, 3.4)])
def test_a_tier_of_fixed_bytes_holds_more_tokens(tmp_path, codec, ratio):
    """The issue's capacity goal, on a disk tier of fixed bytes (whole disk blocks and
    headers included): bf16 KV of 256-token chunks."""
    shape = (8, 2, 256, 4, 64)
    capacity = 24 << 20

    def chunks_held(c: Codec, sub: str) -> int:
        tier = disk(tmp_path / sub, c, capacity)
        mgr = TierManager([tier], fingerprint=FP)
        try:
            for i in range(60):
                k = key_of(i)
                kv = torch.randn(shape, generator=torch.Generator().manual_seed(i)).bfloat16()
                mgr.store([ChunkWrite.of_blob(k, encode_chunk(k, FP, kv))])
            return len(tier)
        finally:
            mgr.close()

    plain, encoded = chunks_held(Codec.NONE, "none"), chunks_held(codec, codec.value)
    assert encoded < 60 and encoded >= ratio * plain


@pytest.mark.parametrize("codec", [Codec.FP8, Codec.INT8, Codec.INT4])
def test_an_opaque_chunk_is_stored_as_it_is_by_every_codec(tmp_path, codec):
    """A client's bytes under kvtier's checksums (LMCache's memory objects: any dtype and
    layout, carried as nominal fp16) are never quantized by a compressing tier: re-encoding
    them as fp16 KV would hand their reader other bytes."""
    mgr = stack(tmp_path, codec, cpu_chunks=1)
    try:
        raw = {key_of(i): torch.randint(0, 256, (SHAPE[0] * 2 * 64 * 4 * 64,), dtype=torch.uint8,
                                        generator=torch.Generator().manual_seed(i))
               for i in range(3)}
        blobs = {k: encode_chunk(k, FP, v.view(torch.float16).view(SHAPE), opaque=True)
                 for k, v in raw.items()}
        assert not put_blobs(mgr, blobs).failed
        for k, blob in blobs.items():
            assert get_blobs(mgr, [k]) == [blob]  # byte for byte, from RAM or from disk
        assert len(disk_files(tmp_path)) >= 2  # demoted, as they are
        for stored in disk_files(tmp_path).values():
            header = parse_header(stored)[0]
            assert header.opaque and header.codec == "none"
    finally:
        mgr.close()


def test_the_opaque_flag_is_under_the_header_checksum():
    kv = kv_of(5)
    blob = bytearray(encode_chunk(key_of(5), FP, kv, opaque=True))
    assert parse_header(blob)[0].opaque and not parse_header(encode_chunk(key_of(5), FP, kv))[0].opaque
    at = blob.index(b"\xa2op\xc3")  # "op": true
    blob[at + 3] = 0xC2  # "op": false
    with pytest.raises(ChunkFormatError):
        parse_header(blob)
    with pytest.raises(ChunkFormatError, match="opaque"):
        encode_chunk(key_of(5), FP, kv, Codec.INT8, opaque=True)


@pytest.mark.parametrize("codec", [Codec.FP8, Codec.INT4])
def test_a_chunk_its_writer_encoded_is_stored_as_it_is_and_counted(tmp_path, codec):
    """A writer on a GPU encodes its chunks in the tier's codec where the KV is (only the
    encoded bytes cross): the tier stores them byte for byte, and its codec counters count
    them as it counts the chunks it encodes itself."""
    tier = disk(tmp_path / "d", codec)
    mgr = TierManager([tier], fingerprint=FP)
    try:
        blobs = {key_of(i): encode_chunk(key_of(i), FP, kv_of(i), codec) for i in range(2)}
        assert not put_blobs(mgr, blobs).failed
        assert disk_files(tmp_path) == blobs
        assert get_blobs(mgr, list(blobs)) == list(blobs.values())
        kv_bytes = kv_of(0).numel() * 2
        assert mgr.stats.codec_chunks_stored == {codec.value: 2}
        assert mgr.stats.codec_bytes_stored == {codec.value: sum(map(len, blobs.values()))}
        assert mgr.stats.codec_kv_bytes_stored == {codec.value: 2 * kv_bytes}
    finally:
        mgr.close()
