"""The vLLM connector's scheduler side against a real in-process store, with vLLM's
requests and scheduler outputs faked at the boundary: what it offers vLLM (the stored
prefix, never the prompt's last token), what it plans to load into the blocks vLLM
allocated, which completed prompt blocks it saves, and that a store it cannot reach is a
miss, not an error."""

from __future__ import annotations

from kvtier.connectors.chunk_store import LocalChunkStore
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.connectors.vllm_blocks import block_keys
from kvtier.connectors.vllm_scheduler import SchedulerSide
from kvtier.connectors.vllm_worker import WorkerSide
from tests.connectors.vllm_fakes import (
    BLOCK,
    CachedRequests,
    NewRequest,
    Request,
    SchedulerOutput,
    caches,
)

FP = b"vllm-v2|scheduler-test"


def _sides() -> tuple[SchedulerSide, WorkerSide, LocalChunkStore]:
    store = LocalChunkStore(TierManager([CPUTier(64 << 20, 1 << 20)]))
    worker = WorkerSide(lambda: store, BLOCK, FP)
    worker.register(caches(32, True), 32)
    return SchedulerSide(lambda: store, BLOCK, FP), worker, store


def test_a_prompt_is_saved_block_by_block_as_vllm_computes_it():
    sched, worker, store = _sides()
    prompt = list(range(100, 100 + 5 * BLOCK + 3))  # five full blocks and a tail
    req = Request("a", prompt)
    assert sched.matched_tokens(req, 0) == 0  # nothing stored yet
    sched.allocated(req, [3, 4, 5, 6, 7, 8], 0)
    step1 = sched.step_plan(SchedulerOutput(
        [NewRequest("a", ([3, 4, 5, 6, 7, 8],), 0)], num_scheduled_tokens={"a": 2 * BLOCK + 5}))
    assert step1.loads == [] and [s.block_ids for s in step1.saves] == [[3, 4]]
    worker.save(step1.saves)
    step2 = sched.step_plan(SchedulerOutput(
        scheduled_cached_reqs=CachedRequests(["a"], [None], set(), [2 * BLOCK + 5]),
        num_scheduled_tokens={"a": len(prompt) - 2 * BLOCK - 5}))
    assert [s.block_ids for s in step2.saves] == [[5, 6, 7]]  # the tail block is not saved
    worker.save(step2.saves)
    keys = block_keys(prompt, BLOCK, FP)
    assert keys == step1.saves[0].keys + step2.saves[0].keys
    assert store.lookup(keys) == 5
    step3 = sched.step_plan(SchedulerOutput(
        scheduled_cached_reqs=CachedRequests(["a"], [None], set(), [len(prompt)]),
        num_scheduled_tokens={"a": 1}))
    assert step3.saves == []  # decoding: nothing more of the prompt to save
    sched.finished("a")


def test_a_second_request_sharing_the_prefix_is_offered_and_loads_it():
    sched, worker, store = _sides()
    shared = list(range(7, 7 + 4 * BLOCK))
    first = Request("a", shared + [1, 2, 3])
    sched.matched_tokens(first, 0)
    sched.allocated(first, [0, 1, 2, 3, 4], 0)
    worker.save(sched.step_plan(SchedulerOutput(
        [NewRequest("a", ([0, 1, 2, 3, 4],), 0)], num_scheduled_tokens={"a": 4 * BLOCK + 3})).saves)
    second = Request("b", shared + [9] * (BLOCK // 2))
    assert sched.matched_tokens(second, 0) == 4 * BLOCK
    exact = Request("c", shared)  # all of it stored: the last block is left to compute
    assert sched.matched_tokens(exact, 0) == 3 * BLOCK
    assert sched.matched_tokens(second, 2 * BLOCK) == 2 * BLOCK  # vLLM had two cached
    sched.allocated(second, [10, 11, 12, 13, 14], 2 * BLOCK)
    plan = sched.step_plan(SchedulerOutput(
        [NewRequest("b", ([10, 11, 12, 13, 14],), 4 * BLOCK)], num_scheduled_tokens={"b": 8}))
    (load,) = plan.loads
    assert load.block_ids == [12, 13] and load.keys == block_keys(shared, BLOCK, FP)[2:4]
    worker.load(plan.loads)
    assert worker.take_load_errors() == set() and sched.hit_blocks == 2
    assert plan.saves == []  # the loaded blocks are stored already


def test_a_resumed_request_gets_its_blocks_anew():
    sched, _, _ = _sides()
    req = Request("a", list(range(3 * BLOCK + 1)))
    sched.matched_tokens(req, 0)
    sched.allocated(req, [0, 1, 2, 3], 0)
    sched.step_plan(SchedulerOutput([NewRequest("a", ([0, 1, 2, 3],), 0)],
                                    num_scheduled_tokens={"a": BLOCK}))
    plan = sched.step_plan(SchedulerOutput(
        scheduled_cached_reqs=CachedRequests(["a"], [([20, 21, 22, 23],)], {"a"}, [BLOCK]),
        num_scheduled_tokens={"a": 2 * BLOCK + 1}))
    assert [s.block_ids for s in plan.saves] == [[21, 22]]


def test_a_store_that_cannot_be_reached_is_a_miss():
    def unreachable():
        raise ConnectionError("kvtier serve is down")

    sched = SchedulerSide(unreachable, BLOCK, FP)
    assert sched.matched_tokens(Request("a", list(range(4 * BLOCK))), 0) == 0
