"""A sampled eviction (cost-aware past 64 keys) picks the same victims in every process:
ties must not be broken by string hashes, which Python salts per process, or recorded
benchmark results could not be reproduced."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
from kvtier.policies.eviction import ChunkInfo, CostAware
pol = CostAware(half_life_s=1.0)
for i in range(300):  # equal values: every victim is a tie
    pol.insert(f"chunk-{i:04d}", ChunkInfo(nbytes=100, recompute_s=1.0), 0.0)
out = []
for _ in range(40):
    v = pol.victim(10.0)
    out.append(v)
    pol.remove(v)
print(",".join(out))
"""


def _victims(hash_seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          check=True)
    return done.stdout.strip()


def test_sampled_victims_do_not_depend_on_the_process_hash_seed():
    first = _victims("1")
    assert len(first.split(",")) == 40
    assert _victims("2") == first
    assert _victims("3") == first
