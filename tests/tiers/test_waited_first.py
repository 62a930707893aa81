"""Transfers someone waits for go first (``kvtier.io_priority``): on the disk tier a
background write batch (a demotion, a store ahead of need, a vLLM save) waits while a read
or write a request waits for is in flight; on the Redis tier while a waited-for write is
(reads go the other way); a transfer someone waits for never waits; a background read
holds nobody; a stream of reads holds a write at most ``max_hold_s``. The policy
simulator's links (``Link.waited_first``) assume exactly this."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtier.connectors.tiers.base import ChunkWrite
from kvtier.connectors.tiers.blobs import put_blobs
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.io_priority import (
    IOPriority,
    WaitedFirst,
    background_io,
    current_priority,
)
from kvtier.make_model.writer import make_model
from tests import redis_servers
from tests.engine.test_engine_tiers import GREEDY, SYSTEM, _engine
from tests.tiers.test_disk_background_reads import _Held
from tests.tiers.test_disk_lease import FP, _in_place, _key

redis_server = redis_servers.redis_server  # the shared fixture, used by name


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("m") / "tiny", seed=7).path


@pytest.fixture
def tier(tmp_path):
    # one worker: a held worker keeps a background lease's later layers in flight
    t = DiskTier(tmp_path / "d", max_workers=1, head_bytes=64 << 10)
    m = TierManager([t], fingerprint=FP, staging=t.staging)
    yield t
    m.close()


def _store_in_thread(tier: DiskTier, key: str, blob: bytes, background: bool):
    done = threading.Event()
    out: dict = {}

    def run() -> None:
        if background:
            with background_io():
                out["res"] = put_blobs(tier, {key: blob})
        else:
            out["res"] = put_blobs(tier, {key: blob})
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, done, out


def test_a_background_write_waits_for_a_restore_read_in_flight(tier) -> None:
    put_blobs(tier, {_key(1): _in_place(1)})
    with _Held(tier) as held, tier.lease([_key(1)], background=True):
        assert tier.waited_first.in_flight == 1  # its later layers are still queued
        thread, done, out = _store_in_thread(tier, _key(2), _in_place(2), background=True)
        assert not done.wait(0.3)  # held off while the read is in flight
        assert tier.contains_prefix([_key(2)]) == 0
        held.go.set()  # the read lands: the write goes
        thread.join(10)
    assert done.is_set() and out["res"].stored == [_key(2)]
    assert tier.waited_first.in_flight == 0
    assert tier.stats.writes_held == 1 and tier.stats.write_held_s > 0


def test_a_write_someone_waits_for_goes_at_once(tier) -> None:
    put_blobs(tier, {_key(1): _in_place(1)})
    with _Held(tier) as held, tier.lease([_key(1)], background=True):
        thread, done, out = _store_in_thread(tier, _key(3), _in_place(3), background=False)
        assert done.wait(10)  # a write-back on a turn's admission path: never held
        held.go.set()
        thread.join(10)
    assert out["res"].stored == [_key(3)] and tier.stats.writes_held == 0


def test_in_flight_end_with_the_reads(tier) -> None:
    keys = [_key(i) for i in range(3)]
    put_blobs(tier, {k: _in_place(i) for i, k in enumerate(keys)})
    with tier.lease(keys):
        assert tier.waited_first.in_flight == 0  # read whole before they are lent
    with tier.lease(keys, background=True) as parts:
        for p in parts:
            p.done.result(10)
    deadline = time.monotonic() + 10
    while tier.waited_first.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)  # the count drops in the last read's completion callback
    assert tier.waited_first.in_flight == 0
    with background_io(), tier.lease(keys):
        pass  # a prefetch's read is background: it holds nobody
    assert tier.waited_first.in_flight == 0


def test_a_stream_of_reads_holds_a_write_at_most_max_hold() -> None:
    gate = WaitedFirst(max_hold_s=0.2)
    assert gate.begin()
    try:
        assert gate.before_background_write() is None  # not background: no wait
        with background_io():
            assert current_priority() is IOPriority.BACKGROUND
            assert not gate.begin()  # background reads are not counted
            start = time.monotonic()
            waited = gate.before_background_write()
            assert waited is not None and waited > 0.15 and time.monotonic() - start < 5
    finally:
        gate.end(True)
    assert current_priority() is IOPriority.WAITED
    with background_io():
        assert gate.before_background_write() is None  # nothing in flight: no wait


def test_background_threads_store_as_background() -> None:
    """The CPU tier's reserve hands chunks down as background writes, and so do vLLM's
    background saves; a save vLLM waits for (no background thread) is waited for."""
    from kvtier.connectors.tiers.slot_reserve import SlotReserve
    from kvtier.connectors.vllm_saves import SaveQueue

    seen: list[IOPriority] = []
    reserve = SlotReserve(lambda: bool(seen.append(current_priority())) and False)
    try:
        reserve.wake()
        assert reserve.wait_idle(10)
    finally:
        reserve.close()
    for background in (True, False):
        saves = SaveQueue(background=background)
        saves.submit(["r"], lambda: seen.append(current_priority()))
        saves.drain()
        saves.close()
    assert seen == [IOPriority.BACKGROUND, IOPriority.BACKGROUND, IOPriority.WAITED]
    assert current_priority() is IOPriority.WAITED


def test_the_engines_background_offload_yields_to_a_read_in_flight(model_dir, tmp_path) -> None:
    """An offload stored in the background (``wait=False``) waits on the drive while a
    restore's read is in flight; one the caller waits for goes at once."""
    eng = _engine(model_dir, tmp_path, {"cpu_bytes": 0, "disk_bytes": 256 << 20})
    try:
        for sid in ("a", "b"):
            eng.chat(sid, f"first turn of session {sid}", GREEDY, system=SYSTEM)
        disk = eng.kv.manager.tiers[0]
        assert isinstance(disk, DiskTier)
        assert disk.waited_first.begin()  # a restore's read in flight
        try:
            stored = eng.transfers.completed
            pending = eng.offload("a", "disk", wait=False)
            time.sleep(0.3)
            assert eng.transfers.completed == stored  # held off on the drive
            now = eng.offload("b", "disk")  # on the caller's path: never held
            assert now.stored_tokens > 0 and not now.failed
        finally:
            disk.waited_first.end(True)
        eng.transfers.drain()
        eng.drain()
        res = pending.result(30)
        assert res.stored_tokens > 0 and not res.failed
        assert disk.stats.writes_held >= 1
    finally:
        eng.close()


