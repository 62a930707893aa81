"""The engine decides with the same policies as the simulator: restore or recompute from a
calibration profile, watermark offloads ranked by predicted think time, hints and prefetch.
Every reply is checked against an engine that never offloads."""

from __future__ import annotations

import pytest
import torch

from kvtier.chunk_keys import chunk_keys
from kvtier.config import TiersConfig
from kvtier.engine.engine import Engine
from kvtier.engine.sampling import SamplingParams
from kvtier.machine import this_machine
from kvtier.make_model.writer import make_model
from kvtier.policies.cost_model import CostModel, LinearCost, PrefillCost, TierCost
from kvtier.policies.live import PROFILE_NAME
from kvtier.policies.offload import Watermarks
from kvtier.policies.profile import save_profile
from tests.engine_config import engine_config

GREEDY = SamplingParams(max_tokens=8)
SYSTEM = "You are a helpful assistant who answers about offloading KV caches. " * 3
FIRST = "Tell me about the mountains and the weather there, in some detail please."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_model("tiny", tmp_path_factory.mktemp("m") / "tiny", seed=7).path


def _profile(path, engine_fp: str, read_bps: float, kv_bytes_per_token: int = 4096) -> str:
    """A profile whose tiers read at ``read_bps`` and whose prefill costs 1 ms per token."""
    tier = TierCost("x", LinearCost(1e-4, read_bps), LinearCost(1e-4, read_bps))
    cost = CostModel(
        model=engine_fp, machine=this_machine(), kv_bytes_per_token=kv_bytes_per_token, num_layers=2,
        prefill=PrefillCost(1e-3, 1e-3, 0.0),
        tiers={n: TierCost(n, tier.read, tier.write) for n in ("cpu", "disk")},
    )
    return str(save_profile(path, cost, {}))


def _engine(model_dir, tmp_path, clock=None, **policy) -> Engine:
    tiers = TiersConfig(cpu_bytes=64 << 20, disk_bytes=256 << 20,
                        disk_dir=str(tmp_path / "chunks"), disk_fsync=False)
    opts = engine_config(num_blocks=policy.pop("num_blocks", 128), tiers=tiers, chunk_tokens=64,
                         policy=dict(**policy))
    return Engine(model_dir, opts, **({"clock": clock} if clock else {}))


def _expected(model_dir, tmp_path, turns):
    plain = Engine(model_dir, engine_config(num_blocks=256, tiers=None))
    out = {}
    for sid, msg in turns:
        out.setdefault(sid, []).append(plain.chat(sid, msg, GREEDY, system=SYSTEM).token_ids)
    return out


@pytest.mark.parametrize("read_bps,loads", [(1e12, True), (1.0, False)])
def test_restore_plan_loads_only_what_beats_recompute(model_dir, tmp_path, read_bps, loads):
    expected = _expected(model_dir, tmp_path, [("s", FIRST), ("s", "And in winter?")])
    probe = Engine(model_dir, engine_config(num_blocks=16, tiers=None))
    fp = probe.runner.fingerprint.hex()
    path = _profile(tmp_path / "p.json", fp, read_bps)
    eng = _engine(model_dir, tmp_path, profile=path, auto_offload=False)
    try:
        eng.chat("s", FIRST, GREEDY, system=SYSTEM)
        off = eng.offload("s", "disk")
        turn2 = eng.chat("s", "And in winter?", GREEDY)
    finally:
        eng.close()
    assert turn2.token_ids == expected["s"][1]
    decisions = eng.policy.decisions
    if loads:  # a fast tier: the whole stored prefix comes back
        assert turn2.stats.restored_tokens == off.stored_tokens
        assert decisions["restore_load"] == 1 and decisions["restore_recompute"] == 0
    else:  # a tier slower than recompute is never read
        assert turn2.stats.restored_tokens == 0
        assert decisions["restore_recompute"] == 1 and decisions["restore_load"] == 0


