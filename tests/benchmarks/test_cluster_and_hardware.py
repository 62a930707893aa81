"""Many nodes sharing one remote tier, and the shipped GPU hardware profiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.benchmarks.policy_sim.cluster import Cluster
from kvtier.benchmarks.policy_sim.hardware import (
    CATALOG,
    LLAMA3_8B,
    LLAMA3_70B,
    hardware,
    profile_names,
    with_network,
)
from kvtier.benchmarks.policy_sim.node import Landing, Link
from kvtier.benchmarks.policy_sim.simulator import Simulator
from kvtier.benchmarks.policy_sim.systems import SYSTEMS
from kvtier.benchmarks.policy_sim.workloads import SyntheticSpec, Turn, Workload, synthetic
from kvtier.cli.main import main
from kvtier.errors import InvalidArgumentError
from kvtier.policies.cost_model import CostModel, LinearCost, PrefillCost, TierCost
from kvtier.policies.profile import load_profile

PROFILES = Path(__file__).resolve().parents[2] / "benchmarks" / "profiles"
CHUNK = 256


def _cost() -> CostModel:
    """1 ms per prefilled token; a redis tier at 1 GB/s; 1 KB of KV per token."""
    link = LinearCost(0.0, 1e9)
    return CostModel("m", "test", 1000, 4, PrefillCost(0.0, 1e-3, 0.0),
                     {"redis": TierCost("redis", link, link)})


def _conversation(turns: int, gap_s: float = 50.0) -> Workload:
    out, keys = [], ()
    for k in range(turns):
        keys = keys + tuple(("s", 4 * k + i) for i in range(4))
        out.append(Turn("a", k * gap_s, keys, CHUNK, len(keys) * CHUNK, 0))
    return Workload("conv", out, CHUNK)


def test_one_node_of_a_cluster_replays_as_the_single_node_simulator():
    wl = synthetic(SyntheticSpec(sessions=30, session_rate_per_s=2.0), seed=3)
    cost = _cost()
    one = Simulator(wl, SYSTEMS["kvtier"], cost, 2e6, {"redis": 1e9}).run()
    clu = Cluster(wl, SYSTEMS["kvtier"], cost, 2e6, {"redis": 1e9}, nodes=1).run()
    assert clu.ttft_s == pytest.approx(one.ttft_s)


def test_a_session_moved_to_another_node_restores_from_the_shared_tier():
    wl = _conversation(4)
    # Round-robin alternates nodes: turn k's prefix was computed on the other node, whose
    # GPU this node cannot see; only the shared tier can serve it.
    rr = Cluster(wl, SYSTEMS["lmcache-like"], _cost(), 1e9, {"redis": 1e9}, 2, "round-robin")
    res = rr.run()
    assert rr.assignments == [0, 1, 0, 1]
    s = res.summary()
    assert s["hit_rate"].get("redis", 0) > 0 and s["shared_tier"]["read_bytes"] > 0
    assert s["shared_tier"]["write_bytes"] >= 4 * CHUNK * 1000  # turn 1's chunks went up
    assert [n["turns"] for n in s["nodes"]] == [2, 2]
    # Turn 2 on node 1 loads turn 1's 1,024 tokens from redis (1 MB at 1 GB/s) and
    # computes 1,024: far less than recomputing 2,048 tokens.
    assert res.ttft_s[1] < 1.5


def test_session_affinity_keeps_a_session_on_one_node_and_cache_aware_follows_the_prefix():
    wl = synthetic(SyntheticSpec(sessions=40, session_rate_per_s=4.0, turns_mean=4.0), seed=1)
    for router in ("session-affinity", "cache-aware"):
        c = Cluster(wl, SYSTEMS["vllm-like"], _cost(), 1e9, {}, 4, router)
        res = c.run()
        assert len(res.ttft_s) == len(wl.turns)
        homes: dict = {}
        for t, j in zip(wl.turns, c.assignments, strict=True):
            homes.setdefault(t.session, set()).add(j)
        if router == "session-affinity":
            assert all(len(h) == 1 for h in homes.values())
        else:  # the prefix lives in one node's GPU: an idle cluster sends the turn there
            assert sum(len(h) == 1 for h in homes.values()) >= 0.8 * len(homes)
        assert len(set(c.assignments)) == 4  # and sessions spread over the nodes
    with pytest.raises(InvalidArgumentError, match="router"):
        Cluster(wl, SYSTEMS["kvtier"], _cost(), 1e9, {}, 2, "random")


def test_shipped_hardware_profiles_are_current_and_name_their_sources():
    assert {p.stem for p in PROFILES.glob("*.json")} >= set(profile_names())
    for name in profile_names():
        doc = json.loads((PROFILES / f"{name}.json").read_text())
        assert doc == json.loads(json.dumps(hardware(name).document())), (
            f"{name}.json is stale: run `kvtier bench hardware-profiles`")
        cost, warnings = load_profile(PROFILES / f"{name}.json", machine="this laptop")
        assert warnings == []  # modelled for the machine it names
        assert set(cost.tiers) == {"cpu", "disk", "redis"}
        # PCIe and Ethernet carry reads and writes at once; a drive's share its flash
        assert cost.tiers["cpu"].duplex and cost.tiers["redis"].duplex
        assert not cost.tiers["disk"].duplex
        assert doc["sources"] and all(s["url"].startswith("https://") for s in doc["sources"])
        for check in doc["checks"]:
            assert 0.5 <= check["ratio"] <= 2.0, (name, check)  # within 2x of published
    assert LLAMA3_8B.kv_bytes_per_token == 128 * 1024  # 2 x 32 layers x 8 heads x 128 x 2 B
    assert LLAMA3_70B.kv_bytes_per_token == 320 * 1024
    h100, a100 = hardware("h100-llama-3-8b").prefill(), hardware("a100-llama-3-8b").prefill()
    assert h100.time(0, 8192) < a100.time(0, 8192)  # a faster GPU prefills faster
    tp8 = hardware("h100-llama-3-70b-tp8").prefill().time(0, 8192)
    assert tp8 < hardware("h100-llama-3-70b-tp4").prefill().time(0, 8192)
    assert len(CATALOG.profiles) >= 7


def test_the_network_option_replaces_the_remote_tier():
    cost = hardware("a100-llama-3-8b").cost_model()
    fast = with_network(cost, "100gbe")
    assert fast.tiers["redis"].read.bandwidth_bps > cost.tiers["redis"].read.bandwidth_bps
    assert fast.tiers["cpu"] == cost.tiers["cpu"] and fast.tiers["redis"].duplex


def test_a_write_delays_a_read_only_where_the_medium_has_one_path():
    link = LinearCost(0.0, 1e9)
    drive, pcie = Link.of(TierCost("disk", link, link)), Link.of(TierCost("cpu", link, link, duplex=True))
    for path in (drive, pcie):
        assert path.write_path.transfer(0.0, 1.0) == 1.0  # a write queued first
    assert drive.transfer(0.0, 0.5) == 1.5  # the drive's read waits behind it
    assert pcie.transfer(0.0, 0.5) == 0.5  # PCIe's read moves the other way at once
    assert pcie.write_path.transfer(0.0, 1.0) == 2.0  # writes still queue behind writes


def test_a_drive_serves_reads_ahead_of_background_writes():
    """As the tiers do (waited-for transfers first): a read a turn waits for goes ahead of
    queued demotions, after the chunk in flight, and pushes them back; a copy's landing
    moves with them. On a duplex medium a write-back a turn waits for goes ahead of the
    background writes the same way, and reads never wait for writes."""
    link = LinearCost(0.0, 1e9)
    drive = Link.of(TierCost("disk", link, link))
    marks = []
    for i in range(4):  # four background chunk writes of 0.25 s queued at 0
        marks.append(drive.mark)
        assert drive.transfer(0.0, 0.25, background=True) == pytest.approx(0.25 * (i + 1))
    assert drive.transfer(0.1, 0.5) == pytest.approx(0.85)  # after the chunk in flight
    assert drive.idle_at == pytest.approx(1.5)  # the writes end 0.5 s later
    assert Landing(0.25, drive, marks[0]).at() == pytest.approx(0.25)  # done before it
    assert Landing(1.0, drive, marks[3]).at() == pytest.approx(1.5)  # pushed back
    assert drive.transfer(0.2, 0.5) == pytest.approx(1.35)  # right behind the read before
    assert drive.wait_s(0.9) == pytest.approx(0.45)  # what a read waits for: reads only
    assert drive.idle_at == pytest.approx(2.0)
    pcie = Link.of(TierCost("cpu", link, link, duplex=True))
    for _ in range(4):
        pcie.write_path.transfer(0.0, 0.25, background=True)
    assert pcie.write_path.transfer(0.0, 0.5) == pytest.approx(0.75)  # after one chunk
    assert pcie.transfer(0.0, 0.5) == 0.5  # the reads' direction is free
    assert pcie.write_path.idle_at == pytest.approx(1.5)


def test_the_cli_runs_a_cluster_on_a_hardware_profile(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(["bench", "policies", "--profile", "h100-llama-3-8b", "--nodes", "2",
               "--router", "session-affinity", "--sessions", "20", "--workloads", "multiturn",
               "--budgets", "0.5", "--systems", "recompute-only,kvtier", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    row = doc["workloads"]["multiturn"]["budgets"]["0.5"]["kvtier"]
    assert len(row["nodes"]) == 2 and sum(n["turns"] for n in row["nodes"]) == row["turns"]
    assert "shared_tier" in row and doc["config"]["nodes"] == 2
    capsys.readouterr()
    assert main(["bench", "policies", "--profile", "no-such-gpu", "--workloads", "multiturn"]) != 0
    assert "no profile 'no-such-gpu'" in capsys.readouterr().err
