"""Shared-memory regions over real HTTP on loopback: a same-host client moves whole chunks
through a region instead of request bodies, bit-exact through the CPU and disk tiers; what
is verified is what is stored, whatever the client writes into its region afterwards; a
region is its tenant's alone, bounded, and gone when deleted or when the server stops."""

from __future__ import annotations

import os
import threading

import httpx
import pytest

from kvtier.chunk_format import namespaced_key
from kvtier.client import Client, ServiceError
from kvtier.config import TokenConfig
from kvtier.connectors.tiers.blobs import get_blobs, put_blobs
from kvtier.errors import InvalidArgumentError
from kvtier.server.state import ServiceState
from tests.http_server import running
from tests.serve_process import free_port
from tests.server.test_server_chunks import _config, chunk, key, served


def _state(tmp_path, **server) -> ServiceState:
    """A sidecar whose regions live in a directory of the test's own (any filesystem maps)."""
    cfg = _config(tmp_path, max_body_bytes=4 << 20, chunk_slot_bytes=1 << 20,
                  shm_dir=str(tmp_path / "shm"), **server)
    (tmp_path / "shm").mkdir()
    cfg.tiers.cpu_bytes = 4 << 20
    return ServiceState.sidecar(cfg)


def _regions(tmp_path) -> list[str]:
    """The region files in the test's shm directory (a server's lock file is not one)."""
    return sorted(p.name for p in (tmp_path / "shm").iterdir() if not p.name.endswith(".lock"))


def test_chunks_round_trip_through_a_region_in_cpu_and_disk_tiers(tmp_path):
    state = _state(tmp_path)
    blobs = {key(i): chunk(key(i), seed=i, layers=8, tokens=64 if i % 2 else 1024) for i in range(6)}
    with running(state) as url, Client(url, shm=True) as kv:
        for k, b in blobs.items():
            assert kv.put_chunk(k, b)["status"] == "stored"
        assert kv.put_chunk(key(5), blobs[key(5)])["status"] == "present"
        out = bytearray(2 << 20)
        for k, b in blobs.items():
            assert bytes(kv.get_chunk_into(k, out)) == served(b)
            assert kv.get_chunk(k) == served(b)  # the same chunks over HTTP bodies
        assert kv.shm and len(_regions(tmp_path)) == 1
        regions = kv.stats()["regions"]  # what crossed the region, not the bodies
        assert regions["enabled"] and regions["held"] == 1
        assert regions["transfers"] == {"put": 7, "get": 6}
        assert regions["transfer_bytes"]["get"] == sum(len(served(b)) for b in blobs.values())
        metrics = httpx.get(f"{url}/metrics").text
        assert 'kvtier_shm_region_transfers_total{op="put"} 7.0' in metrics
        tiers = {r["name"]: r for r in kv.stats()["tiers"]}
        assert tiers["disk"]["chunks"] >= 1 and tiers["cpu"]["chunks"] >= 1  # both were used
        assert kv.get_chunk_into(key(99), out) is None
        with pytest.raises(InvalidArgumentError):
            kv.get_chunk_into(key(2), bytearray(100))  # does not fit the caller's buffer
    assert _regions(tmp_path) == []  # the client deleted its region when it closed


def test_bytes_changed_in_the_region_after_the_put_do_not_change_what_was_stored(tmp_path):
    state = _state(tmp_path)
    blob = chunk(key(1), seed=1, layers=8, tokens=256)
    with running(state) as url, httpx.Client(base_url=url) as http:
        reg = http.post("/v1/regions", json={"bytes": 1 << 20}).json()
        fd = os.open(reg["path"], os.O_RDWR)
        mem = memoryview(__import__("mmap").mmap(fd, reg["bytes"]))
        os.close(fd)
        mem[: len(blob)] = blob
        stop = threading.Event()

        def scribble() -> None:  # another thread keeps flipping the region's bytes
            i = 0
            while not stop.is_set():
                mem[100 + i % 1000] ^= 0xFF
                i += 1

        t = threading.Thread(target=scribble)
        t.start()
        try:
            codes = [http.put(f"/v1/chunks/{key(i)}", params={"region": reg["id"], "length": len(blob)}
                              ).status_code for i in range(1, 30)]
        finally:
            stop.set()
            t.join()
        # the header names key(1): every other key is refused; key(1) is stored or refused
        assert set(codes[1:]) == {400} and codes[0] in (201, 400)
        got = get_blobs(state.manager, [namespaced_key("default", key(1))])[0]
        assert got is None or bytes(got) == blob  # never a scribbled chunk
        mem.release()


