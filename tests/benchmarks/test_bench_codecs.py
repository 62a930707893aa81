"""``kvtier bench codecs`` end to end on a tiny generated model (the figures of record use
SmolLM2-135M-Instruct): every codec gets a row of the shape the issue asks for, the figures
are sane (probabilities in range, KL non-negative, the coarser codec no closer to exact than
the finer one), and a missing model is a clear error."""

from __future__ import annotations

import json

import pytest

from kvtier.cli.main import main
from kvtier.make_model.writer import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("m") / "tiny", seed=11).path


def test_every_codec_gets_quality_and_speed_figures(model_dir, tmp_path):
    out = tmp_path / "codecs.json"
    rc = main(["bench", "codecs", "--model", str(model_dir), "--history", "96",
               "--continuation", "32", "--samples", "2", "--greedy-tokens", "4",
               "--repeats", "1", "--device", "cpu", "--out", str(out),
               "--restore-chunks", "3", "--restore-rounds", "1",
               "--plot", str(tmp_path / "codecs.png")])
    assert rc == 0
    doc = json.loads(out.read_text())
    rows = {r["codec"]: r for r in doc["codecs"]}
    assert set(rows) == {"fp8", "int8", "int4"} and doc["samples"] == 2
    for r in rows.values():
        assert 0 <= r["top1_agreement"] <= 1 and r["kl"] >= 0 and r["ppl_ratio"] > 0
        assert r["encode_GBps"] > 0 and r["decode_GBps"] > 0 and r["copy_GBps"] > 0
        assert r["greedy_identical"] in (0.0, 0.5, 1.0)
    assert rows["int4"]["bytes_per_value"] < rows["fp8"]["bytes_per_value"] < 1.1
    assert rows["int4"]["ratio_vs_kv_dtype"] > 7  # float32 KV: 4 bytes a value
    assert rows["int4"]["kl"] > rows["int8"]["kl"]  # 4 bits lose more than 8
    restores = {(r["tier"], r["codec"]): r for r in doc["restore"]}
    assert {t for t, _ in restores} == {"disk", "redis"}  # redis-server is installed for CI
    for (_, codec), r in restores.items():
        assert r["kv_GBps"] > 0 and r["none_kv_GBps"] > 0 and r["dtype"] == "bfloat16"
        assert r["stored_bytes"] < r["none_stored_bytes"]
        assert r["tokens_held_ratio"] > (3 if codec == "int4" else 1.5)
    assert (tmp_path / "codecs.png").stat().st_size > 0


def test_a_missing_model_says_how_to_get_one(tmp_path, capsys):
    assert main(["bench", "codecs", "--model", str(tmp_path / "none")]) == 2
    assert "kvtier get-model" in capsys.readouterr().err


def test_restore_rows_without_a_model(tmp_path):
    out = tmp_path / "restores.json"
    rc = main(["bench", "codecs", "--restore-only", "--restore-shape", "2,2,32",
               "--codecs", "int8,int4", "--restore-chunks", "2", "--restore-rounds", "1",
               "--out", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["restore"]
    assert {(r["tier"], r["codec"]) for r in rows} >= {("disk", "int8"), ("disk", "int4")}
    for r in rows:
        assert r["chunk_shape"] == [2, 2, 256, 2, 32] and r["pool_device"] == "cpu"
        assert r["kv_GBps"] > 0 and r["none_kv_GBps"] > 0
        assert r["tokens_held_ratio"] > (3 if r["codec"] == "int4" else 1.9)


def test_the_device_route_restore_delivers_the_stored_kv(tmp_path):
    """The GPU rows' restore (copied as stored, decoded in the scatter), run on the CPU."""
    import torch

    from kvtier.benchmarks.codec_restores import FP, _restore_to_device
    from kvtier.chunk_format import encode_chunk
    from kvtier.connectors.tiers.base import ChunkWrite
    from kvtier.connectors.tiers.disk_tier import DiskTier
    from kvtier.connectors.tiers.manager import TierManager
    from kvtier.kv_codecs import Codec

    kvs = [torch.randn(2, 2, 64, 2, 32).to(torch.bfloat16) for _ in range(3)]
    keys = [f"{i:040x}" for i in range(3)]
    tier = DiskTier(tmp_path / "d", fsync=False)
    tier.codec = Codec.INT4
    manager = TierManager([tier], fingerprint=FP)
    assert manager.store([ChunkWrite.of_blob(k, encode_chunk(k, FP, kv))
                          for k, kv in zip(keys, kvs, strict=True)]).ok
    assert _restore_to_device(manager, keys, kvs, "cpu") > 0
    broken = [kv * 0 + 1e4 for kv in kvs]  # not what was stored: the check refuses it
    with pytest.raises(RuntimeError, match="not the KV"):
        _restore_to_device(manager, keys, broken, "cpu")
    manager.close()
