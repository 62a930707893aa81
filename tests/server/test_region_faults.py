"""Regions cannot take the service down: the server never maps a region, so a client that
shrinks its region file, or a memory filesystem too small for the regions it was asked for,
gets an HTTP error while every other client goes on (docs/reliability.md). The server runs
as its own process here: a fault in it must show as a dead process, not a dead test run."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.serve_process import start_serve
from tests.server.test_server_chunks import chunk, key, served
from tests.tiers.test_disk_tier import mounted

TOKEN = "region-faults-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def serve(tmp_path):
    started = []

    def start(shm_dir):
        proc, url, _ = start_serve(tmp_path / "disk", TOKEN, env={
            "KVTIER_SERVER__SHM_DIR": str(shm_dir), "KVTIER_SERVER__MAX_BODY_BYTES": str(8 << 20)})
        started.append(proc)
        return proc, httpx.Client(base_url=url, headers=AUTH, timeout=30)

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def test_a_client_that_shrinks_its_region_gets_an_error_and_the_server_lives(serve, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    proc, http = serve(shm)
    blob = chunk(key(1), seed=1, layers=8, tokens=512)
    reg = http.post("/v1/regions", json={"bytes": 4 << 20}).json()
    with open(reg["path"], "r+b") as f:
        f.write(blob)
        f.truncate(4096)  # the client shrinks its region below the chunk it names
    r = http.put(f"/v1/chunks/{key(1)}", params={"region": reg["id"], "length": len(blob)})
    assert r.status_code == 400 and "shrunk" in r.json()["error"]["message"]
    assert proc.poll() is None and http.get("/healthz").status_code == 200
    assert http.get(f"/v1/chunks/{key(1)}").status_code == 404  # nothing half-stored
    # A GET into the shrunk region writes the chunk (the file grows back), no fault.
    assert http.put(f"/v1/chunks/{key(1)}", content=blob).status_code == 201
    os.truncate(reg["path"], 0)
    r = http.get(f"/v1/chunks/{key(1)}", params={"region": reg["id"]})
    assert r.status_code == 200 and r.json()["length"] == len(served(blob))
    with open(reg["path"], "rb") as f:
        assert f.read(len(served(blob))) == served(blob)
    assert proc.poll() is None and http.get("/healthz").status_code == 200


def test_a_region_the_filesystem_cannot_hold_is_refused_at_creation(serve, tmp_path):
    with mounted("tmpfs", tmp_path / "small-shm", "size=2m") as shm:
        proc, http = serve(shm)
        r = http.post("/v1/regions", json={"bytes": 6 << 20})
        assert r.status_code == 507, r.text
        assert [p for p in shm.iterdir() if not p.name.endswith(".lock")] == []  # no leftovers
        reg = http.post("/v1/regions", json={"bytes": 1 << 20}).json()  # this one fits
        assert os.stat(reg["path"]).st_blocks * 512 >= 1 << 20  # reserved, not sparse
        blob = chunk(key(2), seed=2, layers=8, tokens=256)
        assert http.put(f"/v1/chunks/{key(2)}", content=blob).status_code == 201
        r = http.get(f"/v1/chunks/{key(2)}", params={"region": reg["id"]})
        assert r.status_code == 200 and proc.poll() is None
        assert http.get("/healthz").status_code == 200


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_server_cleanly(serve, tmp_path, sig):
    """systemd, Docker and Kubernetes stop a service with SIGTERM: it exits 0 within a few
    seconds, its regions removed, and a restart serves every chunk it acknowledged."""
    shm = tmp_path / "shm"
    shm.mkdir()
    proc, http = serve(shm)
    reg = http.post("/v1/regions", json={"bytes": 1 << 20}).json()
    assert os.path.exists(reg["path"])
    blobs = {key(i): chunk(key(i), seed=i, layers=4, tokens=64) for i in range(5)}
    for k, b in blobs.items():
        assert http.put(f"/v1/chunks/{k}", params={"tier": "disk"}, content=b).status_code == 201
    proc.send_signal(sig)
    assert proc.wait(timeout=15) == 0
    assert list(shm.iterdir()) == []
    proc, http = serve(shm)
    for k, b in blobs.items():
        r = http.get(f"/v1/chunks/{k}")
        assert r.status_code == 200 and r.content == served(b)


def test_a_region_read_that_got_no_answer_is_never_lent_again(serve, tmp_path):
    """A paused server may still write a read's chunks into the region after the client
    gave up on it: the client abandons that region (a new one for the next read) and
    deletes it once the server answers again, so no region is written behind a lend."""
    from kvtier.client import Client

    shm = tmp_path / "shm"
    shm.mkdir()
    proc, http = serve(shm)
    url = str(http.base_url).rstrip("/")
    blob = chunk(key(2), seed=2, layers=8, tokens=256)
    with Client(url, token=TOKEN, timeout=2, shm=True) as kv:
        kv.put_chunk(key(2), blob)
        read = kv.get_chunks_in_region([key(2)], 1 << 20)
        assert read is not None and bytes(read.views[0]) == served(blob)
        del read
        (first,) = _regions(shm)
        proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises((OSError, httpx.TransportError)):
                kv.get_chunks_in_region([key(2)], 1 << 20)
        finally:
            proc.send_signal(signal.SIGCONT)
        read = kv.get_chunks_in_region([key(2)], 1 << 20)
        assert read is not None and bytes(read.views[0]) == served(blob)
        del read
        assert first not in _regions(shm)  # deleted once the server answered
        assert len(_regions(shm)) == 1  # the region the read went through instead


def _regions(shm) -> list[str]:
    return [name for name in os.listdir(shm) if not name.endswith(".lock")]