def test_engine_finds_the_model_directory_profile(model_dir, tmp_path):
    probe = Engine(model_dir, engine_config(num_blocks=16, tiers=None))
    own = tmp_path / "model"
    own.mkdir()
    for f in model_dir.iterdir():
        (own / f.name).symlink_to(f)
    _profile(own / PROFILE_NAME, probe.runner.fingerprint.hex(), 1e9)
    eng = _engine(own, tmp_path)
    try:
        assert eng.policy.cost is not None and eng.policy.cost.tiers["cpu"].read.bandwidth_bps == 1e9
    finally:
        eng.close()
    bare = _engine(model_dir, tmp_path / "bare")
    try:
        assert bare.policy.cost is None  # no profile: load every stored prefix
    finally:
        bare.close()


def _assert_old_restored_and_replies_match(late_reply, second, expected):
    """The late session's reply and every second turn equal an engine that never offloads;
    "old" came back from a tier."""
    assert late_reply.token_ids == expected["late"][0]
    assert second["old"].stats.restored_tokens > 0
    assert {s: r.token_ids for s, r in second.items()} == {s: v[1] for s, v in expected.items()
                                                           if s != "late"}


def test_watermark_prestages_the_session_away_longest_first(model_dir, tmp_path):
    """A pool past its high watermark pre-stages idle sessions: the one idle for two hours
    is stored and keeps its blocks, the ones that finished recently are not stored. When a
    turn then needs the room, the staged session leaves without being written again; every
    session comes back with the same replies."""
    now = [0.0]
    names = (("old", 0.0), ("mid", 3600.0), ("new", 7190.0))
    turns = [(s, f"{s} asks: {FIRST}") for s, _ in names]
    late = ("late", " ".join([FIRST] * 2))
    expected = _expected(model_dir, tmp_path, turns + [late] + [(s, "More?") for s, _ in names])
    # Checks at t=0 and t=7200 only: 24 blocks, 16 used (a shared system prompt, 3 blocks
    # of each session's own) is past 60 %.
    eng = _engine(model_dir, tmp_path, clock=lambda: now[0], num_blocks=24,
                  watermarks=Watermarks(high=0.6, low=0.5), check_every_s=7200.0)
    try:
        for (sid, msg), (_, t) in zip(turns, names, strict=True):
            now[0] = t
            eng.chat(sid, msg, GREEDY, system=SYSTEM)
        now[0] = 7200.0
        bp = eng.runner.pool.block_pool
        used = bp.num_blocks - bp.num_empty
        eng.step()  # the watermark check runs on the engine's step
        eng.offloader.settle(block=True)
        assert {s: x.stored_tokens > 0 for s, x in eng.sessions.items()} == {
            "old": True, "mid": False, "new": False}
        assert not eng.sessions["old"].offloaded
        assert bp.num_blocks - bp.num_empty == used  # staged, not freed
        assert eng.policy.decisions == {"prestage_cpu": 1}
        cpu = eng.tiers.tiers[0]
        written = cpu.stats.bytes_written
        assert written > 0
        # A long turn does not fit in the empty blocks: idle sessions make room down to the
        # low watermark, the staged one first. It leaves without a write; "mid" is written
        # then (its chunks but the shared system prompt's: fewer bytes than "old" took).
        late_reply = eng.chat(*late, GREEDY, system=SYSTEM)
        assert eng.sessions["old"].offloaded and not eng.sessions["new"].offloaded
        assert 0 < cpu.stats.bytes_written - written < written
        assert eng.policy.decisions["offload_cpu"] >= 1
        second = {s: eng.chat(s, "More?", GREEDY) for s, _ in names}
    finally:
        eng.close()
    _assert_old_restored_and_replies_match(late_reply, second, expected)


LATE = ("late", "Hi")
"""A turn that does not fit in the empty blocks after the first turns of
:func:`_after_first_turns`: one idle session alone makes its room."""


