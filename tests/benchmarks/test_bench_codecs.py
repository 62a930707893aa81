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
