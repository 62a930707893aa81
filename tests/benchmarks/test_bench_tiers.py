"""`kvtier bench tiers` and `kvtier bench ttft` run end to end in a small configuration and
write the JSON their docs describe (timings themselves are judged in benchmarks/results)."""

from __future__ import annotations

import json

from kvtier.cli.main import main
from tests import redis_servers

redis_server = redis_servers.redis_server  # the real-server fixture, used by name


def test_bench_tiers_writes_ratios_for_every_tier(tmp_path):
    out = tmp_path / "tiers.json"
    argv = ["bench", "tiers", "--model", "smollm-135m", "--chunk-tokens", "16", "--chunks", "3",
            "--repeats", "1", "--disk-dir", str(tmp_path / "d"), "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "tiers" and doc["target_ratio"] == 0.8
    ops = {(r["tier"], r["op"]) for r in doc["rows"]}
    assert {("cpu", "put"), ("cpu", "get"), ("disk", "put"), ("disk", "get (cold)"),
            ("redis", "put"), ("redis", "get")} <= ops
    assert all(r["gbps"] > 0 and r["ref_gbps"] > 0 and r["ratio"] > 0 for r in doc["rows"])


def test_bench_ttft_compares_restores_with_recompute(tmp_path):
    out = tmp_path / "ttft.json"
    argv = ["bench", "ttft", "--preset", "tiny", "--models-dir", str(tmp_path / "models"),
            "--histories", "96,160", "--chunk-tokens", "32", "--repeats", "1",
            "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert [r["history_tokens"] for r in doc["rows"]] == [96, 160]
    for r in doc["rows"]:
        assert r["recompute_vs_recompute"] == 1.0
        for case in ("pool_hit", "cpu", "disk", "disk_cold"):
            assert r[f"{case}_s"] > 0
        assert r["stored_tokens"] == {"cpu": r["history_tokens"], "disk": r["history_tokens"]}
        # each restore's cost over a pool hit, against the copy of the same bytes
        assert r["copy_GBps"] > 0
        assert r["restored_bytes"]["cpu"] == r["restored_bytes"]["disk"] > 0
        for case in ("cpu", "cpu_stream", "disk", "disk_cold"):
            over = r[f"{case}_restore_overhead_s"]
            assert over == r[f"{case}_s"] - r["pool_hit_s"]
            assert r[f"{case}_GBps"] is None or r[f"{case}_GBps"] > 0
    per_token = [r["restored_bytes"]["cpu"] / r["history_tokens"] for r in doc["rows"]]
    assert per_token[0] == per_token[1]  # the KV bytes of the history, whatever its length


def test_bench_ttft_codec_rows_restore_the_same_kv_from_fewer_bytes(tmp_path, redis_server):
    out = tmp_path / "ttft.json"
    argv = ["bench", "ttft", "--preset", "tiny", "--models-dir", str(tmp_path / "models"),
            "--histories", "96", "--chunk-tokens", "32", "--repeats", "1",
            "--redis-url", redis_server.url, "--codecs", "int8,int4", "--out", str(out)]
    assert main(argv) == 0
    (r,) = json.loads(out.read_text())["rows"]
    for tier in ("disk-int8", "disk-int4", "redis-int8", "redis-int4"):
        assert r["stored_tokens"][tier] == 96  # every tier holds the history
        assert r["restored_bytes"][tier] == r["restored_bytes"]["disk"]  # KV delivered
        assert r[f"{tier}_s"] > 0 and f"{tier}_restore_overhead_s" in r
    for case in ("disk-int8_cold", "disk-int4_cold_stream"):
        assert r[f"{case}_s"] > 0