def _after_first_turns(model_dir, tmp_path, names, cpu_slots: int, now: list[float]):
    """An engine after each session in ``names`` ran one turn at its time, the filler then
    offloaded to a CPU tier of ``cpu_slots`` chunk slots (high = low watermark 0.65, checked
    at t=0 and t=7200 only); and the replies of an engine that never offloads."""
    turns = [(s, f"{s} asks: {FIRST}") for s, _ in names]
    expected = _expected(model_dir, tmp_path, turns + [LATE] + [(s, "More?") for s, _ in names])
    slot, fingerprint = _chunk_slot(model_dir, tmp_path)
    prof = _profile(tmp_path / "p.json", fingerprint, 1e12, kv_bytes_per_token=600)
    opts = engine_config(num_blocks=24, tiers=_cpu_only(tmp_path, cpu_slots * slot), chunk_tokens=64,
                         policy=dict(profile=prof, watermarks=Watermarks(high=0.65, low=0.65),
                                              check_every_s=7200.0))
    eng = Engine(model_dir, opts, clock=lambda: now[0])
    try:
        for (sid, msg), (_, t) in zip(turns, names, strict=True):
            now[0] = t
            eng.chat(sid, msg, GREEDY, system=SYSTEM)
            if sid == "filler":
                eng.offload("filler", "cpu")
    except BaseException:
        eng.close()
        raise
    return eng, expected


def _cpu_only(tmp_path, cpu_bytes: int) -> TiersConfig:
    return TiersConfig(cpu_bytes=cpu_bytes, disk_bytes=0, disk_dir=str(tmp_path / "chunks"), disk_fsync=False)


def _chunk_slot(model_dir, tmp_path) -> tuple[int, str]:
    """Bytes of one 64-token chunk slot in the CPU tier, and the model's fingerprint."""
    probe = Engine(model_dir, engine_config(num_blocks=16, tiers=_cpu_only(tmp_path, 1 << 20), chunk_tokens=64))
    try:
        return probe.tiers.tiers[0].slot_bytes, probe.runner.fingerprint.hex()
    finally:
        probe.close()


def test_a_full_tier_still_takes_the_next_victim_ahead_of_need(model_dir, tmp_path):
    """The CPU tier is nearly full (another session was offloaded there), so pre-staging
    into empty space finds no room for the idle session away longest; staging ahead stores
    it anyway, displacing the tier's own victim as a write on the admission path would
    have. The turn that then needs the room frees it without writing it; replies match."""
    now = [0.0]
    names = (("filler", 0.0), ("old", 10.0), ("mid", 3600.0), ("new", 7190.0))
    # Four chunk slots: the filler takes three, "old" needs two (its first is the shared
    # system prompt's, stored already). By the cost model's count (600 bytes a token, 160
    # tokens) it needs 96 KB: more than the empty space, less than the tier.
    eng, expected = _after_first_turns(model_dir, tmp_path, names, 4, now)
    try:
        cpu = eng.tiers.tiers[0]
        assert cpu.capacity_bytes - cpu.used_bytes < 160 * 600 <= cpu.capacity_bytes
        now[0] = 7200.0
        bp = eng.runner.pool.block_pool
        used = bp.num_blocks - bp.num_empty
        written = cpu.stats.bytes_written
        eng.step()
        eng.offloader.settle(block=True)
        assert eng.policy.decisions["stage_ahead_cpu"] == 1
        assert "prestage_cpu" not in eng.policy.decisions  # no empty room for it
        assert {s: x.stored_tokens > 0 for s, x in eng.sessions.items() if s != "filler"} == {
            "old": True, "mid": False, "new": False}
        assert bp.num_blocks - bp.num_empty == used  # stored, not freed
        assert cpu.stats.bytes_written > written and cpu.stats.evictions > 0  # the filler's tail went
        staged = cpu.stats.bytes_written
        late_reply = eng.chat(*LATE, GREEDY, system=SYSTEM)
        assert eng.sessions["old"].offloaded and not eng.sessions["mid"].offloaded
        assert cpu.stats.bytes_written == staged  # it left without a write
        second = {s: eng.chat(s, "More?", GREEDY) for s, _ in names}
    finally:
        eng.close()
    _assert_old_restored_and_replies_match(late_reply, second, expected)


