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
from kvtier.connectors.vllm_policy import MIN_PREFILL_TOKENS, LoadPolicy, StepMeter
from kvtier.connectors.vllm_scheduler import SchedulerSide
from kvtier.connectors.vllm_worker import WorkerSide
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
