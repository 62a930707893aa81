"""The vLLM connector's scheduler side against a real in-process store, with vLLM's
requests and scheduler outputs faked at the boundary: what it offers vLLM (the stored
prefix in whole chunks and a tail, every rank's part, never the prompt's last token), what
it plans to load into the blocks vLLM allocated, which completed chunks it saves (never one
the store holds), the reply saved when a request ends, and that a store it cannot reach is
a miss, not an error."""

from __future__ import annotations

import pytest
import torch

from kvtier.connectors.chunk_store import LocalChunkStore
from kvtier.connectors.tiers.cpu_tier import CPUTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.connectors.vllm_blocks import ChunkGrid, ChunkSpan, ChunkTransfer, Rank, Role
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

FP = b"vllm-v3|scheduler-test"
GRID = ChunkGrid(BLOCK, 2, FP)  # chunks of two blocks


def _sides(world: int = 1) -> tuple[SchedulerSide, list[WorkerSide], LocalChunkStore]:
    store = LocalChunkStore(TierManager([CPUTier(64 << 20, 1 << 20)]))
    workers = []
    for r in range(world):
        worker = WorkerSide(lambda: store, GRID, Rank(r, world))
        worker.register(caches(32, True, seed=r), 32)
        workers.append(worker)
    return SchedulerSide(lambda: store, GRID, world), workers, store


def _new(req_id: str, blocks: list[int], computed: int, scheduled: int) -> SchedulerOutput:
    return SchedulerOutput([NewRequest(req_id, (blocks,), computed)],
                           num_scheduled_tokens={req_id: scheduled})


def _cached(req_id: str, computed: int, scheduled: int, new_ids=None, resumed=False
            ) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_cached_reqs=CachedRequests([req_id], [new_ids], {req_id} if resumed else set(),
                                             [computed]),
        num_scheduled_tokens={req_id: scheduled})


def _blocks(transfers: list[ChunkTransfer]) -> list[list[int]]:
    return [list(c.block_ids) for t in transfers for c in t.chunks]


def _run(sched: SchedulerSide, workers: list[WorkerSide], req: Request, blocks: list[int],
         end: bool = True) -> None:
    """Schedule ``req`` from nothing, prefill it in one step, save what the plan says, and
    (``end``) end it there: its final save stores the prompt's tail."""
    sched.matched_tokens(req, 0)
    sched.allocated(req, blocks, 0)
    plan = sched.step_plan(_new(req.request_id, blocks, 0, len(req.prompt_token_ids)))
    for w in workers:
        w.save(plan.saves)
    if not end:
        return
    req.num_computed_tokens = len(req.prompt_token_ids)
    sched.finished(req, blocks)
    final = sched.step_plan(SchedulerOutput())
    for w in workers:
        w.save(final.finishing)
    sched.saves_landed([req.request_id])


@pytest.mark.parametrize("role", [Role.BOTH, Role.PRODUCER])
def test_a_prompt_is_saved_chunk_by_chunk_as_vllm_computes_it_then_its_tail(role):
    """Full chunks as they fill. The prompt's tail: a prefill peer saves it with the prompt
    (its decode peer asks at once); an instance that saves the reply saves it once, at the
    request's end, inside the tail that holds the reply (never the same blocks twice)."""
    sched, (worker,), store = _sides()
    sched.role = role
    prompt = list(range(100, 100 + 5 * BLOCK + 3))  # two chunks, a one-block tail, 3 tokens
    req = Request("a", prompt)
    assert sched.matched_tokens(req, 0) == 0  # nothing stored yet
    sched.allocated(req, [3, 4, 5, 6, 7, 8], 0)
    step1 = sched.step_plan(_new("a", [3, 4, 5, 6, 7, 8], 0, 3 * BLOCK + 5))
    assert step1.loads == [] and _blocks(step1.saves) == [[3, 4]]  # the first chunk is full
    worker.save(step1.saves)
    step2 = sched.step_plan(_cached("a", 3 * BLOCK + 5, len(prompt) - 3 * BLOCK - 5))
    keys = GRID.keys(prompt)
    if role is Role.PRODUCER:
        assert _blocks(step2.saves) == [[5, 6], [7]]  # the second chunk, then the prompt's tail
        worker.save(step2.saves)
        assert [c.key for t in step1.saves + step2.saves for c in t.chunks] == [k.key for k in keys]
        assert keys[-1].is_tail and store.present([k.key for k in keys]) == [True] * 3
        return
    assert _blocks(step2.saves) == [[5, 6]]  # the second chunk; the tail waits for the reply
    worker.save(step2.saves)
    assert store.present([k.key for k in keys]) == [True, True, False]
    step3 = sched.step_plan(_cached("a", len(prompt), 1))
    assert step3.saves == []  # decoding: the reply is saved when the request ends
    req.output_token_ids = list(range(700, 700 + BLOCK))
    req.num_computed_tokens = len(req.all_token_ids) - 1
    assert sched.finished(req, [3, 4, 5, 6, 7, 8]) is True
    final = sched.step_plan(SchedulerOutput())
    assert _blocks(final.finishing) == [[7, 8]]  # the prompt's tail block and the reply's: full
    worker.save(final.finishing)
    turn2 = Request("b", req.all_token_ids[:-1] + [5] * BLOCK)
    assert sched.matched_tokens(turn2, 0) == 6 * BLOCK  # the returning turn finds it all
    # the cost: another continuation of the prompt (a regenerated reply) finds its full
    # chunks, not the prompt's last partial one (at most a chunk less one block to recompute)
    assert sched.matched_tokens(Request("c", prompt[: 5 * BLOCK] + [9] * BLOCK), 0) == 4 * BLOCK


