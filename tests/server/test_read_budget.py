"""Every byte the server reads for a client is charged against the read budget
(server/reply_budget.py, server/budgeted_reads.py), sized from the tiers' indexes before
anything is read: a prefetch reads a key named many times once, a batch GET or a read into
a region that can never fit is refused before any chunk is read, a derive holds its
source and new chunk as a PUT holds its body, GETs whose clients never read hold one
budget and leave the staging pool within its cap, and one tenant cannot take every byte
of the shared-memory regions. A real server on loopback (and one as its own process where
its memory is the point); what is checked is counts and states: the disk tier's read
counters, the staging pool's lent bytes, the budget's held bytes, the process's RSS."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import httpx
import msgpack

from kvtier.server.state import ServiceState
from tests.http_server import running
from tests.serve_process import start_serve
from tests.server.test_chunk_streaming import _raw, _until
from tests.server.test_server_chunks import _config, chunk, key, served

MiB = 1 << 20
LAYERS = 16


def _sized(i: int, mib: float) -> bytes:
    """A chunk of about ``mib`` MiB (KV bytes; its header adds a few hundred)."""
    tokens = int(mib * MiB) // (LAYERS * 2 * 2 * 8 * 2)
    return chunk(key(i), seed=i, layers=LAYERS, tokens=tokens)


def _state(tmp_path, budget: int, cpu_bytes: int, max_body: int, write_timeout_s: float = 1.0,
           **server) -> ServiceState:
    """A sidecar whose stalled replies are cut off after ``write_timeout_s``."""
    cfg = _config(tmp_path, max_body_bytes=max_body, max_inflight_bytes=budget,
                  reply_write_timeout_s=write_timeout_s, **server)
    cfg.tiers.cpu_bytes = cpu_bytes
    cfg.tiers.disk_bytes = 512 * MiB
    return ServiceState.sidecar(cfg)


def _on_disk(http: httpx.Client, blobs: dict[str, bytes]) -> None:
    for k, b in blobs.items():
        r = http.put(f"/v1/chunks/{k}", params={"tier": "disk"}, content=b)
        assert r.status_code == 201, r.text


def _status(sock) -> int:
    return int(sock.recv(4096).split(b" ", 2)[1])


def test_a_prefetch_naming_one_disk_key_96_times_reads_it_once(tmp_path):
    state = _state(tmp_path, budget=64 * MiB, cpu_bytes=32 * MiB, max_body=16 * MiB)
    blob = _sized(1, 8)
    with running(state) as url, httpx.Client(base_url=url, timeout=120) as http:
        _on_disk(http, {key(1): blob})
        disk, staging = state.manager.tiers[1], state.manager.staging
        gets = disk.stats.gets
        r = http.post("/v1/chunks/prefetch", json={"keys": [key(1)] * 96})  # 778 bytes asked
        assert r.status_code == 200 and r.json() == {"promoted": 1}
        assert disk.stats.gets == gets + 1  # one read, not 96
        assert staging.peak_lent_bytes < 2 * len(blob)  # one chunk's buffer at a time
        assert state.replies.held == 0 and staging.lent == 0
        assert http.post("/v1/chunks/lookup", json={"keys": [key(1)]}).json()["tiers"] == ["cpu"]


def test_a_prefetch_holds_the_budget_a_run_at_a_time(tmp_path):
    state = _state(tmp_path, budget=16 * MiB, cpu_bytes=64 * MiB, max_body=16 * MiB)
    blobs = {key(i): _sized(i, 1.5) for i in range(12)}  # 18 MiB: more than the budget
    with running(state) as url, httpx.Client(base_url=url, timeout=120) as http:
        _on_disk(http, blobs)
        staging = state.manager.staging
        r = http.post("/v1/chunks/prefetch", json={"keys": list(blobs)})
        assert r.status_code == 200 and r.json() == {"promoted": 12}
        assert staging.peak_lent_bytes < 16 * MiB  # a run of them at a time, not all 18 MiB
        assert state.replies.held == 0


def test_a_batch_get_whose_reply_can_never_fit_is_413_before_any_chunk_is_read(tmp_path):
    state = _state(tmp_path, budget=16 * MiB, cpu_bytes=4 * MiB, max_body=8 * MiB)
    blobs = {key(i): _sized(i, 4) for i in range(6)}  # 24 MiB of distinct chunks
    with running(state) as url, httpx.Client(base_url=url, timeout=120) as http:
        _on_disk(http, blobs)
        disk = state.manager.tiers[1]
        gets, read = disk.stats.gets, disk.stats.bytes_read
        for _ in range(4):
            r = http.post("/v1/chunks/batch/get", json={"keys": list(blobs)})
            assert r.status_code == 413 and "smaller batches" in r.json()["error"]["message"]
        assert (disk.stats.gets, disk.stats.bytes_read) == (gets, read)  # nothing was read
        assert state.replies.held == 0
        r = http.post("/v1/chunks/batch/get", json={"keys": [key(0), key(1), key(0)]})
        assert r.status_code == 200
        assert msgpack.unpackb(r.content) == [served(blobs[key(i)]) for i in (0, 1, 0)]
        assert disk.stats.gets == gets + 2
        assert _until(lambda: state.replies.held == 0)


def _region(http: httpx.Client, nbytes: int, headers: dict | None = None) -> httpx.Response:
    return http.post("/v1/regions", json={"bytes": nbytes}, headers=headers)


def _shm_state(tmp_path, max_body: int = 8 * MiB, **server) -> ServiceState:
    (tmp_path / "shm").mkdir()
    return _state(tmp_path, budget=16 * MiB, cpu_bytes=4 * MiB, max_body=max_body,
                  shm_dir=str(tmp_path / "shm"), **server)


def test_a_read_into_a_region_too_small_is_413_with_no_lease_taken(tmp_path):
    state = _shm_state(tmp_path)
    blobs = {key(i): _sized(i, 1) for i in range(16)}
    with running(state) as url, httpx.Client(base_url=url, timeout=120) as http:
        _on_disk(http, blobs)
        disk = state.manager.tiers[1]
        gets = disk.stats.gets
        small = _region(http, 4096).json()["id"]
        r = http.post("/v1/chunks/batch/get-into-region", json={"keys": list(blobs),
                                                                 "region": small})
        assert r.status_code == 413
        r = http.get(f"/v1/chunks/{key(0)}", params={"region": small})
        assert r.status_code == 413
        assert disk.stats.gets == gets  # no chunk was leased for either
        assert state.replies.held == 0 and state.manager.staging.lent == 0
        # A region with room for two of them: only those two are leased.
        room = _region(http, 3 * MiB).json()["id"]
        r = http.post("/v1/chunks/batch/get-into-region", json={"keys": list(blobs),
                                                                 "region": room})
        assert r.status_code == 200 and r.json()["stopped"] == "room"
        assert [c["key"] for c in r.json()["chunks"]] == [key(0), key(1)]
        assert disk.stats.gets == gets + 2
        assert state.replies.held == 0


def test_a_derive_holds_its_source_and_new_chunk_against_the_budget(tmp_path):
    state = _state(tmp_path, budget=16 * MiB, cpu_bytes=4 * MiB, max_body=8 * MiB,
                   write_timeout_s=10.0)  # the stalled reply outlives the derive refused
    blobs = {key(1): _sized(1, 6), key(2): _sized(2, 6)}
    with running(state) as url, httpx.Client(base_url=url, timeout=120) as http:
        _on_disk(http, blobs)
        stalled = _raw(url, rcvbuf=4096)  # a reply nobody reads holds 6 MiB of the 16
        stalled.sendall(f"GET /v1/chunks/{key(1)} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert _until(lambda: state.replies.held >= 6 * MiB)
        derive = {"source": key(2), "first_token": 0, "tokens": 16}
        r = http.post(f"/v1/chunks/{key(9)}/derive", json=derive)  # 2 x 6 MiB more: no room
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert http.head(f"/v1/chunks/{key(9)}").status_code == 404
        assert _until(lambda: state.replies.held == 0, timeout=30)  # the stalled reply is cut off
        r = http.post(f"/v1/chunks/{key(9)}/derive", json=derive)
        assert r.status_code == 201
        assert state.replies.held == 0
        stalled.close()


def test_24_concurrent_derives_hold_no_more_than_the_budget(tmp_path):
    budget = 16 * MiB
    state = _state(tmp_path, budget=budget, cpu_bytes=8 * MiB, max_body=8 * MiB)
    source = _sized(1, 4)
    with running(state) as url, httpx.Client(base_url=url, timeout=120) as http:
        _on_disk(http, {key(1): source})
        statuses: Counter[int] = Counter()
        retry_after: set[str | None] = set()
        go = threading.Barrier(24)

        def derive(i: int) -> None:
            with httpx.Client(base_url=url, timeout=120) as own:
                go.wait()
                r = own.post(f"/v1/chunks/{key(100 + i)}/derive",
                             json={"source": key(1), "first_token": i, "tokens": 16})
                statuses[r.status_code] += 1
                if r.status_code == 503:
                    retry_after.add(r.headers.get("retry-after"))

        threads = [threading.Thread(target=derive, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(statuses) <= {201, 503} and statuses[201] >= 1, statuses
        assert retry_after <= {"1"}
        assert state.manager.staging.peak_lent_bytes <= budget  # sources leased at once
        assert state.replies.held == 0


def test_gets_nobody_reads_hold_one_budget_and_the_pool_keeps_its_tied_cap(tmp_path):
    budget = 16 * MiB
    state = _state(tmp_path, budget=budget, cpu_bytes=4 * MiB, max_body=12 * MiB,
                   write_timeout_s=10.0)  # the stalled reply outlives the seven refused
    blob = _sized(1, 10)  # on disk only: the CPU arena cannot take it
    with running(state) as url, httpx.Client(base_url=url, timeout=120) as http:
        _on_disk(http, {key(1): blob})
        staging = state.manager.staging
        request = f"GET /v1/chunks/{key(1)} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        first = _raw(url, rcvbuf=4096)
        first.sendall(request)
        assert _until(lambda: state.replies.held >= 10 * MiB)
        for _ in range(7):  # no room: each is told to retry before the disk lends a buffer
            sock = _raw(url, rcvbuf=4096)
            sock.sendall(request)
            assert _status(sock) == 503
            sock.close()
        assert staging.peak_lent_bytes <= budget
        assert _until(lambda: state.replies.held == 0, timeout=30)  # cut off
        assert _until(lambda: staging.lent == 0)
        assert staging.max_idle_bytes == 2 * budget  # bodies' budget and reads' budget
        assert staging.idle_bytes <= staging.max_idle_bytes
        first.close()
        assert http.get(f"/v1/chunks/{key(1)}").content == served(blob)


def test_a_second_tenant_gets_a_region_while_the_first_has_used_its_default_share(tmp_path):
    state = _shm_state(tmp_path, max_body=MiB, shm_bytes=4 * MiB, tokens=[
        {"token": "alice-token", "tenant": "alice"}, {"token": "bob-token", "tenant": "bob"}])
    alice = {"Authorization": "Bearer alice-token"}
    bob = {"Authorization": "Bearer bob-token"}
    with running(state) as url, httpx.Client(base_url=url, timeout=60) as http:
        made = [_region(http, MiB, alice).status_code for _ in range(4)]
        assert made == [201, 201, 507, 507]  # half of shm_bytes: her default share
        assert _region(http, MiB, bob).status_code == 201
        assert state.regions.held_bytes == 3 * MiB


def test_a_single_tenant_may_still_use_every_region_byte(tmp_path):
    state = _shm_state(tmp_path, max_body=MiB, shm_bytes=4 * MiB)
    with running(state) as url, httpx.Client(base_url=url, timeout=60) as http:
        assert [_region(http, MiB).status_code for _ in range(5)] == [201] * 4 + [507]


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_served_process_prefetching_one_disk_key_96_times_stays_flat(tmp_path):
    env = {"KVTIER_SERVER__MAX_INFLIGHT_BYTES": str(64 * MiB),
           "KVTIER_SERVER__MAX_BODY_BYTES": str(16 * MiB),
           "KVTIER_TIERS__CPU_BYTES": str(64 * MiB), "KVTIER_TIERS__DISK_BYTES": str(512 * MiB),
           "KVTIER_SERVER__SHM_DIR": "none"}
    proc, url, _ = start_serve(tmp_path / "disk", "t0ken", env)
    try:
        with httpx.Client(base_url=url, timeout=120,
                          headers={"Authorization": "Bearer t0ken"}) as http:
            blobs = {key(1): _sized(1, 8), key(2): _sized(2, 8)}
            _on_disk(http, blobs)
            warm = http.post("/v1/chunks/prefetch", json={"keys": [key(1)]})  # buffers, threads
            assert warm.json() == {"promoted": 1}
            before = _rss(proc.pid)
            r = http.post("/v1/chunks/prefetch", json={"keys": [key(2)] * 96})
            grown = _rss(proc.pid) - before
            assert grown < 48 * MiB, f"the server grew by {grown / MiB:.0f} MiB"
            assert r.status_code == 200 and r.json() == {"promoted": 1}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_redis_chunks_are_budgeted_by_their_stored_lengths_before_any_read(tmp_path):
    from tests.redis_servers import RedisServer

    server = RedisServer()
    server.start()
    try:
        cfg = _config(tmp_path, max_body_bytes=2 * MiB, max_inflight_bytes=8 * MiB)
        cfg.tiers.cpu_bytes, cfg.tiers.disk_bytes, cfg.tiers.redis_url = 0, 0, server.url
        state = ServiceState.sidecar(cfg)
        blobs = {key(i): _sized(i, 1) for i in range(6)}  # 6 MiB in all
        (redis_tier,) = state.manager.tiers
        assert redis_tier.stored_sizes(list(blobs)) == [None] * 6  # nothing stored yet
        with running(state) as url, httpx.Client(base_url=url, timeout=60) as http:
            for k, b in blobs.items():
                assert http.put(f"/v1/chunks/{k}", content=b).status_code == 201
            r = http.post("/v1/chunks/batch/get", json={"keys": list(blobs)})
            assert r.status_code == 200
            assert msgpack.unpackb(r.content) == [served(b) for b in blobs.values()]
            assert http.get(f"/v1/chunks/{key(0)}").content == served(blobs[key(0)])
            assert _until(lambda: state.replies.held == 0)
            gets = redis_tier.stats.gets
            many = http.post("/v1/chunks/batch/get", json={"keys": list(blobs) * 2})
            assert many.status_code == 413  # 12 MiB of reply, known from the lengths
            assert redis_tier.stats.gets == gets  # refused before any value was read
            assert state.replies.held == 0
    finally:
        server.cleanup()
