"""The trace family (issue 34): members spread over every axis (one per stratum), seeded,
replayed by `kvtier bench policies --family`, and the robustness summary computed right."""

from __future__ import annotations

import json
import math

import pytest

from kvtier.benchmarks.policy_sim.family import AXES, PREFIX, family, member_specs, robustness
from kvtier.cli.main import main


def _position(axis: str, value: float) -> float:
    scale, lo, hi = AXES[axis]
    if scale == "log":
        return (math.log(max(value, lo)) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return (value - lo) / (hi - lo)


@pytest.mark.parametrize("axis", ["turns_mean", "think_median_s", "think_sigma",
                                  "session_rate_per_s"])
def test_every_axis_is_spread_one_member_per_stratum(axis):
    n = 24
    specs = member_specs(n, seed=3)
    strata = sorted(int(_position(axis, getattr(s, axis)) * n) for s in specs)
    assert strata == list(range(n))  # Latin hypercube: each stratum used once


def test_members_are_seeded_and_span_single_turn_to_long_chats():
    a, b, c = member_specs(12, seed=1), member_specs(12, seed=1), member_specs(12, seed=2)
    assert a == b and a != c
    turns = [s.turns_mean for s in a]
    assert min(turns) < 1.5 and max(turns) > 5  # mostly single-turn ... long conversations
    assert min(s.system_tokens for s in a) == 0 or min(s.system_tokens for s in a) < 16
    wls = family(3, seed=1, sessions=15)
    assert [w.name for w in wls] == [f"{PREFIX}00", f"{PREFIX}01", f"{PREFIX}02"]
    assert all(w.turns and set(w.meta["family_spec"]) == set(AXES) for w in wls)
    with pytest.raises(ValueError):
        member_specs(0)


def _row(mean: float, p99: float) -> dict:
    return {"ttft_mean_s": mean, "ttft_p99_s": p99}


def test_robustness_compares_with_the_best_other_system():
    results = {
        "family-00": {"budgets": {"1": {"kvtier": _row(1.0, 4.0), "a": _row(1.1, 3.0),
                                        "b": _row(0.9, 5.0)}}},
        "family-01": {"budgets": {"1": {"kvtier": _row(0.5, 1.0), "a": _row(0.6, 1.2)}}},
        "multiturn": {"budgets": {"1": {"kvtier": _row(9.0, 9.0), "a": _row(1.0, 1.0)}}},
    }
    results["family-01"]["budgets"]["1"]["kvtier-adaptive"] = _row(0.1, 0.1)  # not a rival
    r = robustness(results)
    assert r["members"] == 2 and len(r["cells"]) == 2  # other workloads are not members
    first = r["cells"][0]
    assert first["mean_vs_best"] == pytest.approx(1.0 / 0.9) and first["best_other"] == "b"
    assert first["p99_vs_best"] == pytest.approx(4.0 / 3.0)  # best p99 of any other
    assert r["worst_mean_vs_best"] == pytest.approx(1.0 / 0.9)
    assert r["lowest_mean_share"] == 0.5 and r["mean_within_1pct"] == 0.5
    assert robustness({"multiturn": results["multiturn"]}) == {"cells": [], "members": 0}


def test_bench_policies_family_writes_the_robustness_table(tmp_path):
    out = tmp_path / "family.json"
    assert main(["bench", "policies", "--workloads", "none", "--family", "2", "--sessions", "20",
                 "--budgets", "1.0", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["workloads"]) == {"family-00", "family-01"}
    assert all("family_spec" in e for e in doc["workloads"].values())
    robust = doc["robustness"]
    assert robust["members"] == 2 and len(robust["cells"]) == 2
    assert all(c["mean_vs_best"] > 0 and c["p99_vs_best"] > 0 for c in robust["cells"])
    assert main(["bench", "policies", "--workloads", "none", "--family", "-1"]) != 0
    assert main(["bench", "policies", "--workloads", "none", "--family", "2", "--sessions", "20",
                 "--budgets", "1.0", "--systems", "vllm-like,kvtier,kvtier-adaptive",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    adaptive = doc["robustness_adaptive"]
    assert adaptive["system"] == "kvtier-adaptive" and len(adaptive["cells"]) == 2
    assert {c["best_other"] for c in adaptive["cells"] + doc["robustness"]["cells"]} == {"vllm-like"}


def test_a_nodes_gpu_holds_at_least_the_longest_request(tmp_path):
    """Spread over eight nodes, a small budget of a light workload's working set is less
    than one request: no engine starts that way, so each node's pool is floored at the
    longest request's context, and where the share is larger it is the share."""
    from kvtier.benchmarks.policy_sim.cli import gpu_bytes_per_node

    assert gpu_bytes_per_node(0.25, 8_000.0, 8, 1_000.0) == 1_000.0
    assert gpu_bytes_per_node(1.0, 80_000.0, 8, 1_000.0) == 10_000.0
    out = tmp_path / "family.json"
    assert main(["bench", "policies", "--workloads", "none", "--family", "1", "--sessions", "12",
                 "--budgets", "0.01,1.0", "--nodes", "8", "--systems", "vllm-like,kvtier",
                 "--out", str(out)]) == 0
    entry = json.loads(out.read_text())["workloads"]["family-00"]
    per_node = entry["gpu_bytes_per_node"]
    assert per_node["0.01"] == entry["longest_context_bytes"] > 0.01 * entry["working_set_bytes"] / 8
    assert per_node["1"] == max(entry["working_set_bytes"] / 8, entry["longest_context_bytes"])
