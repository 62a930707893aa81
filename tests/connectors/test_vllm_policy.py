"""Restore or recompute in the vLLM connector: a tier measured slower than vLLM recomputes
the same tokens is not loaded from (the tokens are counted as recomputed by decision), a
fast one is, a tier never measured is loaded from so that it gets measured, and nothing is
held back before vLLM's own speed is known. The slow tier is a real disk tier whose reads
are throttled (a network disk), measured by the worker's own loads."""

from __future__ import annotations

import time

import pytest

from kvtier.connectors.chunk_store import LocalChunkStore
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.connectors.vllm_blocks import ChunkGrid
from kvtier.connectors.vllm_policy import MIN_PREFILL_TOKENS, LoadPolicy, LoadTiming, StepMeter
from kvtier.connectors.vllm_scheduler import SchedulerSide
from kvtier.connectors.vllm_worker import WorkerSide
from kvtier.errors import ConfigError
from kvtier.policies.cost_model import LinearCost, TierCost
from kvtier.policies.restore import StoredChunk
from tests.connectors.vllm_fakes import (
    BLOCK,
    DIM,
    HEADS,
    LAYERS,
    NewRequest,
    Request,
    SchedulerOutput,
    caches,
)

FP = b"vllm-v3|policy-test"
GRID = ChunkGrid(BLOCK, 2, FP)
KV_PER_TOKEN = LAYERS * 2 * HEADS * DIM * 2  # fp16 caches of the fakes


class ThrottledDisk(DiskTier):
    """A disk tier whose reads take at least ``bytes / rate`` (a slow network disk)."""

    name = "slowdisk"

    def __init__(self, directory, rate_Bps: float) -> None:
        super().__init__(directory)
        self.rate_Bps = rate_Bps

    def lease(self, keys, layers=None, background=False):
        time.sleep(len(keys) * 100_000 / self.rate_Bps)  # a chunk of these caches is < 100 KB
        return super().lease(keys, layers, background)


def _prefill_speed(policy: LoadPolicy, per_token_s: float) -> None:
    """vLLM's steps as the scheduler side sees them: plans ``per_token_s`` apart per token."""
    t, n = 1000.0, 512
    for _ in range(5):
        policy.steps.plan_built(t, n)
        t += n * per_token_s


def _setup(tier, per_token_s: float):
    store = LocalChunkStore(TierManager([tier]))
    policy = LoadPolicy(KV_PER_TOKEN, LAYERS)
    _prefill_speed(policy, per_token_s)
    sched = SchedulerSide(lambda: store, GRID, policy=policy)
    worker = WorkerSide(lambda: store, GRID)
    worker.register(caches(32, True), 32)
    prompt = list(range(10, 10 + 8 * BLOCK + 1))
    sched.matched_tokens(Request("w", prompt), 0)
    sched.allocated(Request("w", prompt), list(range(9)), 0)
    worker.save(sched.step_plan(SchedulerOutput(
        [NewRequest("w", (list(range(9)),), 0)], num_scheduled_tokens={"w": len(prompt)})).saves)
    return sched, worker, prompt


