"""The vLLM connector's two sides against a ``kvtier serve`` that stops answering: a real
server process (an operator's sidecar, or the private one the connector starts for its
in-process tiers) paused with SIGSTOP while the scheduler looks up and the worker loads
and saves, then resumed with SIGCONT. During the pause a lookup ends in one deadline as a
miss (vLLM recomputes), the connection that timed out is closed, and later requests skip
the store at once (counted) instead of waiting again; after it, kvtier hits and loads
bit-exact again. Saves the store refuses (too large for its tiers, or lost to a stalled
store) are counted by why."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvtier.chunk_format import max_chunk_bytes
from kvtier.connectors import private_sidecar
from kvtier.connectors.chunk_store import RemoteChunkStore, open_store
from kvtier.connectors.save_refusals import Refusal, ram_tier_problem
from kvtier.connectors.store_breaker import BreakerState, Call, StoreDeadlines
from kvtier.connectors.vllm_blocks import ChunkGrid, ChunkSpan, ChunkTransfer
from kvtier.connectors.vllm_scheduler import SchedulerSide
from kvtier.connectors.vllm_worker import WorkerSide
from kvtier.errors import ConfigError
from tests.connectors.vllm_fakes import (
    BLOCK,
    LAYERS,
    Request,
    caches,
)
from tests.serve_process import start_serve

FP = b"vllm-v3|sick-sidecar-test"
GRID = ChunkGrid(BLOCK, 2, FP)  # chunks of two blocks
NUM_BLOCKS = 16
TOKEN = "s1ck"
DEADLINES = {"lookup_timeout_s": 0.5, "transfer_timeout_s": 2.0, "store_retry_s": 0.2}
PATIENCE_S = 60.0
"""How long a poll waits for a state before the test fails (a busy 2-core host)."""


def _chunk_bytes(kv: dict[str, torch.Tensor]) -> int:
    layer = next(iter(kv.values()))
    block = LAYERS * layer.numel() * layer.element_size() // NUM_BLOCKS
    return max_chunk_bytes(LAYERS, block * GRID.chunk_blocks)


@contextlib.contextmanager
def _sidecar(kind: str, tmp_path, slot: int) -> Iterator[tuple[dict, int]]:
    """The connector's ``url`` options and the server's process id: an operator's
    ``kvtier serve``, or the private sidecar the connector starts for in-process tiers."""
    if kind == "serve":
        proc, url, _ = start_serve(tmp_path / "disk", TOKEN)
        try:
            yield {"url": url, "token": TOKEN, "shm": True, **DEADLINES}, proc.pid
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
            proc.wait(timeout=60)
        return
    address = private_sidecar.start({"tiers": {"cpu_bytes": 32 * slot, "disk_bytes": 0}}, slot)
    try:
        pid = private_sidecar.process_id(address)
        assert pid is not None
        yield {**address.options(), **DEADLINES}, pid
    finally:
        os.kill(pid, signal.SIGCONT)
        private_sidecar.stop(address)


def _ends(call: Callable[[], object]) -> object:
    """``call``'s result, run on a thread of its own; the test fails where it has not
    ended within a quarter of :data:`PATIENCE_S` (a hang: a store set aside is not asked)."""
    box: list[object] = []
    thread = threading.Thread(target=lambda: box.append(call()), daemon=True)
    thread.start()
    thread.join(PATIENCE_S / 4)
    assert not thread.is_alive(), "a request to the paused store did not end"
    return box[0]


def _until(check: Callable[[], bool]) -> None:
    """Poll ``check`` until it holds (the breaker's probe runs in the background)."""
    deadline = time.monotonic() + PATIENCE_S
    while not check():
        assert time.monotonic() < deadline, "the store was not used again after it answered"
        time.sleep(0.05)


def _block(kv: dict[str, torch.Tensor], block_id: int) -> list[torch.Tensor]:
    return [t[block_id].clone() for t in kv.values()]


def _load(keys: list[str], blocks: list[int]) -> list[ChunkTransfer]:
    return [ChunkTransfer("r", [ChunkSpan(k, tuple(blocks[2 * i : 2 * i + 2]))
                                for i, k in enumerate(keys)])]


@pytest.mark.parametrize("kind", ["serve", "private"])
def test_a_paused_sidecar_costs_one_deadline_then_kvtier_hits_again(tmp_path, kind):
    src, dst = caches(NUM_BLOCKS, True, seed=3), caches(NUM_BLOCKS, True, seed=4)
    slot = _chunk_bytes(src)
    with _sidecar(kind, tmp_path, slot) as (options, pid):
        lookups, loads = open_store(options, slot), open_store(options, slot)  # vLLM's two sides
        assert isinstance(lookups, RemoteChunkStore) and isinstance(loads, RemoteChunkStore)
        sched = SchedulerSide(lambda: lookups, GRID)
        writer = WorkerSide(lambda: loads, GRID)
        writer.register(src, NUM_BLOCKS)
        reader = WorkerSide(lambda: loads, GRID)
        reader.register(dst, NUM_BLOCKS)
        prompt = list(range(100, 100 + 4 * BLOCK + 3))  # two chunks, then 3 tokens
        keys = [k.key for k in GRID.keys(prompt)][:2]
        writer.save(_load(keys, [1, 2, 3, 4]))
        assert writer.stats.saved_blocks == 4
        assert sched.matched_tokens(Request("before", prompt), 0) == 4 * BLOCK
        assert lookups.asker.wire.open_connections == 1  # this thread's keep-alive one

        os.kill(pid, signal.SIGSTOP)
        try:
            # the scheduler's lookup: one deadline, then a miss; its connection is closed
            assert sched.matched_tokens(Request("paused", prompt), 0) == 0
            faults = lookups.faults
            assert (faults.timeouts, faults.breaker_opens) == (1, 1)
            assert lookups.asker.wire.open_connections == 0  # closed, never asked on again
            # set aside now: a lookup is a miss at once, no request sent, no new timeout
            assert _ends(lambda: sched.matched_tokens(Request("paused-2", prompt), 0)) == 0
            assert faults.timeouts == 1 and faults.skipped[Call.LOOKUP] >= 1
            # a load: one deadline, every block a load error (recomputed), then skipped
            reader.load(_load(keys, [5, 6, 7, 8]))
            assert reader.take_load_errors() == {5, 6, 7, 8}
            assert loads.faults.timeouts == 1 and loads.breaker.state is not BreakerState.CLOSED
            reader.load(_load(keys, [5, 6, 7, 8]))
            assert reader.take_load_errors() == {5, 6, 7, 8} and loads.faults.timeouts == 1
            # a save is not lost silently: refused as unavailable, counted
            more = [k.key for k in GRID.keys(list(range(900, 900 + 2 * BLOCK)))]
            writer.save(_load(more, [9, 10]))
            assert writer.refusals.counts[Refusal.UNAVAILABLE] == 1
            assert writer.stats.saved_blocks == 4 and loads.faults.timeouts == 1
        finally:
            os.kill(pid, signal.SIGCONT)

        # the store answers again: the breaker's probe finds it, and kvtier hits again
        _until(lambda: sched.matched_tokens(Request("after", prompt), 0) == 4 * BLOCK)
        assert lookups.breaker.state is BreakerState.CLOSED

        def loaded() -> bool:
            reader.load(_load(keys, [5, 6, 7, 8]))
            return not reader.take_load_errors()

        _until(loaded)
        for s, d in ((1, 5), (2, 6), (3, 7), (4, 8)):
            for a, b in zip(_block(src, s), _block(dst, d), strict=True):
                assert torch.equal(a, b)
        writer.save(_load(more, [9, 10]))
        assert writer.stats.saved_blocks == 6  # saves land again
        lookups.close()
        loads.close()


def test_a_save_too_large_for_the_stores_tiers_is_counted_and_said(tmp_path, caplog):
    """A sidecar whose RAM tier is smaller than one chunk and with no disk: every save is
    refused as too_large, counted by reason, and logged once (rate-limited) with the
    settings to change; the RAM tier's size, asked at start, says so before any save."""
    src = caches(NUM_BLOCKS, True, seed=5, heads=8, dim=64)  # 192 KiB chunks
    slot = _chunk_bytes(src)
    env = {"KVTIER_TIERS__DISK_BYTES": "0", "KVTIER_SERVER__CHUNK_SLOT_BYTES": str(16 << 10),
           "KVTIER_TIERS__CPU_BYTES": str(64 << 10)}
    proc, url, _ = start_serve(tmp_path / "disk", TOKEN, env)
    try:
        store = open_store({"url": url, "token": TOKEN}, slot)
        assert isinstance(store, RemoteChunkStore)
        problem = ram_tier_problem(store.tier_capacities(), slot)
        assert problem is not None and "KVTIER_TIERS__CPU_BYTES" in problem
        writer = WorkerSide(lambda: store, GRID)
        writer.register(src, NUM_BLOCKS)
        keys = [k.key for k in GRID.keys(list(range(8 * BLOCK)))]
        with caplog.at_level("WARNING", logger="kvtier.connectors.save_refusals"):
            writer.save(_load(keys[:2], [1, 2, 3, 4]))
            writer.save(_load(keys[2:], [5, 6, 7, 8]))
        assert writer.refusals.counts[Refusal.TOO_LARGE] == 4
        assert writer.refusals.counters()["refused_saves_too_large"] == 4
        assert writer.stats.saved_blocks == 0 and store.faults.timeouts == 0
        said = [r.getMessage() for r in caplog.records if "refused (too_large)" in r.getMessage()]
        assert len(said) == 1 and "chunk_slot_bytes" in said[0]  # once a minute, the knob named
        store.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_deadline_options_are_checked():
    """Seconds above 0 and at most 600; anything else is refused at start, by name."""
    assert StoreDeadlines.of({}) == StoreDeadlines()
    assert StoreDeadlines.of({"lookup_timeout_s": "0.25"}).lookup_s == 0.25
    for bad in (0, -1, 601, "soon", float("nan"), [1]):
        with pytest.raises(ConfigError, match="transfer_timeout_s"):
            StoreDeadlines.of({"transfer_timeout_s": bad})
