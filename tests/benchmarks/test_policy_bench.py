"""The policy benchmark: workloads (synthetic, Mooncake, CSV), the simulator on
hand-computable cases, calibration profiles and the CLI's errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvtier.benchmarks.policy_sim.simulator import Simulator
from kvtier.benchmarks.policy_sim.systems import DEFAULT_SYSTEMS, SYSTEMS, system
from kvtier.benchmarks.policy_sim.workloads import (
    SyntheticSpec,
    Turn,
    Workload,
    from_csv,
    mooncake,
    synthetic,
)
from kvtier.cli.main import main
from kvtier.errors import ConfigError, InvalidArgumentError, TraceFormatError
from kvtier.policies.cost_model import CostModel, LinearCost, PrefillCost, TierCost
from kvtier.policies.eviction import ChunkInfo
from kvtier.policies.profile import load_profile, save_profile

CHUNK = 256


def _cost(tier_bw: float = 1e12, latency: float = 0.0) -> CostModel:
    """1 ms per prefilled token, nothing else; 1 KB of KV per token."""
    t = lambda n: TierCost(n, LinearCost(latency, tier_bw), LinearCost(latency, tier_bw))  # noqa: E731
    return CostModel("m", "test", 1000, 4, PrefillCost(0.0, 1e-3, 0.0),
                     {"cpu": t("cpu"), "disk": t("disk")})


def _two_turns(gap_s: float = 100.0) -> Workload:
    k1 = tuple(("s", i) for i in range(4))  # 1024 tokens
    k2 = k1 + (("s", 4), ("s", 5))  # 1536 tokens
    return Workload("two", [
        Turn("a", 0.0, k1, CHUNK, 1024, 0),
        Turn("a", gap_s, k2, CHUNK, 1536, 0),
    ], CHUNK)


def test_simulated_ttft_is_the_prefill_of_what_is_not_reused():
    wl = _two_turns()
    big = 1e9
    rec = Simulator(wl, SYSTEMS["recompute-only"], _cost(), big, {"cpu": big}).run()
    assert rec.ttft_s == pytest.approx([1.024, 1.536])
    vllm = Simulator(wl, SYSTEMS["vllm-like"], _cost(), big, {}).run()
    assert vllm.ttft_s == pytest.approx([1.024, 0.512])  # the 4 chunks of turn 1 are hits
    assert vllm.saved_tokens == 1024


def test_a_reply_kept_in_the_gpu_is_reused_by_the_next_turn():
    k1 = tuple(("s", i) for i in range(4))
    wl = Workload("reply", [
        Turn("a", 0.0, k1, CHUNK, 1024, 512, reply_keys=(("s", 4), ("s", 5))),
        Turn("a", 100.0, k1 + tuple(("s", i) for i in range(4, 7)), CHUNK, 1792, 0),
    ], CHUNK)
    keep = Simulator(wl, SYSTEMS["vllm-like"], _cost(), 1e9, {}).run()
    assert keep.ttft_s[1] == pytest.approx(0.256)  # only the new message is computed
    drop = dataclasses.replace(SYSTEMS["vllm-like"], keep_reply=False)
    assert Simulator(wl, drop, _cost(), 1e9, {}).run().ttft_s[1] == pytest.approx(0.768)
    # LMCache stores at prefill: once the GPU lets the reply go, its tiers lack it
    first = Workload("first", wl.turns[:1], CHUNK)
    lm = Simulator(first, SYSTEMS["lmcache-like"], _cost(), 1e9, {"cpu": 1e9}).run()
    assert lm.write_bytes["cpu"] == 1024 * 1000  # 4 prompt chunks, not the 2 of the reply
    # the reuse ceiling: of 11 prompt chunks, the second turn's 4 repeated and 2 from the
    # reply could be served (6 / 11); keeping the reply, vllm-like reaches it
    ceiling = wl.reuse_ceiling()
    assert ceiling["exact"] == pytest.approx(6 / 11) and ceiling["prompt_chunks"] == 11
    assert ceiling["estimate"] == pytest.approx(6 / 11, abs=0.01)
    assert 1 - keep.summary()["hit_rate"]["miss"] == pytest.approx(6 / 11)


def test_arrivals_are_stretched_for_the_busiest_stretch_of_the_workload():
    from kvtier.benchmarks.policy_sim.cli import offered_load

    calm = [Turn(i, float(i), (("c", i),), CHUNK, 100, 0) for i in range(100)]
    burst = [Turn(100 + i, 100.0 + i / 4, (("b", i),), CHUNK, 100, 0) for i in range(100)]
    # 0.1 s of prefill per turn: 0.1 busy in the calm half, 0.4 in the burst
    assert offered_load(Workload("w", calm + burst, CHUNK), _cost()) == pytest.approx(0.4, rel=0.1)


def test_a_gpu_too_small_sends_kvtier_to_the_cpu_tier_and_loads_back():
    wl = Workload("two", [
        *_two_turns().turns[:1],
        Turn("b", 10.0, tuple(("b", i) for i in range(4)), CHUNK, 1024, 0),
        Turn("a", 200.0, tuple(("s", i) for i in range(6)), CHUNK, 1536, 0),
    ], CHUNK)
    gpu = 4 * CHUNK * 1000  # room for one session's 4 chunks
    res = Simulator(wl, SYSTEMS["kvtier"], _cost(), gpu, {"cpu": 1e9, "disk": 1e9}).run()
    assert res.hits.get("cpu", 0) == 4 and res.read_bytes["cpu"] == 4 * CHUNK * 1000
    assert res.ttft_s[2] == pytest.approx(0.512, rel=1e-3)  # loads are free at 1 TB/s
    vllm = Simulator(wl, SYSTEMS["vllm-like"], _cost(), gpu, {}).run()
    assert vllm.ttft_s[2] == pytest.approx(1.536)


def test_kvtier_stores_the_next_victim_ahead_so_a_turn_never_waits_for_a_write():
    """GPU of 8 chunks, CPU tier of 4, writes at 0.128 s a chunk (still worth storing). z is
    stored as it is computed, into the empty CPU tier (it leaves for free at b's arrival).
    At c's the tier is full: kvtier still stores the next to leave ahead of need,
    displacing older copies, so c drops them without waiting; a write-back system pays
    the 4 writes on c's admission."""
    def four(name):
        return tuple((name, i) for i in range(4))

    wl = Workload("stage", [Turn(n, at, four(n), CHUNK, 1024, 0)
                            for n, at in (("z", 0.0), ("a", 1.0), ("b", 10.0), ("c", 20.0))], CHUNK)
    cost = _cost(tier_bw=2e6)  # 256 KB chunk: 0.128 s to write or load, recompute 0.256 s
    gpu, tiers = 8 * CHUNK * 1000, {"cpu": 4 * CHUNK * 1000}
    k = Simulator(wl, SYSTEMS["kvtier"], cost, gpu, tiers).run()
    assert k.decisions.get("store_cpu") == 4 and k.decisions.get("stage_ahead_cpu", 0) >= 4
    assert not any(d.startswith("offload_") for d in k.decisions)  # nothing on an admission
    assert k.breakdown["write_back_s"] == 0 and k.ttft_s[3] == pytest.approx(1.024)
    wb = Simulator(wl, SYSTEMS["cachedattention-like"], cost, gpu, tiers).run()
    assert wb.ttft_s[3] == pytest.approx(1.024 + 4 * 0.128)


def test_slow_tiers_are_never_read_by_kvtier_but_are_by_load_any_hit():
    wl = Workload("two", [
        *_two_turns().turns[:1],
        Turn("b", 10.0, tuple(("b", i) for i in range(4)), CHUNK, 1024, 0),
        Turn("a", 200.0, tuple(("s", i) for i in range(6)), CHUNK, 1536, 0),
    ], CHUNK)
    slow = _cost(tier_bw=1e4, latency=1.0)  # 25 s per chunk: recompute (0.256 s) wins
    gpu = 4 * CHUNK * 1000
    k = Simulator(wl, SYSTEMS["kvtier"], slow, gpu, {"cpu": 1e9, "disk": 1e9}).run()
    assert k.hits.get("cpu", 0) == 0 and k.ttft_s[2] == pytest.approx(1.536)
    lm = Simulator(wl, SYSTEMS["lmcache-like"], slow, gpu, {"cpu": 1e9, "disk": 1e9}).run()
    assert lm.hits.get("cpu", 0) > 0 and lm.ttft_s[2] > 10


def test_synthetic_sessions_share_system_prompt_chunks_and_are_seeded():
    spec = SyntheticSpec(sessions=30, system_prompts=2, system_tokens=512)
    a, b = synthetic(spec, seed=1), synthetic(spec, seed=1)
    assert a.turns == b.turns
    firsts = {t.chunk_keys[:2] for t in a.turns}
    assert len(firsts) == 2  # two system prompts, 2 chunks each, shared by all sessions
    by_session: dict = {}
    for t in a.turns:
        prev = by_session.get(t.session)
        if prev is not None:  # a later turn extends the earlier prompt's full chunks
            assert t.prompt_tokens > prev.prompt_tokens and t.arrival_s > prev.arrival_s
            full = prev.prompt_tokens // CHUNK
            assert t.chunk_keys[:full] == prev.chunk_keys[:full]
            # the reply's full chunks are the next prompt's chunks at those positions
            n_reply = (prev.prompt_tokens + prev.output_tokens) // CHUNK - full
            assert len(prev.reply_keys) == n_reply
            assert t.chunk_keys[full:full + n_reply] == prev.reply_keys
        by_session[t.session] = t
    assert a.peak_live_tokens() > 0


def test_mooncake_sessions_are_rebuilt_from_shared_prefixes(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1200, "output_length": 400, "hash_ids": [1, 2, 3]},
        {"timestamp": 5, "input_length": 600, "output_length": 500, "hash_ids": [1, 9]},
        # continues the first: its full blocks [1, 2] then new ones
        {"timestamp": 9, "input_length": 2000, "output_length": 5, "hash_ids": [1, 2, 7, 8]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    wl = mooncake(path)
    assert [t.session for t in wl.turns] == [0, 1, 0]
    assert wl.turns[2].chunk_keys[:2] == (1, 2) and wl.turns[0].arrival_s == 0.0
    assert wl.turns[2].arrival_s == pytest.approx(0.009)
    # 1200 + 400 tokens fill a third block: the next request's third block is the reply's
    assert wl.turns[0].reply_keys == (7,)
    # a reply no later request holds gets keys of its own, which nothing shares
    (own,) = wl.turns[1].reply_keys
    assert own not in {k for t in wl.turns for k in t.chunk_keys}
    path.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(TraceFormatError, match=r"t.jsonl:2"):
        mooncake(path)
    path.write_text(json.dumps({**rows[0], "hash_ids": [1]}) + "\n")
    with pytest.raises(TraceFormatError, match="needs 3 hash_ids"):
        mooncake(path)


def test_csv_turns_build_growing_prompts_and_reject_bad_files(tmp_path):
    path = tmp_path / "turns.csv"
    path.write_text("session_id,arrival_s,new_tokens,output_tokens,system_tokens,system_id\n"
                    "u1,0,300,300,512,sys\nu1,60,100,50,512,sys\nu2,1,10,5,512,sys\n")
    wl = from_csv(path)
    u1 = [t for t in wl.turns if t.session == "u1"]
    assert [t.prompt_tokens for t in u1] == [812, 1212]
    assert u1[0].reply_keys == (u1[1].chunk_keys[3],)  # 812 + 300 tokens fill chunk 3
    u2 = next(t for t in wl.turns if t.session == "u2")
    assert u2.chunk_keys[:2] == u1[0].chunk_keys[:2]  # the shared system prompt
    path.write_text("session_id,arrival_s,new_tokens\nu1,0,3\n")
    with pytest.raises(TraceFormatError, match="missing column.*output_tokens"):
        from_csv(path)
    path.write_text("session_id,arrival_s,new_tokens,output_tokens\nu1,zero,3,4\n")
    with pytest.raises(TraceFormatError, match=":2: bad value"):
        from_csv(path)


def test_profiles_flag_another_model_or_machine(tmp_path):
    path = save_profile(tmp_path / "p.json", _cost(), {"note": "test"})
    cost, warnings = load_profile(path, model_fingerprint="m", machine="test")
    assert cost == _cost() and warnings == []
    _, warnings = load_profile(path, model_fingerprint="other", machine="elsewhere")
    assert len(warnings) == 2 and "another model" in warnings[0] and "another machine" in warnings[1]
    with pytest.raises(ConfigError, match="does not exist.*kvtier calibrate"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"kvtier_profile": 1, "cost_model": {"model": "m"}}')
    with pytest.raises(ConfigError, match="bad.json"):
        load_profile(tmp_path / "bad.json")


def test_bench_policies_cli_runs_and_reports_bad_input(tmp_path, capsys):
    prof = save_profile(tmp_path / "p.json", _cost(tier_bw=1e9), {})
    out = tmp_path / "r.json"
    rc = main(["bench", "policies", "--workloads", "multiturn", "--sessions", "20",
               "--budgets", "0.5", "--profile", str(prof), "--out", str(out),
               "--plot", str(tmp_path / "plots")])
    assert rc == 0
    doc = json.loads(out.read_text())
    rows = doc["workloads"]["multiturn"]["budgets"]["0.5"]
    assert set(rows) == set(DEFAULT_SYSTEMS)  # kvtier-adaptive is opt-in
    assert rows["kvtier"]["ttft_mean_s"] < rows["recompute-only"]["ttft_mean_s"]
    ceiling = doc["workloads"]["multiturn"]["reuse_ceiling"]["exact"]
    assert 0 < ceiling < 1  # shared system prompts and follow-ups: reuse, bounded
    for r in rows.values():  # no system serves more than the workload allows
        assert 1 - r["hit_rate"].get("miss", 0.0) <= ceiling + 1e-9
    assert doc["config"]["profile_warnings"]  # the test profile is from "another machine"
    assert (tmp_path / "plots" / "policies-multiturn-ttft-cdf.png").stat().st_size > 0
    with pytest.raises(InvalidArgumentError, match="unknown system policy 'nope'"):
        system("nope")
    assert main(["bench", "policies", "--systems", "nope", "--profile", str(prof)]) != 0
    assert main(["bench", "policies", "--profile", str(tmp_path / "none.json")]) != 0
    err = capsys.readouterr().err
    assert "nope" in err and "kvtier calibrate" in err


def test_a_compressing_tier_holds_more_sessions_and_moves_fewer_bytes():
    """A CPU tier of 4 chunks, a GPU of 4: a and b (4 chunks each) take turns, then a comes
    back. Uncompressed, the tier holds one session (b's displaced a's); at half the bytes it
    holds both, so a's return loads from it (4 hits, half the bytes read) instead of
    recomputing; with a decode slower than recompute, kvtier recomputes (its restore
    decision sees the codec's costs) while a load-any-hit system pays the decode."""
    from kvtier.policies.cost_model import TierCodec

    def four(name):
        return tuple((name, i) for i in range(4))

    wl = Workload("cap", [Turn(n, at, four(n), CHUNK, 1024, 0) for n, at in
                          (("a", 0.0), ("b", 10.0), ("a", 30.0))], CHUNK)
    gpu, tiers = 4 * CHUNK * 1000, {"cpu": 4 * CHUNK * 1000}
    half = dataclasses.replace(_cost(tier_bw=1e9), codecs={"cpu": TierCodec("int8", 0.5, 2e9)})
    for name in ("lmcache-like", "kvtier"):
        plain = Simulator(wl, SYSTEMS[name], _cost(tier_bw=1e9), gpu, tiers).run()
        assert plain.hits.get("cpu", 0) == 0 and plain.ttft_s[2] == pytest.approx(1.024)
        packed = Simulator(wl, SYSTEMS[name], half, gpu, tiers).run()
        assert packed.hits.get("cpu", 0) == 4
        assert packed.read_bytes["cpu"] == pytest.approx(0.5 * 4 * CHUNK * 1000)
        assert packed.ttft_s[2] < 0.01  # loaded (about 1 ms of link and decode)
    slow_decode = dataclasses.replace(half, codecs={"cpu": TierCodec("int8", 0.5, 1e5)})
    k = Simulator(wl, SYSTEMS["kvtier"], slow_decode, gpu, tiers).run()  # 10 s of decode
    assert k.hits.get("cpu", 0) == 0 and k.ttft_s[2] == pytest.approx(1.024)  # recomputed
    lm = Simulator(wl, SYSTEMS["lmcache-like"], slow_decode, gpu, tiers).run()
    assert lm.hits.get("cpu", 0) == 4 and lm.ttft_s[2] > 10


def test_kvtier_stops_writing_back_what_nobody_asks_for_again():
    """One-shot requests with nothing in common: every GPU victim is a bet that never pays.
    A write-back system keeps paying 4 writes (0.512 s) on each admission once the GPU is
    full; kvtier stores as it computes and ahead of need while the link is idle, so no
    turn waits for a write, and it learns from its victims that none is asked for again
    (what an admission-path write would then bet on)."""
    def four(name):
        return tuple((name, i) for i in range(4))

    wl = Workload("one-shot", [Turn(f"s{n}", 10.0 * n, four(f"s{n}"), CHUNK, 1024, 0)
                               for n in range(30)], CHUNK)
    cost = _cost(tier_bw=2e6)  # 0.128 s to write or load a chunk, 0.256 s to recompute it
    gpu, tiers = 8 * CHUNK * 1000, {"cpu": 8 * CHUNK * 1000}
    sim = Simulator(wl, SYSTEMS["kvtier"], cost, gpu, tiers)
    k = sim.run()
    ca = Simulator(wl, SYSTEMS["cachedattention-like"], cost, gpu, tiers).run()
    assert ca.breakdown["write_back_s"] > 10 * 4 * 0.128
    assert k.breakdown["write_back_s"] == 0 and sum(k.ttft_s) < sum(ca.ttft_s)
    assert sim.live.victims.let_go_total >= 100 and sim.live.victims.reused_total == 0
    assert sim.live.p_return("s0") < 0.2


def test_a_turn_does_not_wait_for_a_slow_copy_in_flight_when_a_faster_one_is_raised():
    """A GPU victim whose only copy is still being written to a slow tier is raised to the
    fast one on the admission path: its blocks then wait for both copies, unless the slow
    one is worth less than the wait, when it is dropped unfinished (as a victim with no
    raise would drop it); a copy about to land is waited for."""
    def sim_with_copy_landing_at(landing_s: float) -> tuple[Simulator, tuple, int]:
        t = lambda n, w: TierCost(n, LinearCost(0.0, 1e12), LinearCost(0.0, w))  # noqa: E731
        chunk_bytes = CHUNK * 1000
        cost = CostModel("m", "test", 1000, 4, PrefillCost(0.0, 1e-3, 0.0),
                         {"cpu": t("cpu", 1e12), "disk": t("disk", chunk_bytes / landing_s)})
        keys = tuple(("a", i) for i in range(4))
        wl = Workload("raise", [Turn("a", 0.0, keys, CHUNK, 1024, 0)], CHUNK)
        sim = Simulator(wl, SYSTEMS["kvtier"], cost, 1e9, {"cpu": 1e9, "disk": 1e9})
        sim.step(0, wl.turns[0])  # computed, and stored in the CPU tier
        sim.tiers[0].remove(keys[0])  # which later let it go
        for i in range(30):  # sessions come back: copies where restores are fastest pay
            sim.live.turn_ended(("seen", i), at=0.0)
            sim.live.turn_started(("seen", i), now=5.0)
        assert sim.live.raises_copies()
        now = 10.0
        landing = sim.write(1, keys[0], CHUNK, ChunkInfo(chunk_bytes), now)  # to disk, in flight
        assert landing == pytest.approx(now + landing_s)
        return sim, keys[0], chunk_bytes

    sim, key, nbytes = sim_with_copy_landing_at(30.0)  # a chunk recomputes in 0.256 s
    done = sim.evict_from_gpu([(key, nbytes)], 10.0, blocking=True, waiting_until=10.0)
    assert done == pytest.approx(10.0)  # the fast copy is down at once; the slow one dropped
    assert sim.tiers[0].has(key) and not sim.tiers[1].has(key)
    assert sim.res.decisions["raise_cpu"] == 1 and sim.res.decisions["abandon_copy"] == 1
    sim, key, nbytes = sim_with_copy_landing_at(0.001)
    done = sim.evict_from_gpu([(key, nbytes)], 10.0, blocking=True, waiting_until=10.0)
    assert done == pytest.approx(10.001)  # worth the millisecond: both copies kept
    assert sim.tiers[0].has(key) and sim.tiers[1].has(key)


def test_chunks_written_back_or_demoted_stay_their_sessions_in_the_tiers():
    """The GPU lets a's chunks go to the CPU tier on b's admission (a write-back), b's push
    them down to the disk on c's (a demotion): each copy is still ranked as its
    session's (one that lost its session would rank as a prefix sessions share, kept
    last, crowding out what the pool needs stored)."""
    def four(name):
        return tuple((name, i) for i in range(4))

    wl = Workload("down", [Turn(n, at, four(n), CHUNK, 1024, 0)
                           for n, at in (("a", 0.0), ("b", 10.0), ("c", 20.0))], CHUNK)
    sim = Simulator(wl, SYSTEMS["cachedattention-like"], _cost(), 4 * CHUNK * 1000,
                    {"cpu": 4 * CHUNK * 1000, "disk": 1e9})
    assert sim.run().decisions == {"offload_cpu": 8}
    cpu, disk = sim.tiers
    assert sorted(cpu.index.keys()) == list(four("b")) and sorted(disk.index.keys()) == list(four("a"))
    for tier in (cpu, disk):
        for key in sorted(tier.index.keys()):
            info = tier.index.info(key)
            assert info is not None and (info.session, info.index) == key
