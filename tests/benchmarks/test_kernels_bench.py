"""``kvtier bench kernels`` in its quick CPU mode: runs, prints, writes the promised JSON."""

from __future__ import annotations

import json

from kvtier.benchmarks import kernels as bench
from kvtier.cli.main import main


def test_quick_cpu_run_writes_json(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    assert main(["bench", "kernels", "--quick", "--device", "cpu", "--repeats", "1",
                 "--warmup", "0", "--out", str(out)]) == 0
    assert "paged decode attention" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["suite"] == "kernels" and doc["device"] == "cpu" and doc["backend"] == "torch"
    assert doc["machine"]["cpu_count"] >= 1
    assert doc["copy"]["gbps"] > 0
    assert doc["decode"] and doc["prefill"] and doc["gather_scatter"]
    for row in doc["decode"]:
        for key in ("batch", "context", "kv_bytes", "paged_ms", "paged_gbps", "bw_vs_copy",
                    "sdpa_ms", "paged_over_sdpa"):
            assert key in row, key
        assert row["kv_bytes"] > 0 and row["paged_ms"] > 0
    for row in doc["prefill"]:
        assert row["paged_ms"] > 0 and row["paged_over_sdpa"] > 0
    for row in doc["gather_scatter"]:
        assert row["gather_vs_copy"] > 0 and row["scatter_vs_copy"] > 0
    codecs = {r["codec"]: r for r in doc["codec_scatter"]}
    assert set(codecs) == {"fp8", "int8", "int4"}
    assert all(r["kv_gbps"] > 0 and r["vs_copy"] > 0 for r in codecs.values())
    assert codecs["int4"]["stored_bytes"] < codecs["int8"]["stored_bytes"] < codecs["int8"]["kv_bytes"]
    assert set(doc["summary"]["met"]) == {"decode_bw_vs_copy", "paged_vs_contiguous",
                                          "gather_scatter_bw_vs_copy"}
    # GPU targets are never judged on a CPU run.
    assert all(v is None for v in doc["summary"]["met"].values())


def test_cpu_run_without_out_writes_nothing(capsys):
    before = sorted(bench.RESULTS_DIR.glob("kernels*")) if bench.RESULTS_DIR.exists() else []
    assert main(["bench", "kernels", "--quick", "--device", "cpu", "--repeats", "1",
                 "--warmup", "0"]) == 0
    after = sorted(bench.RESULTS_DIR.glob("kernels*")) if bench.RESULTS_DIR.exists() else []
    assert after == before
    assert "wrote" not in capsys.readouterr().out


def test_targets_judged_on_gpu_payload():
    payload = {
        "device": "cuda",
        "copy": {"gbps": 3000.0},
        "decode": [{"batch": 32, "context": 4096, "paged_gbps": 2500.0, "paged_ms": 1.0,
                    "sdpa_ms": 1.02}],
        "prefill": [{"paged_ms": 2.0, "sdpa_ms": 1.0}],
        "gather_scatter": [{"gather_gbps": 2700.0, "scatter_gbps": 2400.0}],
    }
    s = bench.summarise(payload)
    assert s["met"] == {"decode_bw_vs_copy": True, "paged_vs_contiguous": False,
                        "gather_scatter_bw_vs_copy": True}