def test_a_sidecar_client_storing_in_the_background_is_served_waited_first(tmp_path) -> None:
    """Over real HTTP: a client that stores in the background (a vLLM save on its saver
    thread) says so, and the service's drive holds that store while a read is in flight;
    a plain store (someone waits for it) goes at once."""
    from kvtier.client import Client
    from kvtier.server.state import ServiceState
    from tests.http_server import running
    from tests.server.test_server_chunks import _config, chunk, key

    state = ServiceState.sidecar(_config(tmp_path, max_body_bytes=1 << 20))
    with running(state) as url, Client(url) as kv:
        disk = state.manager.tiers[state.manager.tier_index("disk")]
        assert isinstance(disk, DiskTier)
        assert disk.waited_first.begin()  # a restore's read in flight
        try:
            assert kv.put_chunk(key(1), chunk(key(1)), tier="disk")["status"] == "stored"
            done = threading.Event()

            def save() -> None:
                with background_io():
                    kv2 = Client(url)
                    try:
                        kv2.put_chunk(key(2), chunk(key(2), seed=2), tier="disk")
                    finally:
                        kv2.close()
                done.set()

            thread = threading.Thread(target=save)
            thread.start()
            assert not done.wait(0.3)  # held off behind the read
            assert disk.stats.puts == 1
        finally:
            disk.waited_first.end(True)
        thread.join(10)
        assert done.is_set() and kv.has_chunk(key(2))
        assert disk.stats.writes_held == 1


def _observing_write(key: str, blob: bytes, gate: WaitedFirst, seen: list[int]) -> ChunkWrite:
    """A write whose fill notes how many waited-for transfers the gate sees meanwhile."""

    def fill(dest: torch.Tensor) -> int:
        seen.append(gate.in_flight)
        dest[: len(blob)].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        return len(blob)

    return ChunkWrite(key, len(blob), fill=fill)


def test_a_write_someone_waits_for_holds_background_ones_off_while_it_runs(tier) -> None:
    seen: list[int] = []
    assert tier.store_in_place([_observing_write(_key(5), _in_place(5), tier.waited_first, seen)]).stored
    with background_io():
        assert tier.store_in_place([_observing_write(_key(6), _in_place(6), tier.waited_first, seen)]).stored
    assert seen == [1, 0]  # the waited-for write counted while it ran; the background one not
    assert tier.waited_first.in_flight == 0


def test_the_redis_tier_holds_background_writes_for_waited_for_writes(redis_server) -> None:
    """Writes go one way on the link, reads the other: a background batch waits for a
    waited-for write in flight, not for a read."""
    from kvtier.connectors.tiers.redis_tier import RedisTier
    from tests.tiers.test_redis_tier import chunk as redis_chunk
    from tests.tiers.test_redis_tier import key as redis_key

    r = RedisTier(redis_server.url, timeout_s=5)
    try:
        seen: list[int] = []
        blob = redis_chunk(1)
        assert r.store_in_place([_observing_write(redis_key(1), blob, r.waited_first, seen)]).stored
        assert seen == [1]
        with r.lease([redis_key(1)]), background_io():  # a read in flight holds no write
            assert put_blobs(r, {redis_key(2): redis_chunk(2)}).stored
        assert r.stats.writes_held == 0
        assert r.waited_first.begin()  # a waited-for write in flight
        try:
            thread, done, out = _store_in_thread(r, redis_key(3), redis_chunk(3), background=True)
            assert not done.wait(0.3)
        finally:
            r.waited_first.end(True)
        thread.join(10)
        assert done.is_set() and out["res"].stored == [redis_key(3)]
        assert r.stats.writes_held == 1
    finally:
        r.close()
