"""The host data path has two implementations: the fused native copy + xxh3 kernels
(gpu_pool/kernels/host_native.py) and numpy copies with a separate checksum pass (where the
extension was not built). Both store the same bytes, restore bit-exact, and end a restore
at a chunk that fails any layer's check, layer 0 included."""

from __future__ import annotations

import pytest
import torch

from kvtier.chunk_format import parse_header
from kvtier.connectors.tiers.blobs import get_blobs, put_blobs
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.engine.model_runner import ModelRunner
from kvtier.gpu_pool.kernels import gather_blocks, host_native
from kvtier.make_model.writer import make_model
from kvtier.transfer.kv_transfer import KVTransfer

CHUNK = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_model("tiny", tmp_path_factory.mktemp("m") / "tiny", seed=3).path


@pytest.fixture(params=["fused", "numpy", "device-copies"])
def path(request, monkeypatch):
    """The restore's host route: checked group by group as it is copied (native, or numpy),
    or, as a restore to a GPU does it, copied while the restore workers check it."""
    if request.param == "numpy":
        monkeypatch.setattr(host_native, "AVAILABLE", False)
    else:
        assert host_native.AVAILABLE
    return request.param


def _saved(model_dir, tier_kind: str, tmp_path, n: int = 192, seed: int = 0, path: str = ""):
    runner = ModelRunner(model_dir, dtype="float32", device="cpu", num_blocks=96)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(10, 1000, (n,), generator=g).tolist()
    runner.add_sequence("s", tokens)
    runner.run([("s", len(tokens))])
    runner.free_sequence("s")
    cfg = runner.config
    chunk_bytes = 2 * cfg.num_hidden_layers * CHUNK * cfg.num_key_value_heads * cfg.head_dim * 4 + 512
    tier = (CPUTier(16 * chunk_bytes, chunk_bytes) if tier_kind == "cpu"
            else DiskTier(tmp_path / "disk", fsync=False))
    xfer = KVTransfer(runner, TierManager([tier], fingerprint=runner.fingerprint), CHUNK)
    xfer.restorer.device_copies = path == "device-copies"
    ids = runner.pool.manager.match_prefix(tokens, runner.fingerprint)
    before = gather_blocks(runner.pool.storage.kv, ids).clone()
    return runner, tokens, xfer, tier, xfer.save(tokens), before


def _pool_kv(runner, tokens):
    ids = runner.pool.manager.match_prefix(tokens, runner.fingerprint)
    return gather_blocks(runner.pool.storage.kv, ids)


@pytest.mark.parametrize("tier_kind", ["cpu", "disk"])
def test_a_restore_is_bit_exact_on_both_paths(model_dir, tmp_path, path, tier_kind):
    runner, tokens, xfer, tier, saved, before = _saved(model_dir, tier_kind, tmp_path, path=path)
    assert saved.stored == 3
    xfer.evict(tokens)
    loaded = xfer.load(tokens)
    assert (loaded.tokens, loaded.from_tiers) == (192, 192)
    assert torch.equal(_pool_kv(runner, tokens), before)
    xfer.close()
    xfer.manager.close()


def test_both_paths_store_the_same_bytes(model_dir, tmp_path, monkeypatch):
    blobs = {}
    for kind in ("fused", "numpy"):
        monkeypatch.setattr(host_native, "AVAILABLE", kind == "fused")
        _, _, xfer, tier, saved, _ = _saved(model_dir, "cpu", tmp_path, seed=4)
        blobs[kind] = get_blobs(tier, saved.keys)
        xfer.close()
    xfer.manager.close()
    assert blobs["fused"] == blobs["numpy"]


@pytest.mark.parametrize("tier_kind", ["cpu", "disk"])
@pytest.mark.parametrize("bad_layer", [0, 1])
def test_a_chunk_failing_any_layer_ends_the_restore_there(model_dir, tmp_path, path, tier_kind,
                                                          bad_layer):
    runner, tokens, xfer, tier, saved, before = _saved(model_dir, tier_kind, tmp_path, seed=5,
                                                       path=path)
    key = saved.keys[1]
    blob = bytearray(get_blobs(tier, [key])[0])
    header, _ = parse_header(blob)
    blob[len(blob) - header.payload_nbytes + bad_layer * header.layer_nbytes + 7] ^= 0x40
    tier.delete([key])
    put_blobs(tier, {key: bytes(blob)})
    xfer.evict(tokens)
    loaded = xfer.load(tokens)
    assert loaded.tokens == 64  # the first chunk; the corrupt one and the rest recomputed
    pooled = runner.pool.manager.match_prefix(tokens, runner.fingerprint)
    assert len(pooled) == 4  # only the first chunk's blocks stay cached
    assert torch.equal(gather_blocks(runner.pool.storage.kv, pooled), before[:, :, :64])
    lookup = xfer.manager.lookup
    assert lookup([key]).length == 0 and lookup(saved.keys[:1]).length == 1  # dropped
    xfer.close()
    xfer.manager.close()