def test_a_region_is_its_tenants_alone(tmp_path):
    tokens = [TokenConfig(token="token-alice", tenant="alice", scopes=["read", "write"]),
              TokenConfig(token="token-bob1", tenant="bob", scopes=["read", "write"]),
              TokenConfig(token="token-reader", tenant="alice", scopes=["read"])]
    state = _state(tmp_path, tokens=tokens)
    blob = chunk(key(1))
    with running(state) as url, Client(url, token="token-alice", shm=True) as alice:
        alice.put_chunk(key(1), blob)
        rid = alice._local.link.id  # noqa: SLF001 - alice's region
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer token-bob1"}) as bob:
            r = bob.get(f"/v1/chunks/{key(1)}", params={"region": rid})
            assert r.status_code == 404 and r.json()["error"]["type"] == "no_such_region"
            assert bob.put(f"/v1/chunks/{key(1)}", params={"region": rid, "length": len(blob)}
                           ).status_code == 404
            assert bob.delete(f"/v1/regions/{rid}").status_code == 404
        with Client(url, token="token-reader", shm=True) as reader:  # read scope: regions and GETs
            assert bytes(reader.get_chunk_into(key(1), bytearray(1 << 16))) == served(blob, "alice")
            with pytest.raises(ServiceError) as err:
                reader.put_chunk(key(2), chunk(key(2)))
            assert err.value.status == 403


def test_region_requests_are_checked(tmp_path):
    state = _state(tmp_path, shm_bytes=3 << 20, shm_regions_per_tenant=2)
    blob = chunk(key(1))
    with running(state) as url, httpx.Client(base_url=url) as http:
        assert http.post("/v1/regions", json={"bytes": 8 << 20}).status_code == 413  # > max body
        a = http.post("/v1/regions", json={"bytes": 2 << 20}).json()
        assert http.post("/v1/regions", json={"bytes": 2 << 20}).status_code == 507  # > shm_bytes
        b = http.post("/v1/regions", json={"bytes": 4096}).json()
        assert http.post("/v1/regions", json={"bytes": 4096}).status_code == 429  # per tenant
        assert http.post("/v1/regions", json={"bytes": 0}).status_code == 422
        rid = a["id"]
        put = f"/v1/chunks/{key(1)}"
        assert http.put(put, params={"region": rid}).status_code == 400  # no length
        assert http.put(put, params={"region": rid, "length": len(blob), "offset": (2 << 20) - 10}
                        ).status_code == 400  # past the region's end
        assert http.put(put, params={"region": rid, "length": 64}).status_code == 400  # zeros
        assert http.put(put, params={"region": rid, "length": 64}, content=b"x" * 64).status_code == 400
        assert http.put(put, params={"region": "0" * 32, "length": 64}).status_code == 404
        assert state.manager.lookup([namespaced_key("default", key(1))]).length == 0  # nothing stored
        assert http.put(put, content=blob).status_code == 201
        small = http.get(put, params={"region": b["id"]})
        assert small.status_code == 413  # 4 KiB region: the chunk does not fit, nothing written
        assert http.get(put, params={"region": rid, "layers": "0:1"}).status_code == 400
        assert http.delete(f"/v1/regions/{rid}").status_code == 204
        assert http.get(put, params={"region": rid}).status_code == 404
        assert len(_regions(tmp_path)) == 1
    assert _regions(tmp_path) == []  # the server removed the rest when it stopped


def test_a_client_falls_back_to_bodies_where_no_region_can_be_used(tmp_path):
    state = _state(tmp_path, shm_bytes=0)  # regions off
    blob = chunk(key(1))
    with running(state) as url, Client(url, shm=True) as kv:
        assert kv.put_chunk(key(1), blob)["status"] == "stored"
        assert not kv.shm  # turned off after the server said no
        assert bytes(kv.get_chunk_into(key(1), bytearray(1 << 16))) == served(blob)
        regions = kv.stats()["regions"]
        assert not regions["enabled"] and regions["transfers"] == {"put": 0, "get": 0}