def _resume(sched: SchedulerSide, worker: WorkerSide, prompt: list[int], req_id: str) -> int:
    """A request on the stored prefix: what it is offered; a planned load is made and the
    worker's measurement handed back, as the connector does after every step."""
    req = Request(req_id, prompt + [req_id.__hash__() % 1000])
    offered = sched.matched_tokens(req, 0)
    blocks = list(range(10, 10 + len(req.prompt_token_ids) // BLOCK + 1))
    sched.allocated(req, blocks, offered)
    plan = sched.step_plan(SchedulerOutput([NewRequest(req_id, (blocks,), offered)],
                                           num_scheduled_tokens={req_id: 1}))
    worker.load(plan.loads)
    assert worker.take_load_errors() == set()
    sched.observe(worker.take_observations())
    return offered


def test_a_tier_slower_than_recompute_is_measured_once_then_not_loaded(tmp_path):
    sched, worker, prompt = _setup(ThrottledDisk(tmp_path / "d", rate_Bps=2e6), per_token_s=2e-6)
    assert _resume(sched, worker, prompt, "first") == 8 * BLOCK  # never measured: loaded
    assert sched.policy.tiers["slowdisk"].read.bandwidth_bps < 5e6  # and now measured
    assert _resume(sched, worker, prompt, "second") == 0  # recomputing is faster
    assert sched.recomputed_by_decision == 8 * BLOCK


def test_a_tier_faster_than_recompute_is_loaded(tmp_path):
    slot = 1 << 20
    sched, worker, prompt = _setup(CPUTier(16 * slot, slot), per_token_s=1e-3)  # a CPU's prefill
    for i in range(3):
        assert _resume(sched, worker, prompt, f"r{i}") == 8 * BLOCK
    assert sched.recomputed_by_decision == 0 and "cpu" in sched.policy.tiers


def test_before_vllms_speed_is_known_every_stored_prefix_is_loaded():
    policy = LoadPolicy(KV_PER_TOKEN, LAYERS, {"disk": TierCost("disk", LinearCost(0, 1.0), LinearCost(0, 1.0))})
    chunks = [StoredChunk(32, "disk")] * 3
    assert policy.chunks_to_load(chunks, 200, 0) == 3  # no prefill measured yet
    _prefill_speed(policy, 1e-6)
    assert policy.chunks_to_load(chunks, 200, 0) == 0  # 1 B/s: never worth it
    assert policy.chunks_to_load([StoredChunk(32, "new")] * 3, 200, 0) == 3  # not measured yet
    policy.enabled = False
    assert policy.chunks_to_load(chunks, 200, 0) == 3


def test_the_step_meter_ignores_decode_steps_and_idle_gaps():
    meter = StepMeter()
    assert meter.per_token_s() is None
    t = 0.0
    for i in range(12):
        meter.plan_built(t, 1000 if i % 2 == 0 else MIN_PREFILL_TOKENS - 1)  # decode: not counted
        t += 1.0 if i % 2 == 0 else 0.01  # 1 ms per prefill token
    meter.plan_built(t, 1000)
    meter.plan_built(t + 60, 1000)  # then the engine idled for a minute
    assert meter.per_token_s() == pytest.approx(1e-3)


def _steps(policy: LoadPolicy, seconds: float, requests: int) -> None:
    """vLLM's steps as the scheduler side sees them: plans ``seconds`` apart, each step
    running ``requests`` requests (decodes: too few tokens to measure the prefill)."""
    t = 2000.0
    for _ in range(5):
        policy.steps.plan_built(t, requests, requests)
        t += seconds


def test_auto_timing_loads_before_the_forward_only_where_the_steps_requests_wait_less():
    cpu = TierCost("cpu", LinearCost(0, 1e9), LinearCost(0, 1e9))
    policy = LoadPolicy(KV_PER_TOKEN, LAYERS, {"cpu": cpu})
    assert policy.parks({"cpu": 1_000_000})  # vLLM's step time not measured yet
    _steps(policy, 0.040, requests=3)  # three requests decoding, 40 ms a step
    assert policy.parks({"disk": 1000})  # a tier never measured
    # 1 MB at 1 GB/s: the step's 3 requests and this one wait 4 x 1 ms, not a 40 ms step
    assert not policy.parks({"cpu": 1_000_000})
    # another request's 10 MB in the same step: 4 x 11 ms > 40 ms, so it is parked
    assert policy.parks({"cpu": 10_000_000})
    policy.step_planned()  # the next step starts from nothing
    assert not policy.parks({"cpu": 9_500_000})
    policy.step_planned()
    _steps(policy, 0.040, requests=39)  # a full batch: 40 x 1 ms is the whole step
    assert policy.parks({"cpu": 1_500_000})


def test_auto_timing_in_the_scheduler_parks_a_first_load_then_loads_before_the_forward(tmp_path):
    """A tier's first load is parked (its speed unknown); once measured, a small load runs
    before the forward pass of the step that schedules the request, and the counters say
    which ran how."""
    slot = 1 << 20
    sched, worker, prompt = _setup(CPUTier(16 * slot, slot), per_token_s=1e-3)
    sched.timing = LoadTiming.AUTO
    first = Request("first", prompt + [7])
    assert sched.matched_tokens(first, 0) == 8 * BLOCK
    assert sched.parks(first)  # the cpu tier was never measured
    _resume(sched, worker, prompt, "first")
    assert "cpu" in sched.policy.tiers
    again = Request("again", prompt + [8])
    assert sched.matched_tokens(again, 0) == 8 * BLOCK
    assert not sched.parks(again)  # 0.5 s steps: a few KB load long before
    sched.allocated(again, list(range(20, 30)), 8 * BLOCK)
    plan = sched.step_plan(SchedulerOutput([NewRequest("again", (list(range(20, 30)),), 8 * BLOCK)],
                                           num_scheduled_tokens={"again": 1}))
    assert [t.parked for t in plan.loads] == [False]
    assert plan.loads_before_forward() == plan.loads and plan.parked_loads() == []
    assert (sched.parked_loads, sched.forward_loads) == (1, 1)
    sched.timing = LoadTiming.PARKED
    assert sched.matched_tokens(Request("parked", prompt + [9]), 0) == 8 * BLOCK
    assert sched.parks(Request("parked", prompt + [9]))


def test_async_loads_option_values():
    assert LoadTiming.of(True) is LoadTiming.of("true") is LoadTiming.PARKED
    assert LoadTiming.of(False) is LoadTiming.of("0") is LoadTiming.BEFORE_FORWARD
    assert LoadTiming.of("Auto") is LoadTiming.AUTO
    with pytest.raises(ConfigError, match="async_loads must be true, false or auto"):
        LoadTiming.of("sometimes")
