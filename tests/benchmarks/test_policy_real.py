"""``--real``: the reference engine replays a small workload with real tiers and live
policies, and the simulator, driven by this machine's calibration of the same model,
replays what ran. How close its prediction comes is a timing result, so it is recorded by
``kvtier bench policies --real`` (``sim_error``, docs/policies.md), not asserted here:
these tests check the machinery and hold on a loaded 2-core machine."""

from __future__ import annotations

import pytest

from kvtier.benchmarks.policy_sim.real import replay_real
from kvtier.benchmarks.policy_sim.simulator import Simulator
from kvtier.benchmarks.policy_sim.systems import system
from kvtier.benchmarks.policy_sim.workloads import SyntheticSpec, synthetic
from kvtier.cli.main import main
from kvtier.errors import InvalidArgumentError
from kvtier.make_model.writer import make_model
from kvtier.policies.profile import load_profile


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """smollm-135m shapes (random weights): prefill costs dominate Python overheads."""
    model = make_model("smollm-135m", tmp_path_factory.mktemp("m") / "smol", seed=7).path
    assert main(["calibrate", "--model", str(model), "--max-tokens", "1024",
                 "--chunk-tokens", "64", "--repeats", "2", "--threads", "2"]) == 0
    return model, model / "kvtier-profile.json"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["vllm-like", "kvtier"])
def test_the_real_replay_and_its_simulation_cover_every_turn(calibrated, tmp_path, name):
    model, profile = calibrated
    cost, _ = load_profile(profile)
    assert not any(t.duplex for t in cost.tiers.values())  # a host pool: RAM is one path
    wl = synthetic(SyntheticSpec(
        sessions=6, system_tokens=256, first_turn_extra_tokens=256, turns_mean=4,
        think_median_s=30, chunk_tokens=64, output_tokens_median=8, user_tokens_median=60,
        session_rate_per_s=0.2), seed=0, name="small")
    working = wl.peak_live_tokens()
    gpu_tokens = working // 2  # offloads and restores happen
    tiers = {"cpu": 0.5 * working * cost.kv_bytes_per_token,
             "disk": 4 * working * cost.kv_bytes_per_token}
    real, as_run = replay_real(wl, system(name), model, gpu_tokens, tiers, profile,
                               work_dir=tmp_path)
    assert len(real.ttft_s) == len(wl.turns) == len(as_run.turns)
    assert real.saved_tokens > 0  # reuse happened for real
    if name == "kvtier":
        assert real.decisions.get("offload_cpu", 0) > 0  # the live policy offloaded
    sim = Simulator(as_run, system(name), cost, gpu_tokens * cost.kv_bytes_per_token, tiers).run()
    assert len(sim.ttft_s) == len(real.ttft_s)
    assert all(t > 0 for t in real.ttft_s) and all(t > 0 for t in sim.ttft_s)
    assert sim.saved_tokens > 0  # the simulator, replaying what ran, reuses KV too


def test_real_mode_refuses_simulator_only_systems(calibrated, capsys):
    model, profile = calibrated
    wl = synthetic(SyntheticSpec(sessions=1, turns_mean=1), seed=0)
    with pytest.raises(InvalidArgumentError, match="exists only in the simulator"):
        replay_real(wl, system("lmcache-like"), model, 1024, {}, profile)
    assert main(["bench", "policies", "--real", "--workloads", "multiturn"]) != 0
    assert "--real needs --model" in capsys.readouterr().err


def test_calibration_fits_the_quickest_sample_of_each_size():
    """Interference only adds time: a round slowed by another process must not bend the
    fit (pooled least squares over these samples has a negative slope)."""
    from kvtier.cli.calibrate import fastest_per_size
    from kvtier.policies.cost_model import LinearCost

    quiet = [(1e6, 0.0011), (4e6, 0.0041), (8e6, 0.0081)]
    busy = [(1e6, 0.050), (4e6, 0.0045), (8e6, 0.0090)]
    with pytest.raises(InvalidArgumentError, match="do not grow"):
        LinearCost.fit(busy + [(1e6, 0.060)])
    fitted = LinearCost.fit(fastest_per_size(quiet + busy))
    assert fitted.bandwidth_bps == pytest.approx(1e9, rel=1e-6)
    assert fitted.latency_s == pytest.approx(1e-4, rel=1e-3)