def test_a_missing_shm_dir_is_said_at_start_and_offers_no_region(tmp_path, caplog):
    """A directory that is not there turns regions off (same-host clients use bodies, at
    several times the CPU a chunk): the operator is told at start, not left to find out."""
    cfg = _config(tmp_path, shm_dir=str(tmp_path / "nowhere"))
    with caplog.at_level("WARNING", logger="kvtier.server.shm_regions"):
        state = ServiceState.sidecar(cfg)
    try:
        assert not state.regions.enabled
        assert any("nowhere" in r.getMessage() and "no shared-memory regions" in r.getMessage()
                   for r in caplog.records)
    finally:
        state.close()


def test_regions_left_by_a_dead_server_are_removed_at_start(tmp_path):
    (tmp_path / "shm").mkdir()
    dead = tmp_path / "shm" / ("kvtier-region-999999999-" + "a" * 32)
    dead.write_bytes(b"x")
    other = tmp_path / "shm" / "something-else"
    other.write_bytes(b"y")
    cfg = _config(tmp_path, shm_dir=str(tmp_path / "shm"))
    state = ServiceState.sidecar(cfg)
    try:
        assert state.regions.removed_stale == 1 and not dead.exists() and other.exists()
    finally:
        state.close()


def test_a_corrupt_copy_is_never_written_to_a_region_and_the_disk_copy_is(tmp_path):
    state = _state(tmp_path)
    blob = chunk(key(1), seed=1, layers=8, tokens=512)
    where = namespaced_key("default", key(1))
    with running(state) as url, Client(url, shm=True) as kv:
        kv.put_chunk(key(1), blob, tier="disk")
        cpu = state.manager.tiers[0]
        stored = served(blob)
        assert put_blobs(cpu, {where: stored}).stored == [where]
        slot, _ = cpu._index.get(where, touch=False)  # noqa: SLF001
        cpu._arena[slot * cpu.slot_bytes + len(stored) - 100] ^= 0xFF  # noqa: SLF001 - a flipped bit at rest
        out = bytearray(1 << 20)
        assert bytes(kv.get_chunk_into(key(1), out)) == stored  # from disk
        assert state.manager.stats.rejected.get("corrupt") == 1
        state.manager.tiers[1].delete([where])  # now the only copy is the CPU tier's
        slot, _ = cpu._index.get(where, touch=False)  # noqa: SLF001 - promoted there again
        cpu._arena[slot * cpu.slot_bytes + 300] ^= 0xFF  # noqa: SLF001
        assert kv.get_chunk_into(key(1), out) is None  # a miss, never the corrupt bytes
        assert state.manager.lookup([where]).length == 0


def test_a_client_makes_a_new_region_when_the_server_restarted(tmp_path):
    port = free_port()
    blob = chunk(key(1))
    with Client(f"http://127.0.0.1:{port}", shm=True) as kv:
        with running(_state(tmp_path), port=port):
            kv.put_chunk(key(1), blob)
            first = kv._local.link.id  # noqa: SLF001
        (tmp_path / "shm").rmdir()  # the first server removed its regions when it stopped
        with running(_state(tmp_path), port=port) as url:
            assert kv.put_chunk(key(2), chunk(key(2)))["status"] == "stored"
            assert kv._local.link.id != first and kv.shm  # noqa: SLF001
            assert bytes(kv.get_chunk_into(key(2), bytearray(1 << 16))) == served(chunk(key(2)))
            assert url.endswith(str(port))
        (tmp_path / "shm").rmdir()
        with running(_state(tmp_path), port=port):  # again, for the in-place calls
            blob = chunk(key(3))

            def fill(room: memoryview) -> int:
                room[: len(blob)] = blob
                return len(blob)

            assert kv.put_chunk_filled(key(3), fill, len(blob))["status"] == "stored"
            link = kv._local.link  # noqa: SLF001 - a region this server does not know,
            link.id = unknown = link.id[:-1] + ("0" if link.id[-1] != "0" else "1")
            read = kv.get_chunks_in_region([key(3), key(4)], 1 << 16)
            assert [bytes(v) for v in read.views] == [served(blob)] and read.ended and kv.shm
            assert link.id not in (None, unknown)  # a new region, made once