def test_a_tier_keeps_the_copy_of_a_session_the_pool_lets_go_next(model_dir, tmp_path):
    """"old" is stored ahead of need and still holds its blocks. Another write then fills
    the CPU tier, and by its think-time ranking "old" (idle longest) would be the victim;
    but the pool lets "old" go next and that copy is what lets it go without a write, so
    the tier gives up the filler's chunks instead. The turn that needs the room frees
    "old" with nothing written; replies match."""
    now = [0.0]
    names = (("old", 0.0), ("filler", 10.0), ("mid", 3600.0), ("new", 7190.0))
    # Five chunk slots: the filler's three (the first one the shared system prompt's) and
    # "old"'s own two fill it.
    eng, expected = _after_first_turns(model_dir, tmp_path, names, 5, now)
    try:
        now[0] = 7200.0
        eng.step()
        eng.offloader.settle(block=True)
        assert eng.policy.leaving == {"old"}
        old = eng.sessions["old"]
        assert not old.offloaded and old.stored_tokens > 0

        def old_copy() -> int:  # leading chunks of "old" the tiers hold
            keys = chunk_keys(old.token_ids[: old.stored_tokens], 64, eng.runner.fingerprint)
            return eng.kv.manager.lookup([k.key for k in keys]).length

        held = old_copy()
        assert held > 0
        cpu = eng.tiers.tiers[0]
        # The tier ranks on the engine's clock whatever its own index's clock reads (here
        # the host's uptime: hours past the engine's fake one would once rank "new" as the
        # session idle longest, and the pool would let it go instead of "old").
        for late in (0.0, 1e6):
            assert cpu.eviction.predictor("new", late) == eng.policy.eviction_rank("new")
        evicted = cpu.stats.evictions
        assert eng.policy.eviction_rank("old") == -1.0 < eng.policy.eviction_rank("filler")
        eng.stage("new", "cpu")  # a write into the full tier; "new" keeps its blocks
        eng.offloader.settle(block=True)
        assert cpu.stats.evictions > evicted  # something went...
        assert old_copy() == held  # ...but not the copy the pool is counting on
        written = cpu.stats.bytes_written
        late_reply = eng.chat(*LATE, GREEDY, system=SYSTEM)
        assert old.offloaded and cpu.stats.bytes_written == written  # it left without a write
        assert "old" not in eng.policy.leaving  # out of the pool: ranked like any copy again
        second = {s: eng.chat(s, "More?", GREEDY) for s, _ in names}
    finally:
        eng.close()
    _assert_old_restored_and_replies_match(late_reply, second, expected)


def test_think_times_are_learned_from_the_engine_clock(model_dir, tmp_path):
    now = [0.0]
    eng = _engine(model_dir, tmp_path, clock=lambda: now[0], auto_offload=False)
    try:
        for gap in (5.0, 5.0, 5.0):
            eng.chat("quick", "hi", GREEDY)
            now[0] += gap
        eng.chat("quick", "hi", GREEDY)
        eng.chat("other", "hi", GREEDY)
        assert eng.policy.think.population.n == 3
        quick = eng.policy.predicted_next_s("quick")
        assert 0 < quick < eng.policy.think.expected_next_s("stranger", 0.0)
        eng.end_session("quick")
        assert "quick" not in eng.policy.idle_since
    finally:
        eng.close()


def test_hint_restores_into_a_roomy_pool_and_prefetch_raises_chunks(model_dir, tmp_path):
    expected = _expected(model_dir, tmp_path, [("s", FIRST), ("s", "And in winter?")])
    eng = _engine(model_dir, tmp_path, auto_offload=False, num_blocks=256)
    try:
        eng.chat("s", FIRST, GREEDY, system=SYSTEM)
        eng.offload("s", "disk")
        s = eng.sessions["s"]
        keys = eng.kv.keys_below_fastest(s.token_ids[: s.stored_tokens])
        assert keys  # on disk only
        assert eng.prefetch("s").result() == len(keys)
        assert eng.kv.keys_below_fastest(s.token_ids[: s.stored_tokens]) == []  # now in RAM
        assert eng.hint("s") == "restoring"
        assert eng.hint("s") == "resident"
        turn2 = eng.chat("s", "And in winter?", GREEDY)
        assert eng.prefetch("s") is None  # resident: nothing to fetch
    finally:
        eng.close()
    assert turn2.token_ids == expected["s"][1]