def test_a_second_request_sharing_the_prefix_loads_it_past_what_vllm_holds():
    sched, (worker,), store = _sides()
    shared = list(range(7, 7 + 4 * BLOCK))
    _run(sched, [worker], Request("a", shared + [1, 2, 3]), [0, 1, 2, 3, 4])
    second = Request("b", shared + [9] * (BLOCK // 2))
    assert sched.matched_tokens(second, 0) == 4 * BLOCK
    exact = Request("c", shared)  # all of it stored: the last block is left to compute
    assert sched.matched_tokens(exact, 0) == 3 * BLOCK  # the second chunk's first block only
    assert sched.matched_tokens(second, 1 * BLOCK) == 3 * BLOCK  # vLLM had one block
    sched.allocated(second, [10, 11, 12, 13, 14], 3 * BLOCK)
    plan = sched.step_plan(_new("b", [10, 11, 12, 13, 14], 4 * BLOCK, 8))
    (load,) = plan.loads
    keys = GRID.keys(shared)
    assert load.chunks == [ChunkSpan(keys[0].key, (None, 11)), ChunkSpan(keys[1].key, (12, 13), 2)]
    worker.load(plan.loads)
    assert worker.take_load_errors() == set() and sched.hit_blocks == 3
    assert plan.saves == []  # the loaded chunks are stored already


def test_a_returning_turn_finds_the_previous_turns_tail():
    sched, (worker,), _ = _sides()
    turn1 = list(range(50, 50 + 5 * BLOCK + 4))
    _run(sched, [worker], Request("t1", turn1), list(range(6)))
    turn2 = turn1 + list(range(900, 900 + 3 * BLOCK))
    assert sched.matched_tokens(Request("t2", turn2), 0) == 5 * BLOCK  # 2 chunks + the tail


def test_chunks_the_store_holds_are_not_saved_again():
    """vLLM's own prefix cache supplied the shared prefix: nothing is loaded and nothing of
    it is uploaded again."""
    sched, (worker,), _ = _sides()
    shared = list(range(300, 300 + 4 * BLOCK))
    _run(sched, [worker], Request("a", shared + [1]), [0, 1, 2, 3, 4])
    req = Request("b", shared + list(range(5 * BLOCK)))
    assert sched.matched_tokens(req, 4 * BLOCK) == 0  # vLLM holds all that is stored
    sched.allocated(req, list(range(10, 19)), 0)
    plan = sched.step_plan(_new("b", list(range(10, 19)), 4 * BLOCK, 5 * BLOCK))
    assert _blocks(plan.saves) == [[14, 15], [16, 17]]  # only what is new (its tail at its end)


def test_concurrent_requests_over_one_prompt_upload_its_chunks_once():
    """Four first turns over the same system prompt arrive together (nothing stored yet):
    the first to complete a chunk saves it, the others do not upload it again while that
    save is in flight; once it landed, the store answers for it."""
    sched, (worker,), store = _sides()
    shared = list(range(600, 600 + 4 * BLOCK))
    reqs = [Request(f"r{i}", shared + [i] * (BLOCK + 1)) for i in range(4)]
    for r in reqs:
        assert sched.matched_tokens(r, 0) == 0
        sched.allocated(r, list(range(6 * int(r.request_id[1:]), 6 * int(r.request_id[1:]) + 6)), 0)
    out = SchedulerOutput([NewRequest(r.request_id, (list(range(6 * i, 6 * i + 6)),), 0)
                           for i, r in enumerate(reqs)],
                          num_scheduled_tokens={r.request_id: len(r.prompt_token_ids) for r in reqs})
    plan = sched.step_plan(out)
    keys = [k.key for k in GRID.keys(shared)]
    saved = [c.key for t in plan.saves for c in t.chunks]
    assert saved.count(keys[0]) == 1 and saved.count(keys[1]) == 1  # the shared chunks once
    assert len(saved) == 2  # each request's own tail is saved at its end
    worker.save(plan.saves)
    worker.wait_saves()
    assert store.present(keys) == [True, True]
    for r in reqs:  # finished: the owner's saves landed, the store answers from now on
        sched.finished(r, [])
    sched.saves_landed([r.request_id for r in reqs])
    assert sched._saving == {} and sched._owned == {}
    late = Request("late", shared + [7] * BLOCK)
    assert sched.matched_tokens(late, 0) == 4 * BLOCK


def test_a_finished_request_saves_its_reply_and_holds_its_blocks_until_then():
    sched, (worker,), store = _sides()
    prompt = list(range(20, 20 + 3 * BLOCK))
    req = Request("a", prompt)
    _run(sched, [worker], req, [0, 1, 2], end=False)
    req.output_token_ids = list(range(500, 500 + 2 * BLOCK + 1))
    req.num_computed_tokens = len(req.all_token_ids) - 1  # the last token has no KV yet
    assert sched.finished(req, [0, 1, 2, 3, 4, 5]) is True  # blocks held for the save
    turn2 = Request("b", req.all_token_ids[:-1] + [7] * BLOCK)
    # the next turn arrives before the next step: the final save is planned, not yet run
    assert sched.matched_tokens(turn2, 0) == 5 * BLOCK  # the reply is restored
    sched.allocated(turn2, list(range(10, 17)), 5 * BLOCK)
    plan = sched.step_plan(_new("b", list(range(10, 17)), 5 * BLOCK, 2))
    assert _blocks(plan.finishing) == [[2, 3], [4]]  # chunk 1 now full, and the new tail
    assert plan.needs_finishing()  # the load reads them: the workers save them first
    worker.save(plan.finishing)
    worker.load(plan.loads)
    assert worker.take_load_errors() == set() and worker.finished({"a"}) == {"a"}
    assert sched.matched_tokens(Request("c", turn2.prompt_token_ids), 0) == 5 * BLOCK


def test_a_request_that_saved_nothing_frees_its_blocks_at_once():
    sched, _, _ = _sides()
    sched.save_decode = False
    req = Request("a", list(range(BLOCK - 1)))
    sched.matched_tokens(req, 0)
    sched.allocated(req, [0], 0)
    sched.step_plan(_new("a", [0], 0, BLOCK - 1))
    assert sched.finished(req, [0]) is False


def test_a_resumed_request_gets_its_blocks_anew():
    sched, _, _ = _sides()
    req = Request("a", list(range(3 * BLOCK + 1)))
    sched.matched_tokens(req, 0)
    sched.allocated(req, [0, 1, 2, 3], 0)
    sched.step_plan(_new("a", [0, 1, 2, 3], 0, BLOCK))
    plan = sched.step_plan(_cached("a", BLOCK, 2 * BLOCK + 1, ([20, 21, 22, 23],), resumed=True))
    assert _blocks(plan.saves) == [[20, 21]]


def test_a_preemption_is_in_the_plan():
    sched, _, _ = _sides()
    out = SchedulerOutput(preempted_req_ids={"x"})
    assert sched.step_plan(out).preempted and not sched.step_plan(SchedulerOutput()).preempted


def test_with_two_ranks_a_chunk_counts_only_once_both_parts_are_stored():
    sched, (rank0, rank1), _ = _sides(world=2)
    prompt = list(range(40, 40 + 4 * BLOCK + 1))
    req = Request("a", prompt)
    sched.matched_tokens(req, 0)
    sched.allocated(req, [0, 1, 2, 3, 4], 0)
    plan = sched.step_plan(_new("a", [0, 1, 2, 3, 4], 0, len(prompt)))
    rank0.save(plan.saves)
    again = Request("b", prompt + [1])
    assert sched.matched_tokens(again, 0) == 0  # rank 1's parts are missing
    rank1.save(plan.saves)
    assert sched.matched_tokens(again, 0) == 4 * BLOCK


def test_a_store_that_cannot_be_reached_is_a_miss():
    def unreachable():
        raise ConnectionError("kvtier serve is down")

    sched = SchedulerSide(unreachable, GRID)
    assert sched.matched_tokens(Request("a", list(range(4 * BLOCK))), 0) == 0


def test_a_resent_prompt_loads_all_but_its_last_block_from_a_longer_tail():
    """A decode instance gets the prompt its prefill peer stored: the stored tail chunk
    holds the prompt's last block too, which vLLM must compute; the load takes the tail's
    other blocks and leaves that one alone."""
    grid = ChunkGrid(BLOCK, 4, FP)
    store = LocalChunkStore(TierManager([CPUTier(64 << 20, 1 << 20)]))
    producer = SchedulerSide(lambda: store, grid, role=Role.PRODUCER)
    consumer = SchedulerSide(lambda: store, grid, role=Role.CONSUMER)
    worker = WorkerSide(lambda: store, grid)
    kv = caches(32, True)
    worker.register(kv, 32)
    last = [t[16].clone() for t in kv.values()]
    prompt = list(range(60, 60 + 7 * BLOCK))  # a chunk of 4 blocks, a tail of 3, exactly
    assert producer.matched_tokens(Request("p", prompt), 0) == 0  # a producer never loads
    producer.allocated(Request("p", prompt), list(range(7)), 0)
    plan = producer.step_plan(_new("p", list(range(7)), 0, len(prompt)))
    assert _blocks(plan.saves) == [[0, 1, 2, 3], [4, 5, 6]]
    worker.save(plan.saves)
    producer.saves_landed(["p"])  # the store answers for those chunks now
    again = Request("p2", prompt)  # the producer recomputes a prompt the store holds
    assert producer.matched_tokens(again, 0) == 0
    producer.allocated(again, list(range(20, 27)), 0)
    assert producer.step_plan(_new("p2", list(range(20, 27)), 0, len(prompt))).saves == []  # not uploaded again
    longer = Request("p3", prompt[: 4 * BLOCK] + list(range(900, 900 + 5 * BLOCK)))
    assert producer.matched_tokens(longer, 0) == 0
    producer.allocated(longer, list(range(20, 29)), 0)
    plan = producer.step_plan(_new("p3", list(range(20, 29)), 0, 9 * BLOCK))
    assert _blocks(plan.saves) == [[24, 25, 26, 27], [28]]  # only what the store lacks
    req = Request("d", prompt)
    assert consumer.matched_tokens(req, 0) == 6 * BLOCK  # all but the last block
    consumer.allocated(req, list(range(10, 17)), 6 * BLOCK)
    plan = consumer.step_plan(_new("d", list(range(10, 17)), 6 * BLOCK, BLOCK))
    assert [c.block_ids for t in plan.loads for c in t.chunks] == [(10, 11, 12, 13), (14, 15, None)]
    assert plan.saves == []  # a consumer never saves
    worker.load(plan.loads)
    assert worker.take_load_errors() == set() and worker.stats.loaded_blocks == 6
    for t, before in zip(kv.values(), last, strict=True):
        assert all(torch.equal(t[10 + i], t[i]) for i in range(6))  # each block where it belongs
        assert torch.equal(t[16], before)  # the last block: vLLM's to compute, left alone


def _alice_over_ram_and_disk(tmp_path, cpu: CPUTier
                             ) -> tuple[SchedulerSide, WorkerSide, LocalChunkStore, Request]:
    """Both sides over ``cpu`` with a disk below it, after alice's first turn (three
    chunks) was saved; the sides, the store and that turn."""
    from kvtier.connectors.tiers.disk_tier import DiskTier

    store = LocalChunkStore(TierManager([cpu, DiskTier(tmp_path / "d", fsync=False)]))
    sched = SchedulerSide(lambda: store, GRID)
    worker = WorkerSide(lambda: store, GRID)
    worker.register(caches(32, True), 32)
    turn = Request("t1", list(range(5, 5 + 6 * BLOCK + 1)))
    turn.session_id = "alice"
    _run(sched, [worker], turn, list(range(7)))
    return sched, worker, store, turn


def test_a_sessions_next_request_promotes_its_chunks_before_it_is_scheduled(tmp_path):
    """A conversation whose chunks went down to disk: when its next request arrives (vLLM
    adds it; it may queue), its chunks are raised into the CPU tier before the lookup that
    schedules it, which then finds them in RAM."""
    sched, worker, store, turn1 = _alice_over_ram_and_disk(tmp_path, CPUTier(4 << 20, 1 << 20))
    keys = [k.key for k in GRID.keys(turn1.prompt_token_ids)]
    assert store.where(keys) == ["cpu"] * 3
    # alice goes idle; bob's conversation fills the CPU tier and pushes hers down to disk
    _run(sched, [worker], Request("bob", list(range(900, 900 + 8 * BLOCK + 1))), list(range(10, 19)))
    assert store.where(keys) == ["disk"] * 3
    turn2 = Request("t2", turn1.prompt_token_ids + [1, 2, 3])
    turn2.session_id = "alice"
    sched.arrived(turn2)  # and vLLM's next pass does not schedule it: it waits
    [raised] = sched.raise_waiting()
    assert raised.result(timeout=30) == 3  # read from disk, written to RAM
    assert sched.arrivals.raises == 1
    assert store.where(keys) == ["cpu"] * 3
    assert sched.matched_tokens(turn2, 0) == 6 * BLOCK


def test_a_sessions_chunks_are_stored_in_chain_order_and_its_tail_goes_first(tmp_path):
    """Each chunk a session saves carries its place in the conversation, so a full
    session-aware CPU tier gives up the session's last chunk first (down to the disk),
    keeping the head a returning turn needs to restore anything at all."""
    from kvtier.policies.eviction import SessionAware

    cpu = CPUTier(3 << 20, 1 << 20, eviction=SessionAware())
    sched, worker, store, turn = _alice_over_ram_and_disk(tmp_path, cpu)
    keys = [k.key for k in GRID.keys(turn.prompt_token_ids)]
    assert [(cpu.chunk_info(k).session, cpu.chunk_info(k).index) for k in keys] == [
        ("alice", 0), ("alice", 2), ("alice", 4)]  # each chunk's first block
    other = Request("t2", list(range(900, 900 + 2 * BLOCK + 1)))
    other.session_id = "bob"
    _run(sched, [worker], other, list(range(10, 13)))
    assert store.where(keys) == ["cpu", "cpu", "disk"]  # alice's tail went down, not her head


def test_a_running_turn_keeps_its_sessions_chunks_over_an_ended_one():
    """vLLM's session ids reach the store's session-aware tier as turns: alice's request
    still runs, bob's ended after hers began; when carol's chunks need room, bob's go
    (idle time alone would give up alice's, stored first). A prefill peer reports no
    turns (its requests are halves of them)."""
    from kvtier.policies.eviction import SessionAware

    cpu = CPUTier(3 << 20, 1 << 20, eviction=SessionAware())
    store = LocalChunkStore(TierManager([cpu]))
    sched = SchedulerSide(lambda: store, GRID)
    worker = WorkerSide(lambda: store, GRID)
    worker.register(caches(32, True), 32)
    runs = []
    for name, first, end in (("alice", 100, False), ("bob", 300, True)):
        req = Request(name, list(range(first, first + 2 * BLOCK + 1)))
        req.session_id = name
        _run(sched, [worker], req, list(range(len(runs) * 3, len(runs) * 3 + 3)), end=end)
        runs.append(GRID.keys(req.prompt_token_ids)[0].key)
    sched.turns.drain()
    assert sched.turns.sent == 3
    carol = Request("carol", list(range(500, 500 + 4 * BLOCK + 1)))
    carol.session_id = "carol"
    _run(sched, [worker], carol, list(range(10, 15)), end=False)
    alice, bob = runs
    assert store.lookup([alice]) == 1 and store.lookup([bob]) == 0
    sched.close()

    producer = SchedulerSide(lambda: store, GRID, role=Role.PRODUCER)
    req = Request("p", list(range(700, 700 + BLOCK + 1)))
    req.session_id = "dave"
    producer.matched_tokens(req, 0)
    producer.finished(req, [])
    producer.turns.drain()
    assert producer.turns.sent == 0


class _Counted:
    """A real store, its round trips counted (what vLLM's scheduler loop waits on)."""

    def __init__(self, store) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return method(*args, **kwargs)

        return counted


def _after_a_first_turn() -> tuple[SchedulerSide, _Counted, list[int]]:
    """A scheduler side over a store holding a first turn (2 chunks and a one-block tail),
    its round trips counted, and the conversation's second turn."""
    sched, (worker,), store = _sides()
    turn1 = list(range(50, 50 + 5 * BLOCK + 4))
    _run(sched, [worker], Request("t1", turn1), list(range(6)))
    counted = _Counted(store)
    return SchedulerSide(lambda: counted, GRID), counted, turn1 + list(range(900, 900 + 3 * BLOCK))


def test_a_lookup_is_one_round_trip_prefix_and_tail_together():
    asker, counted, turn2 = _after_a_first_turn()
    assert asker.matched_tokens(Request("t2", turn2), 0) == 5 * BLOCK  # 2 chunks + the tail
    assert counted.calls == 1
    assert asker.matched_tokens(Request("t3", list(range(7000, 7000 + 9 * BLOCK))), 0) == 0
    assert counted.calls == 2  # a miss is one round trip too
    assert asker.lookups == 2  # what the connector reports as vllm:kvtier_lookups_total


def test_a_waiting_arrival_whose_chunks_are_all_in_ram_asks_for_no_raise():
    """vLLM adds a request whose stored chunks are all in RAM (or a first turn, none
    stored) and does not schedule it in the next pass: the background question is one
    lookup, no prefetch; the scheduling lookup asks as before."""
    asker, counted, turn2 = _after_a_first_turn()
    t2 = Request("t2", turn2)
    asker.arrived(t2)
    [raised] = asker.raise_waiting()
    assert raised.result(timeout=30) == 0
    assert counted.calls == 1 and asker.arrivals.raises == 0  # a lookup, no prefetch
    assert asker.matched_tokens(t2, 0) == 5 * BLOCK
    assert counted.calls == 2 and asker.lookups == 1
    new = Request("new", list(range(7000, 7000 + 9 * BLOCK)))  # a first turn: nothing stored
    asker.arrived(new)
    [raised] = asker.raise_waiting()
    assert raised.result(timeout=30) == 0
    assert counted.calls == 3 and asker.arrivals.raises == 0


def test_a_request_looked_up_in_the_pass_after_its_arrival_asks_nothing_more():
    asker, counted, turn2 = _after_a_first_turn()
    t2 = Request("t2", turn2)
    asker.arrived(t2)
    assert asker.matched_tokens(t2, 0) == 5 * BLOCK
    assert asker.raise_waiting() == [] and counted.calls == 1


def test_requests_that_arrived_together_are_looked_up_in_one_round_trip():
    """Users whose replies ended in the same step send their next messages at once: vLLM
    looks them up one after another in its next pass, and the first question asks about
    all of them. Each answer is the one a question of its own gets."""
    asker, counted, turn2 = _after_a_first_turn()
    alone, _, _ = _after_a_first_turn()
    others = [list(range(7000, 7000 + 9 * BLOCK)), turn2[: 3 * BLOCK] + [1] * BLOCK]
    reqs = [Request(f"r{i}", p) for i, p in enumerate([turn2, *others])]
    for r in reqs:
        asker.arrived(r)
    got = [asker.matched_tokens(r, 0) for r in reqs]
    assert counted.calls == 1 and asker.lookups == 1
    assert got == [alone.matched_tokens(Request(r.request_id, r.prompt_token_ids), 0)
                   for r in reqs] == [5 * BLOCK, 0, 2 * BLOCK]
    assert asker.raise_waiting() == []


def test_an_answer_asked_with_another_request_does_not_outlive_its_pass():
    """A request asked about with the pass's first lookup and not looked up in that pass
    (vLLM had no room for it) is asked again in the pass that schedules it: the store may
    have changed. While it waits, its chunks are raised from that first answer (no
    question more)."""
    asker, counted, turn2 = _after_a_first_turn()
    first, waiting = Request("a", list(range(7000, 7000 + 9 * BLOCK))), Request("b", turn2)
    asker.arrived(first)
    asker.arrived(waiting)
    assert asker.matched_tokens(first, 0) == 0 and counted.calls == 1
    [raised] = asker.raise_waiting()  # the pass ends without looking ``waiting`` up
    assert raised.result(timeout=30) == 0 and counted.calls == 1  # all in RAM: no prefetch
    assert asker.matched_tokens(waiting, 0) == 5 * BLOCK and counted.calls == 2


def test_a_pass_asks_about_no_more_keys_than_one_question_holds(monkeypatch):
    from kvtier.connectors import vllm_lookup

    asker, counted, turn2 = _after_a_first_turn()
    reqs = [Request("t2", turn2), Request("new", list(range(7000, 7000 + 9 * BLOCK)))]
    monkeypatch.setattr(vllm_lookup, "MAX_PASS_KEYS", 1)  # room for the first request only
    for r in reqs:
        asker.arrived(r)
    assert [asker.matched_tokens(r, 0) for r in reqs] == [5 * BLOCK, 0]
    assert counted.calls == 2


def test_a_long_prompt_asks_for_the_tails_after_its_prefix_is_known(monkeypatch):
    from kvtier.connectors import vllm_lookup

    monkeypatch.setattr(vllm_lookup, "MAX_SPECULATIVE_KEYS", 4)
    asker, counted, turn2 = _after_a_first_turn()
    assert asker.matched_tokens(Request("t2", turn2), 0) == 5 * BLOCK  # the same answer
    assert counted.calls == 2


def test_the_one_round_trip_lookup_through_a_running_kvtier_serve(tmp_path):
    """The same question through the sidecar's lookup route: every rank's part, a tail
    found after the stored prefix, and the tier of each."""
    from kvtier.config import KVTierConfig
    from kvtier.connectors.chunk_store import RemoteChunkStore
    from kvtier.server.state import ServiceState
    from tests.http_server import running

    cfg = KVTierConfig()
    cfg.tiers.cpu_bytes = 16 << 20
    cfg.tiers.disk_dir = None
    with running(ServiceState.sidecar(cfg)) as url:
        store = RemoteChunkStore(url, 1 << 20)
        try:
            counted = _Counted(store)
            sched = SchedulerSide(lambda: counted, GRID, world=2)
            workers = []
            for r in range(2):
                w = WorkerSide(lambda: store, GRID, Rank(r, 2))
                w.register(caches(32, True, seed=r), 32)
                workers.append(w)
            turn1 = list(range(50, 50 + 5 * BLOCK + 4))
            _run(sched, workers, Request("t1", turn1), list(range(6)))
            counted.calls = 0
            turn2 = turn1 + list(range(900, 900 + 3 * BLOCK))
            assert sched.matched_tokens(Request("t2", turn2), 0) == 5 * BLOCK
            assert counted.calls == 1
            assert store.locate(["ab" * 16, ChunkGrid.rank_key(GRID.keys(turn1)[0].key, Rank(1, 2))]
                                ) == [None, "cpu"]
        finally:
            store.close()


def test_a_step_plan_says_whether_the_step_prefills():
    """A step that computes prompt tokens (more tokens than requests) is a prefill step,
    which saves may yield to; one token a request is a decode step."""
    sched, _, _ = _sides()
    req = Request("p", list(range(40, 40 + 3 * BLOCK)))
    sched.matched_tokens(req, 0)
    sched.allocated(req, [0, 1, 2], 0)
    assert sched.step_plan(_new("p", [0, 1, 2], 0, 3 * BLOCK)).prefill
    assert not sched.step_plan(_cached("p", 3 * BLOCK, 1)).prefill
    assert not sched.step_plan(SchedulerOutput()).prefill


def test_a_conversation_uploads_each_block_once_and_restores_it_whole():
    """Turn by turn, a chunk-sized slot fills in pieces: each turn uploads only the blocks
    the store lacks (never a block it holds again), and the next turn's lookup finds the
    pieces, chained, and restores every block bit for bit."""
    grid = ChunkGrid(BLOCK, 4, FP)
    store = LocalChunkStore(TierManager([CPUTier(64 << 20, 1 << 20)]))
    sched = SchedulerSide(lambda: store, grid)
    worker = WorkerSide(lambda: store, grid)
    kv = caches(64, True, seed=7)
    worker.register(kv, 64)
    tokens = list(range(1000, 1000 + 5 * BLOCK + 3))  # a whole slot, a block and 3 tokens
    uploaded: list[list[int]] = []
    loaded: list[int] = []
    kv_of: dict[int, list[torch.Tensor]] = {}  # the conversation's block -> its KV
    base = 0
    for turn in range(4):
        req = Request(f"t{turn}", tokens)
        ids = list(range(base, base + -(-len(tokens) // BLOCK) + 4))
        matched = sched.matched_tokens(req, 0)
        sched.allocated(req, ids, matched)
        plan = sched.step_plan(_new(req.request_id, ids, matched, len(tokens) - matched))
        worker.load(plan.loads)
        loaded.append(len([span for t in plan.loads for span in t.chunks]))
        assert worker.take_load_errors() == set()
        for pos, block in enumerate(ids[: matched // BLOCK]):  # restored as it was saved
            assert all(torch.equal(t[block], was) for t, was in zip(kv.values(), kv_of[pos], strict=True))
        worker.save(plan.saves)
        uploaded += [[ids.index(b) for b in span.targets] for t in plan.saves for span in t.chunks]
        reply = BLOCK * (1 + turn % 3)
        req.output_token_ids = list(range(3000 + 100 * turn, 3000 + 100 * turn + reply))
        req.num_computed_tokens = len(req.all_token_ids) - 1
        sched.finished(req, ids)
        final = sched.step_plan(SchedulerOutput())
        worker.save(final.finishing)
        sched.saves_landed([req.request_id])
        uploaded += [[ids.index(b) for b in span.targets] for t in final.finishing for span in t.chunks]
        for pos in range(req.num_computed_tokens // BLOCK):
            kv_of.setdefault(pos, [t[ids[pos]].clone() for t in kv.values()])
        if turn:
            assert matched == (len(tokens) - 1) // BLOCK * BLOCK  # all but the last block's
        tokens = req.all_token_ids[:-1] + list(range(5000 + 10 * turn, 5000 + 10 * turn + 2))
        base += len(ids)
    flat = [pos for span in uploaded for pos in span]
    assert sorted(flat) == list(range(len(flat)))  # every block of the conversation once
    assert [len(span) for span in uploaded] == [4, 2, 2, 3, 1]  # pieces within slots
    assert loaded == [0, 2, 3, 4]  # slot 1 in two pieces, slot 2 begun
    assert worker.stats.saved_blocks == len(flat)


def _shared_mid_slot(evict_first: bool = False
                     ) -> tuple[list[list[int]], list[list[int]], WorkerSide, dict]:
    """Four conversations over one system prompt that ends mid-slot, one after another
    (vLLM's prefix cache holding the prompt for all but the first): each one's uploaded
    and cut blocks (by place), its worker, and the KV of the first one's blocks.
    ``evict_first``: the first conversation's segment of the slot the prompt ends in
    leaves the store before the second saves."""
    grid = ChunkGrid(BLOCK, 4, FP)
    store = LocalChunkStore(TierManager([CPUTier(64 << 20, 1 << 20)]))
    sched = SchedulerSide(lambda: store, grid)
    worker = WorkerSide(lambda: store, grid)
    kv = caches(64, True, seed=3)
    worker.register(kv, 64)
    system = list(range(100, 100 + 6 * BLOCK))  # a slot and a half
    uploaded, cut = [], []
    first_kv = {}
    for i in range(4):
        req = Request(f"c{i}", system + list(range(1000 * (i + 1), 1000 * (i + 1) + 2 * BLOCK + 5)))
        ids = list(range(10 * i, 10 * i + 9))
        cached = 0 if i == 0 else 6 * BLOCK  # vLLM's prefix cache holds the system prompt
        matched = sched.matched_tokens(req, cached)
        sched.allocated(req, ids, matched)
        done = cached + matched
        plan = sched.step_plan(_new(req.request_id, ids, done, len(req.prompt_token_ids) - done))
        worker.save(plan.saves)
        req.num_computed_tokens = len(req.prompt_token_ids)
        sched.finished(req, ids)
        final = sched.step_plan(SchedulerOutput())
        worker.save(final.finishing)
        sched.saves_landed([req.request_id])
        spans = [span for t in plan.saves + final.finishing for span in t.chunks]
        uploaded.append(sorted(ids.index(b) for span in spans if span.source is None
                               for b in span.targets))
        cut.append(sorted(ids.index(b) for span in spans if span.source is not None
                          for b in span.targets))
        if i == 0:
            first_kv = {pos: [t[ids[pos]].clone() for t in kv.values()] for pos in range(8)}
            if evict_first:  # the segment the prompt ends inside
                store.manager.delete([s.key for s in spans if s.first_block >= 4])
        probe = Request(f"p{i}", system + [7] * BLOCK)  # what the store holds of the prompt
        assert sched.matched_tokens(probe, 0) == (4 if i == 0 else 6) * BLOCK
        sched.finished(probe, [])
    return uploaded, cut, worker, first_kv


def test_a_prompt_shared_mid_slot_is_cut_from_the_stored_segment_never_uploaded_again():
    """The first conversation stores the prompt's part of its last slot in a segment that
    runs into its own message (a key only its tokens make); the second, whose shared blocks
    vLLM's prefix cache held, ends a segment where they end, cut out of the first's inside
    the store (nothing uploaded); every later one finds the prompt whole and uploads only
    its own blocks. What the store holds is the first conversation's KV, bit for bit."""
    uploaded, cut, worker, first_kv = _shared_mid_slot()
    assert uploaded[0] == list(range(8))
    assert cut[1] == [4, 5] and uploaded[1] == [6, 7]  # the shared part cut, not uploaded
    assert uploaded[2] == uploaded[3] == [6, 7] and cut[2] == cut[3] == []
    flat = [b for u in uploaded for b in u]
    assert worker.stats.saved_blocks == len(flat) and worker.stats.derived_blocks == 2
    # a request over the whole prompt loads it: the blocks the first conversation computed
    grid = worker.grid
    store = worker._store()
    sched = SchedulerSide(lambda: store, grid)
    req = Request("reader", list(range(100, 100 + 6 * BLOCK)) + [1])
    ids = list(range(50, 57))
    matched = sched.matched_tokens(req, 0)
    assert matched == 6 * BLOCK
    sched.allocated(req, ids, matched)
    plan = sched.step_plan(_new("reader", ids, matched, 1))
    worker.load(plan.loads)
    assert worker.take_load_errors() == set()
    for pos in range(6):
        assert all(torch.equal(t[ids[pos]], was) for t, was in
                   zip(worker_kv(worker), first_kv[pos], strict=True)), pos


def worker_kv(worker: WorkerSide) -> list[torch.Tensor]:
    return [layer.kv for layer in worker.layers]


def test_a_segment_whose_source_left_the_store_is_uploaded_instead():
    uploaded, cut, worker, _ = _shared_mid_slot(evict_first=True)
    assert cut[1] == [4, 5]  # planned as a cut ...
    assert uploaded[1] == [6, 7] and worker.stats.derived_blocks == 0  # ... written instead
    assert worker.stats.saved_blocks == 8 + (2 + 2) + 2 + 2


def test_concurrent_first_turns_over_a_prompt_shared_mid_slot_upload_it_once():
    """Four conversations prefilled in one step (vLLM's prefix cache holds nothing of the
    prompt yet): the shared whole slot is saved once, and the prompt's part of its last
    slot too: the first stores it in a segment of its own message's, the second ends a
    segment where the blocks that one holds end and cuts it out of it (the others find
    that segment being saved); a later request finds the prompt."""
    grid = ChunkGrid(BLOCK, 4, FP)
    store = LocalChunkStore(TierManager([CPUTier(64 << 20, 1 << 20)]))
    sched = SchedulerSide(lambda: store, grid)
    worker = WorkerSide(lambda: store, grid)
    worker.register(caches(64, True, seed=5), 64)
    system = list(range(100, 100 + 6 * BLOCK))
    reqs = [Request(f"c{i}", system + list(range(1000 * (i + 1), 1000 * (i + 1) + 2 * BLOCK + 5)))
            for i in range(4)]
    ids = [list(range(10 * i, 10 * i + 9)) for i in range(4)]
    for req, blocks in zip(reqs, ids, strict=True):
        assert sched.matched_tokens(req, 0) == 0
        sched.allocated(req, blocks, 0)
    step = SchedulerOutput([NewRequest(r.request_id, (b,), 0) for r, b in zip(reqs, ids, strict=True)],
                           num_scheduled_tokens={r.request_id: len(r.prompt_token_ids) for r in reqs})
    plan = sched.step_plan(step)
    worker.save(plan.saves)
    for req, blocks in zip(reqs, ids, strict=True):
        req.num_computed_tokens = len(req.prompt_token_ids)
        sched.finished(req, blocks)
    final = sched.step_plan(SchedulerOutput())
    worker.save(final.finishing)
    sched.saves_landed([r.request_id for r in reqs])
    spans = {t.req_id: [] for t in plan.saves + final.finishing}
    for t in plan.saves + final.finishing:
        spans[t.req_id] += t.chunks
    uploaded = {r: sorted(ids[i].index(b) for s in spans[r] if s.source is None for b in s.targets)
                for i, r in enumerate(f"c{i}" for i in range(4))}
    cut = {r: sorted(ids[i].index(b) for s in spans[r] if s.source is not None for b in s.targets)
           for i, r in enumerate(f"c{i}" for i in range(4))}
    assert uploaded["c0"] == list(range(8))
    assert uploaded["c1"] == [6, 7] and cut["c1"] == [4, 5]
    for r in ("c2", "c3"):
        assert uploaded[r] == [6, 7] and cut[r] == [], r
    assert worker.stats.derived_blocks == 2 and worker.stats.saved_blocks == 8 + 3 * 2
    probe = Request("p", system + [7] * BLOCK)
    assert sched.matched_tokens(probe, 0) == 6 * BLOCK


def test_a_regenerated_reply_cuts_the_prompts_blocks_out_of_the_first_replys_segment():
    """The same prompt answered twice (a regenerated reply): the first answer's final save
    stored the prompt's last partial slot with its reply, under a key its reply makes; the
    second ends a segment where the prompt's blocks end, cut out of that one, and uploads
    only its own reply's blocks; a third sending of the prompt then finds all of it."""
    grid = ChunkGrid(BLOCK, 4, FP)
    store = LocalChunkStore(TierManager([CPUTier(64 << 20, 1 << 20)]))
    sched = SchedulerSide(lambda: store, grid)
    worker = WorkerSide(lambda: store, grid)
    worker.register(caches(64, True, seed=9), 64)
    prompt = list(range(400, 400 + 6 * BLOCK + 5))
    plans = []
    for n, reply in enumerate((list(range(7000, 7000 + 2 * BLOCK)), list(range(8000, 8000 + 2 * BLOCK)))):
        req = Request(f"r{n}", prompt)
        ids = list(range(10 * n, 10 * n + 9))
        matched = sched.matched_tokens(req, 0)
        sched.allocated(req, ids, matched)
        plan = sched.step_plan(_new(req.request_id, ids, matched, len(prompt) - matched))
        worker.save(plan.saves)
        req.output_token_ids = reply
        req.num_computed_tokens = len(req.all_token_ids) - 1
        sched.finished(req, ids)
        final = sched.step_plan(SchedulerOutput())
        worker.save(final.finishing)
        sched.saves_landed([req.request_id])
        plans.append([(span.first_block, len(span.block_ids), span.source is not None)
                      for t in plan.saves + final.finishing for span in t.chunks])
    assert plans[0] == [(0, 4, False), (4, 4, False)]
    assert plans[1] == [(4, 2, True), (6, 2, False)]  # slot 0 found stored, not saved
    assert worker.stats.derived_blocks == 2
    assert sched.matched_tokens(Request("r2", prompt), 0) == 6 * BLOCK


@pytest.mark.parametrize("prompt_blocks", [0, 3, 4, 5, 8, 9])
def test_a_sequences_keys_reuse_its_prompts_whole_slots_and_are_the_same(prompt_blocks):
    """The keys of a prompt and its reply, made from the prompt's (its whole slots not
    hashed again), equal those made from nothing; and they keep the keys ``keys`` gives."""
    from kvtier.connectors.vllm_blocks import SequenceKeys

    grid = ChunkGrid(BLOCK, 4, FP)
    tokens = list(range(9 * BLOCK + 5))
    prompt = SequenceKeys(grid, tokens[: prompt_blocks * BLOCK + 3])
    fresh, reused = SequenceKeys(grid, tokens), SequenceKeys(grid, tokens, prompt)
    every = [c.key for s in range(fresh.slots) for c in fresh.candidates(s)]
    assert every == [c.key for s in range(reused.slots) for c in reused.candidates(s)]
    assert len(set(every)) == len(every)
    assert [fresh.full_key(0), fresh.full_key(1), fresh.segment(8, 9).key] == [
        k.key for k in grid.keys(tokens)]
