"""Reads first on the disk tier (``kvtier.io_priority``): a background
write (a demotion, a store ahead of need, a vLLM save) waits while a read a request waits
for is in flight; a write someone waits for never does; a background read does not hold
anyone; a stream of reads holds a write at most ``max_hold_s``. The policy simulator's
drive (``Link.reads_first``) assumes exactly this."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.connectors.tiers.blobs import put_blobs
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.io_priority import (
    IOPriority,
    ReadsFirst,
    background_io,
    current_priority,
)
from kvtier.make_model.writer import make_model
from tests.engine.test_engine_tiers import GREEDY, SYSTEM, _engine
from tests.tiers.test_disk_background_reads import _Held
from tests.tiers.test_disk_lease import FP, _in_place, _key


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
        assert tier.reads_first.reads_in_flight == 1  # its later layers are still queued
        thread, done, out = _store_in_thread(tier, _key(2), _in_place(2), background=True)
        assert not done.wait(0.3)  # held off while the read is in flight
        assert tier.contains_prefix([_key(2)]) == 0
        held.go.set()  # the read lands: the write goes
        thread.join(10)
    assert done.is_set() and out["res"].stored == [_key(2)]
    assert tier.reads_first.reads_in_flight == 0
    assert tier.stats.writes_held == 1 and tier.stats.write_held_s > 0


def test_a_write_someone_waits_for_goes_at_once(tier) -> None:
    put_blobs(tier, {_key(1): _in_place(1)})
    with _Held(tier) as held, tier.lease([_key(1)], background=True):
        thread, done, out = _store_in_thread(tier, _key(3), _in_place(3), background=False)
        assert done.wait(10)  # a write-back on a turn's admission path: never held
        held.go.set()
        thread.join(10)
    assert out["res"].stored == [_key(3)] and tier.stats.writes_held == 0


def test_reads_in_flight_end_with_the_reads(tier) -> None:
    keys = [_key(i) for i in range(3)]
    put_blobs(tier, {k: _in_place(i) for i, k in enumerate(keys)})
    with tier.lease(keys):
        assert tier.reads_first.reads_in_flight == 0  # read whole before they are lent
    with tier.lease(keys, background=True) as parts:
        for p in parts:
            p.done.result(10)
    deadline = time.monotonic() + 10
    while tier.reads_first.reads_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)  # the count drops in the last read's completion callback
    assert tier.reads_first.reads_in_flight == 0
    with background_io(), tier.lease(keys):
        pass  # a prefetch's read is background: it holds nobody
    assert tier.reads_first.reads_in_flight == 0


def test_a_stream_of_reads_holds_a_write_at_most_max_hold() -> None:
    gate = ReadsFirst(max_hold_s=0.2)
    assert gate.start_read()
    try:
        assert gate.before_write() is None  # not background: no wait
        with background_io():
            assert current_priority() is IOPriority.BACKGROUND
            assert not gate.start_read()  # background reads are not counted
            start = time.monotonic()
            waited = gate.before_write()
            assert waited is not None and waited > 0.15 and time.monotonic() - start < 5
    finally:
        gate.end_read(True)
    assert current_priority() is IOPriority.WAITED
    with background_io():
        assert gate.before_write() is None  # nothing in flight: no wait


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
        assert disk.reads_first.start_read()  # a restore's read in flight
        try:
            stored = eng.transfers.completed
            pending = eng.offload("a", "disk", wait=False)
            time.sleep(0.3)
            assert eng.transfers.completed == stored  # held off on the drive
            now = eng.offload("b", "disk")  # on the caller's path: never held
            assert now.stored_tokens > 0 and not now.failed
        finally:
            disk.reads_first.end_read(True)
        eng.transfers.drain()
        eng.drain()
        res = pending.result(30)
        assert res.stored_tokens > 0 and not res.failed
        assert disk.stats.writes_held >= 1
    finally:
        eng.close()


def test_a_sidecar_client_storing_in_the_background_is_served_reads_first(tmp_path) -> None:
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
        assert disk.reads_first.start_read()  # a restore's read in flight
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
            disk.reads_first.end_read(True)
        thread.join(10)
        assert done.is_set() and kv.has_chunk(key(2))
        assert disk.stats.writes_held == 1
