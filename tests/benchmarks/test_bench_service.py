"""The data-plane load test end to end at a small size: a real sidecar process, concurrent
clients, every chunk read back byte for byte, and a result file with the raw-tier ratio."""

from __future__ import annotations

import json
import os

from kvtier.cli.main import main


def test_bench_service_small_run_writes_results(tmp_path):
    out = tmp_path / "service.json"
    rc = main(
        ["bench", "service", "--chunks", "24", "--chunk-kib", "64", "--clients", "6",
         "--batch", "4", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "service" and doc["machine"]["cpu_count"] >= 1
    for phase in ("put", "get", "batch_get"):
        r = doc[phase]
        assert r["chunks"] == 24 and r["gbps"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0
    assert doc["batch_get"]["requests"] == 6
    assert doc["raw_tier"]["put_gbps"] > 0 and doc["ratio_get_vs_raw"] > 0
    one = doc["one_sync_client"]  # the connector's way: one client, bodies from/into buffers
    assert one["put"]["chunks"] == one["get"]["chunks"] == 24
    assert doc["raw_loopback_gbps"] > 0 and one["ratio_get_vs_loopback"] > 0
    if os.path.isdir("/dev/shm"):  # the same through a shared-memory region (checked bytes)
        shm = doc["one_shm_client"]
        assert shm["put"]["chunks"] == shm["get"]["chunks"] == 24 and shm["ratio_put_vs_raw"] > 0


def test_bench_service_rejects_nonsense():
    assert main(["bench", "service", "--clients", "0"]) == 2