def test_regions_of_any_dead_server_are_removed_at_start_whatever_its_pid(tmp_path):
    """A server's regions are named by its lock file, which it holds locked while it runs:
    a lock nobody holds means its server died (even where its pid now names a live
    process), a lock held means it runs."""
    import fcntl

    shm = tmp_path / "shm"
    shm.mkdir()
    dead_lock = shm / "kvtier-region-00000000000000aa.lock"
    dead_lock.write_bytes(b"")
    dead = shm / ("kvtier-region-00000000000000aa-" + "b" * 32)
    orphan = shm / ("kvtier-region-00000000000000cc-" + "c" * 32)  # its lock file is gone
    pid_named = shm / (f"kvtier-region-{os.getpid()}-" + "d" * 32)  # an old name, live pid
    live_lock = shm / "kvtier-region-00000000000000bb.lock"
    live = shm / ("kvtier-region-00000000000000bb-" + "e" * 32)
    for p in (dead, orphan, pid_named, live):
        p.write_bytes(b"x")
    holder = os.open(live_lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another server, still running
    try:
        state = ServiceState.sidecar(_config(tmp_path, shm_dir=str(shm)))
        try:
            assert not dead.exists() and not dead_lock.exists() and not orphan.exists()
            assert live.exists() and live_lock.exists() and pid_named.exists()
            assert state.regions.removed_stale == 2
        finally:
            state.close()
        assert not (shm / f"kvtier-region-{state.regions.server_id}.lock").exists()
    finally:
        os.close(holder)


def test_an_abandoned_region_is_reclaimed_when_its_lease_ends(tmp_path):
    """A client that dies without deleting its regions holds their memory only for
    server.shm_lease_s: then another tenant's request for a region succeeds, and the dead
    client's region is gone. Use (or a renewal) keeps a region alive."""
    import time

    tokens = [TokenConfig(token="token-alice", tenant="alice", scopes=["read", "write"]),
              TokenConfig(token="token-bob1", tenant="bob", scopes=["read", "write"])]
    state = _state(tmp_path, tokens=tokens, shm_bytes=3 << 20, shm_lease_s=1.0)
    blob = chunk(key(1))
    alice = httpx.Client(headers={"Authorization": "Bearer token-alice"})
    bob = httpx.Client(headers={"Authorization": "Bearer token-bob1"})
    with running(state) as url:
        kept = alice.post(f"{url}/v1/regions", json={"bytes": 1 << 20}).json()
        lost = [alice.post(f"{url}/v1/regions", json={"bytes": 1 << 20}).json() for _ in range(2)]
        assert 0 < kept["expires_in_s"] <= 1.0
        r = bob.post(f"{url}/v1/regions", json={"bytes": 1 << 20})
        assert r.status_code == 507  # all of shm_bytes is alice's
        assert [x["id"] for x in bob.get(f"{url}/v1/regions").json()] == []
        assert sorted(x["id"] for x in alice.get(f"{url}/v1/regions").json()) == sorted(
            x["id"] for x in [kept, *lost])
        for _ in range(3):  # alice keeps using one region; the other two she abandoned
            time.sleep(0.45)
            with open(kept["path"], "r+b") as f:
                f.write(blob)
            assert alice.put(f"{url}/v1/chunks/{key(1)}",
                             params={"region": kept["id"], "length": len(blob)}).status_code in (200, 201)
        assert alice.post(f"{url}/v1/regions/{kept['id']}/renew").status_code == 200
        r = bob.post(f"{url}/v1/regions", json={"bytes": 1 << 20})
        assert r.status_code == 201, r.text
        assert [x["id"] for x in alice.get(f"{url}/v1/regions").json()] == [kept["id"]]
        assert not any(os.path.exists(x["path"]) for x in lost)
        r = alice.put(f"{url}/v1/chunks/{key(1)}", params={"region": lost[0]["id"], "length": len(blob)})
        assert r.status_code == 404
        assert state.regions.reclaimed == 2
    alice.close()
    bob.close()


def test_a_tenants_regions_are_bounded_in_bytes(tmp_path):
    state = _state(tmp_path, shm_bytes=8 << 20, shm_bytes_per_tenant=2 << 20)
    with running(state) as url, httpx.Client(base_url=url) as http:
        assert http.post("/v1/regions", json={"bytes": 2 << 20}).status_code == 201
        r = http.post("/v1/regions", json={"bytes": 1})
        assert r.status_code == 507 and "shm_bytes_per_tenant" in r.json()["error"]["message"]
