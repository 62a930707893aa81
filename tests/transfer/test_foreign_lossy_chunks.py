"""A compressed chunk whose checksums pass but whose bytes no encoder writes (a foreign or
buggy writer's) ends a restore at that chunk on every restore route, the host's fused
decode and the device route's (copied while checked, decoded in the scatter), and is
dropped from its tier: never KV made of garbage."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import xxhash

from kvtier.chunk_format import _PREFIX, MAGIC, decode_chunk, parse_header
from kvtier.connectors.tiers.blobs import get_blobs, put_blobs
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.engine.model_runner import ModelRunner
from kvtier.gpu_pool.kernels import gather_blocks
from kvtier.kv_codecs import Codec, layer_exponents_at
from kvtier.make_model.writer import make_model
from kvtier.transfer.kv_transfer import KVTransfer

CHUNK = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("m") / "tiny", seed=3).path


def foreign(blob: bytes, layer: int, codec: Codec) -> bytes:
    """``blob`` with layer ``layer``'s first key exponent set to -128 (no encoder writes
    it) and that layer's checksum recomputed, as its writer would have."""
    header, _ = parse_header(blob)
    payload = bytearray(blob[len(blob) - header.payload_nbytes :])
    step = header.layer_nbytes
    k_at, _ = layer_exponents_at(codec, tuple(header.shape[1:]), torch.float32)
    payload[layer * step + k_at] = 0x80
    sums = list(header.layer_checksums)
    sums[layer] = xxhash.xxh3_64_intdigest(bytes(payload[layer * step : (layer + 1) * step]))
    packed = dataclasses.replace(header, layer_checksums=tuple(sums)).pack()
    return b"".join((_PREFIX.pack(MAGIC, len(packed)), packed, bytes(payload)))


@pytest.mark.parametrize("route", ["host", "device-route"])
@pytest.mark.parametrize("codec", [Codec.INT8, Codec.INT4, Codec.FP8])
def test_a_foreign_lossy_chunk_ends_the_restore_and_is_dropped(model_dir, tmp_path, route,
                                                               codec):
    runner = ModelRunner(model_dir, dtype="float32", device="cpu", num_blocks=96)
    tokens = torch.randint(10, 1000, (192,), generator=torch.Generator().manual_seed(7)).tolist()
    runner.add_sequence("s", tokens)
    runner.run([("s", len(tokens))])
    runner.free_sequence("s")
    tier = DiskTier(tmp_path / "disk", fsync=False)
    tier.codec = codec
    xfer = KVTransfer(runner, TierManager([tier], fingerprint=runner.fingerprint), CHUNK)
    xfer.restorer.device_copies = route == "device-route"
    saved = xfer.save(tokens)
    assert saved.stored == 3
    key = saved.keys[1]
    bad = foreign(get_blobs(tier, [key])[0], 1, codec)
    tier.delete([key])
    put_blobs(tier, {key: bad})
    _, first = decode_chunk(get_blobs(tier, saved.keys[:1])[0])
    xfer.evict(tokens)
    loaded = xfer.load(tokens)
    assert loaded.tokens == CHUNK  # the first chunk; the foreign one and the rest recomputed
    pooled = runner.pool.manager.match_prefix(tokens, runner.fingerprint)
    assert len(pooled) == CHUNK // runner.pool.block_size
    got = gather_blocks(runner.pool.storage.kv, pooled)
    assert torch.equal(got, first)  # the stored first chunk, decoded
    assert xfer.manager.lookup([key]).length == 0  # dropped from its tier
    xfer.close()
    xfer.manager.close()