def test_hint_on_a_full_pool_only_prefetches(model_dir, tmp_path):
    eng = _engine(model_dir, tmp_path, auto_offload=False, num_blocks=40,
                  watermarks=Watermarks(high=0.9, low=0.1))
    try:
        eng.chat("s", FIRST, GREEDY, system=SYSTEM)
        eng.offload("s", "disk")
        assert eng.hint("s") == "prefetching"
        assert eng.sessions["s"].offloaded
    finally:
        eng.close()


@pytest.mark.parametrize("disk_bps,demoted", [(1e12, True), (1.0, False)])
def test_a_full_cpu_tier_demotes_only_where_reloading_beats_recompute(model_dir, tmp_path, disk_bps, demoted):
    """The engine's tier manager asks the live policy where a victim goes (the simulator's
    cascade asks the same): down to a disk that reloads faster than recompute, nowhere
    from one slower than recompute."""
    slot, fp = _chunk_slot(model_dir, tmp_path)
    fast = LinearCost(1e-4, 1e12)
    slow = LinearCost(1e-4, disk_bps)
    cost = CostModel(model=fp, machine=this_machine(), kv_bytes_per_token=4096, num_layers=2,
                     prefill=PrefillCost(1e-3, 1e-3, 0.0),
                     tiers={"cpu": TierCost("cpu", fast, fast), "disk": TierCost("disk", slow, slow)})
    prof = str(save_profile(tmp_path / "p.json", cost, {}))
    tiers = TiersConfig(cpu_bytes=3 * slot, disk_bytes=64 << 20, disk_dir=str(tmp_path / "chunks"),
                        disk_fsync=False)
    eng = Engine(model_dir, engine_config(num_blocks=64, tiers=tiers, chunk_tokens=64,
                                          policy=dict(profile=prof, auto_offload=False)))
    try:
        for sid in ("a", "b"):  # b's chunks push a's out of the three-slot CPU tier
            eng.chat(sid, f"{sid}: {FIRST}", GREEDY, system=SYSTEM)
            assert eng.offload(sid, "cpu").stored_tokens > 2 * 64  # three chunks, the tail too
        stats, disk = eng.tiers.stats, eng.tiers.tiers[1]
        if demoted:
            assert stats.demotions > 0 and stats.demotions_skipped == 0
            assert len(disk) == stats.demotions
        else:
            assert stats.demotions == 0 and stats.demotions_skipped > 0
            assert len(disk) == 0
    finally:
        eng.close()


def test_the_engine_feeds_its_load_meter_and_watches_its_victims(model_dir, tmp_path):
    """Model steps count as GPU busy time and a synchronous offload as its tier's link
    time; a session that leaves the pool hands its blocks to the victim watch, and a later
    prompt asking for the same blocks (another session, same text) counts a reuse."""
    probe = Engine(model_dir, engine_config(num_blocks=16, tiers=None))
    path = _profile(tmp_path / "p.json", probe.runner.fingerprint.hex(), 1e9)
    eng = _engine(model_dir, tmp_path, profile=path, auto_offload=False)
    try:
        eng.chat("a", FIRST, GREEDY, system=SYSTEM)
        now = eng.policy.clock()
        assert eng.policy.load.compute.share(now) > 0
        eng.offload("a", "cpu")
        assert eng.policy.load.links["cpu"].share(eng.policy.clock()) > 0
        victims = eng.policy.victims
        assert victims.let_go_total > 0 and victims.reused_total == 0
        eng.chat("b", FIRST, GREEDY, system=SYSTEM)  # the same rendered prompt: a's blocks
        assert victims.reused_total > 0
    finally:
        eng.close()
