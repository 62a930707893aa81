"""Cost model fits and the restore-or-recompute decision on hand-computable cases."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvtier.errors import InvalidArgumentError
from kvtier.policies.cost_model import CostModel, LinearCost, PrefillCost, TierCost
from kvtier.policies.restore import StoredChunk, plan_restore, predicted_ttft

KIB = 1024


def _model(**tiers: tuple[float, float]) -> CostModel:
    """1 ms per new token, no attention term; tiers as (latency s, bandwidth B/s)."""
    return CostModel(
        model="m",
        machine="test",
        kv_bytes_per_token=100 * KIB,
        num_layers=10,
        prefill=PrefillCost(overhead_s=0.0, per_token_s=1e-3, per_token_ctx_s=0.0),
        tiers={
            name: TierCost(name, LinearCost(lat, bw), LinearCost(lat, bw))
            for name, (lat, bw) in tiers.items()
        },
    )


def test_linear_fit_recovers_latency_and_bandwidth():
    true = LinearCost(0.002, 2e9)
    fit = LinearCost.fit([(n, true.time(n)) for n in (1e6, 8e6, 64e6)])
    assert fit.latency_s == pytest.approx(0.002, rel=1e-6)
    assert fit.bandwidth_bps == pytest.approx(2e9, rel=1e-6)
    with pytest.raises(InvalidArgumentError, match=">= 2 sizes"):
        LinearCost.fit([(1e6, 0.1), (1e6, 0.2)])


def test_prefill_fit_recovers_the_attention_term():
    true = PrefillCost(0.01, 2e-4, 3e-8)
    samples = [(c, n, true.time(c, n)) for c in (0, 512, 4096) for n in (16, 256, 1024)]
    fit = PrefillCost.fit(samples)
    assert fit.per_token_s == pytest.approx(2e-4, rel=1e-6)
    assert fit.per_token_ctx_s == pytest.approx(3e-8, rel=1e-6)
    assert fit.time(8192, 100) > fit.time(0, 100)  # attention grows with the context


def test_a_tier_slower_than_recompute_is_never_chosen():
    # Loading 256 tokens from "slow": 25.6 MB at 10 MB/s = 2.6 s; recomputing them: 0.26 s.
    cost = _model(slow=(0.0, 10e6))
    chunks = [StoredChunk(256, "slow")] * 4
    plan = plan_restore(cost, chunks, prompt_tokens=1024 + 32)
    assert plan.recompute_all and plan.recompute_tokens == 1056


def test_a_fast_tier_is_loaded_whole():
    # 256 tokens from "cpu": 25.6 MB at 10 GB/s = 2.6 ms vs 256 ms to recompute.
    cost = _model(cpu=(1e-4, 10e9))
    plan = plan_restore(cost, [StoredChunk(256, "cpu")] * 4, prompt_tokens=1056)
    assert (plan.load_chunks, plan.load_tokens, plan.recompute_tokens) == (4, 1024, 32)
    assert plan.predicted_ttft_s < plan.recompute_all_ttft_s / 5


def test_mixed_tiers_load_only_the_part_that_pays():
    cost = _model(cpu=(1e-4, 10e9), redis=(0.05, 20e6))
    chunks = [StoredChunk(256, "cpu")] * 2 + [StoredChunk(256, "redis")] * 2
    plan = plan_restore(cost, chunks, prompt_tokens=1056)
    assert plan.load_chunks == 2  # the Redis chunks would cost 1.3 s each, recompute 0.26 s


def test_layer_overlap_hides_most_of_the_smaller_side():
    cost = _model(disk=(0.0, 200e6))
    chunks = [StoredChunk(256, "disk")] * 2
    serial = predicted_ttft(cost, chunks, 2, 600, overlap=False)
    overlapped = predicted_ttft(cost, chunks, 2, 600, overlap=True)
    load = 2 * 256 * 100 * KIB / 200e6
    compute = cost.prefill.time(512, 88)
    assert serial == pytest.approx(load + compute)
    assert overlapped == pytest.approx(max(load, compute) + min(load, compute) / 10)


def test_tokens_already_in_the_pool_are_free():
    # 256 tokens still in the pool, one stored chunk of 256 after them: loaded, 88 computed.
    cost = _model(cpu=(1e-4, 10e9))
    plan = plan_restore(cost, [StoredChunk(256, "cpu")], prompt_tokens=600, cached_tokens=256)
    assert (plan.load_chunks, plan.recompute_tokens) == (1, 88)
    assert plan.recompute_all_ttft_s == pytest.approx(cost.prefill.time(256, 344))
    load, compute = cost.load_time("cpu", 256), cost.prefill.time(512, 88)
    assert plan.predicted_ttft_s == pytest.approx(compute + load / 10)  # overlapped


def test_small_restores_that_do_not_stream_pay_load_plus_compute():
    cost = replace(_model(disk=(0.0, 200e6)), stream_min_tokens=1024)
    chunks = [StoredChunk(256, "disk")] * 2
    load = 2 * 256 * 100 * KIB / 200e6
    assert predicted_ttft(cost, chunks, 2, 600) == pytest.approx(load + cost.prefill.time(512, 88))
    streamed = replace(cost, stream_min_tokens=512)
    assert predicted_ttft(streamed, chunks, 2, 600) < load + cost.prefill.time(512, 88)


def test_online_refinement_moves_toward_observed_bandwidth():
    t = TierCost("disk", LinearCost(0.001, 1e9), LinearCost(0.001, 1e9))
    slower = t.observe_read(1e9, 0.001 + 2.0, weight=0.5)  # observed 0.5 GB/s
    assert slower.read.bandwidth_bps == pytest.approx(0.75e9)
    assert t.observe_read(0, 1.0) is t


def test_profile_round_trip_and_bad_profiles():
    cost = _model(cpu=(1e-4, 10e9), disk=(1e-3, 2e9))
    again = CostModel.from_dict(cost.to_dict())
    assert again == cost
    duplex = replace(cost, tiers={**cost.tiers, "cpu": replace(cost.tiers["cpu"], duplex=True)})
    assert CostModel.from_dict(duplex.to_dict()).tiers["cpu"].duplex
    assert not again.tiers["cpu"].duplex  # a profile that does not say shares one path
    with pytest.raises(InvalidArgumentError, match="not a kvtier cost profile"):
        CostModel.from_dict({"model": "m"})
    with pytest.raises(InvalidArgumentError, match="no tier 'redis'"):
        cost.load_time("redis", 10)


def test_loads_begun_while_the_turn_waits_count_as_done():
    # Loading a 256-token chunk from "slow" takes 1.28 s, recomputing the whole prompt
    # 1.025 s: an idle server recomputes. A turn that waits 6 s in the queue while its loads
    # run (they start at arrival) finds all 5.12 s of them done: loading is then better.
    cost = _model(slow=(0.0, 100 * KIB / 5e-3))
    chunks = [StoredChunk(256, "slow")] * 4
    assert plan_restore(cost, chunks, 1025).load_chunks == 0
    waited = plan_restore(cost, chunks, 1025, head_start_s=6.0)
    assert waited.load_chunks == 4 and waited.predicted_ttft_s < 0.01
    assert predicted_ttft(cost, chunks, 4, 1025, head_start_s=1.0) == pytest.approx(
        predicted_ttft(cost, chunks, 4, 1025) - 1.0, rel=1e-3)
