"""The LMCache side of ``kvtier bench peers``: a real LMCache 0.5 engine stores and
retrieves the benchmark's KV through its CPU and disk backends, checked bit for bit, in a
process of its own (as the benchmark runs it), and reports the documented RESULT line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.lmcache


@pytest.mark.parametrize("backend", ["cpu", "disk"])
def test_lmcache_stores_and_retrieves_the_same_kv_bit_exact(tmp_path, backend):
    cmd = [sys.executable, "-m", "kvtier.benchmarks.peers_lmcache", "--backend", backend,
           "--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--tokens", "512",
           "--sessions", "2", "--chunk-tokens", "256", "--workdir", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stderr[-2000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["bit_exact"] is True
    assert result["bytes"] == 2 * 2 * 2 * 512 * 2 * 16 * 2  # sessions * K/V * layers * tokens * H*D * bf16
    assert result["store_s"] > 0 and result["retrieve_s"] > 0
    if backend == "disk":  # the same store made durable (every file and directory synced)
        assert result["store_fsync_s"] >= result["store_s"]
    else:
        assert result["store_fsync_s"] is None
