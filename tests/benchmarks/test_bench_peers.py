"""``kvtier bench peers`` end to end at a small size, kvtier's side: every tier stores and
restores the KV bit-exact through KVTransfer, each row next to its raw medium, written as
the documented JSON rows. (The LMCache side runs in its own environment: tests_lmcache.)"""

from __future__ import annotations

import json

import pytest

from kvtier.cli.main import main


def test_bench_peers_small_run_writes_rows(tmp_path):
    out = tmp_path / "peers.json"
    rc = main(
        ["bench", "peers", "--model", "smollm-135m", "--sessions", "2", "--tokens", "512",
         "--tiers", "cpu,disk,redis", "--lmcache-python", str(tmp_path / "no-lmcache"),
         "--codecs", "int8,int4", "--disk-dir", str(tmp_path), "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "peers" and doc["config"]["total_bytes"] == 2 * 512 * 30 * 2 * 3 * 64 * 2
    rows = {(r["tier"], r["op"]): r for r in doc["rows"]}
    connector = [rows.pop(("cpu", f"vllm connector {op}")) for op in ("store", "retrieve")]
    assert set(rows) == {(t, op) for t in ("cpu", "disk", "redis") for op in ("store", "retrieve")}
    for r in connector:  # vLLM's layout, the same bytes, the same round
        assert r["kvtier_bit_exact"] is True and r["kvtier_GBps"] > 0
        (restore,) = r["round_ratios"]["vs_engine_retrieve"]  # one round: its own ratio
        assert r["vs_engine_restore"] == restore > 0 and r["vs_engine_store"] > 0
    for r in rows.values():
        assert r["kvtier_bit_exact"] is True
        assert r["kvtier_GBps"] > 0 and r["raw_GBps"] > 0 and r["raw"]
        # one round: the round's own ratio is the ratio of the figures shown
        assert r["kvtier_vs_raw"] == pytest.approx(r["kvtier_GBps"] / r["raw_GBps"], rel=0.02, abs=2e-3)
        assert r["round_ratios"]["raw"] == [pytest.approx(r["kvtier_vs_raw"], abs=2e-3)]
        assert r["lmcache_GBps"] is None  # no LMCache environment given: nothing made up
        assert "lmcache_fsync_GBps" not in r
    codecs = {(r["tier"], r["op"], r["codec"]): r for r in doc["codec_rows"]}
    assert set(codecs) == {(t, op, c) for t in ("disk", "redis") for op in ("store", "retrieve")
                           for c in ("int8", "int4")}
    for r in codecs.values():  # the same sessions, within each codec's bound
        assert r["within_bound"] is True and r["kv_GBps"] > 0 and r["none_kv_GBps"] > 0
    cold = rows[("disk", "retrieve")]  # the reference is the quicker of two cold reads
    assert cold["raw_GBps"] == pytest.approx(max(cold["raw_buffered_GBps"], cold["raw_direct_GBps"]), rel=0.02)


def test_bench_peers_rejects_nonsense():
    assert main(["bench", "peers", "--tiers", "cpu,tape"]) == 2
    assert main(["bench", "peers", "--tokens", "300"]) == 2  # not whole chunks


def test_ratios_pair_each_round_with_itself():
    """A medium that drifts between rounds (here 1, 4 and 2 GB/s) must not be compared
    at its best against kvtier at its worst: each round's ratio, then the median."""
    from kvtier.benchmarks.peers import _round_ratios

    gb = 1e9
    rounds = [({"store_s": 2.0}, {"store_s": 1.0, "bytes": gb}, {"store_s": 1.0}),
              ({"store_s": 0.5}, {"store_s": 0.25, "bytes": gb}, {"store_s": 0.25}),
              ({"store_s": 1.0}, {"error": "x"}, {"store_s": 0.8})]
    got = _round_ratios(rounds, "store_s", int(gb))
    assert got["raw"] == [0.5, 0.5, 0.8] and got["lmcache"] == [0.5, 0.5]
