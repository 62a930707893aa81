"""One version per key (server/chunk_versions.py): a PUT of a key stored in any tier is the
same chunk (200 present, nothing written) or a 409, never a second version, whether the
first one is still in RAM, was pushed to disk, or survived a restart; DELETE then PUT
replaces it everywhere. Real HTTP on loopback, real tiers."""

from __future__ import annotations

import threading

import httpx

from kvtier.client import Client
from kvtier.server.state import ServiceState
from tests.http_server import running
from tests.server.test_server_chunks import _config, chunk, key, served


def _state(tmp_path) -> ServiceState:
    return ServiceState.sidecar(_config(tmp_path))  # 1 MiB of RAM in 64 KiB slots, then disk


def _push_out_of_ram(http: httpx.Client, first: int = 100) -> None:
    for i in range(first, first + 40):  # 40 other chunks: the CPU tier holds 16
        assert http.put(f"/v1/chunks/{key(i)}", content=chunk(key(i), seed=i)).status_code == 201


def _tier_of(http: httpx.Client, k: str) -> str:
    r = http.get(f"/v1/chunks/{k}")
    assert r.status_code == 200
    return r.headers["X-KVTier-Tier"]


def test_an_overwrite_is_refused_while_the_first_version_is_in_ram_and_after_it_left(tmp_path):
    v1, v2 = chunk(key(1), seed=1), chunk(key(1), seed=2)
    with running(_state(tmp_path)) as url, httpx.Client(base_url=url) as http:
        assert http.put(f"/v1/chunks/{key(1)}", content=v1).status_code == 201
        r = http.put(f"/v1/chunks/{key(1)}", content=v2)
        assert r.status_code == 409 and r.json()["error"]["type"] == "chunk_exists"
        assert http.put(f"/v1/chunks/{key(1)}", content=v1).json()["status"] == "present"
        _push_out_of_ram(http)
        r = http.put(f"/v1/chunks/{key(1)}", content=v2)  # v1 is on disk only now
        assert r.status_code == 409
        _push_out_of_ram(http, first=200)
        assert _tier_of(http, key(1)) == "disk"
        assert http.get(f"/v1/chunks/{key(1)}").content == served(v1)


def test_an_overwrite_is_refused_after_a_restart(tmp_path):
    v1, v2 = chunk(key(2), seed=1), chunk(key(2), seed=2)
    with running(_state(tmp_path)) as url, httpx.Client(base_url=url) as http:
        assert http.put(f"/v1/chunks/{key(2)}", params={"tier": "disk"}, content=v1).status_code == 201
    with running(_state(tmp_path)) as url, httpx.Client(base_url=url) as http:
        assert _tier_of(http, key(2)) == "disk"
        assert http.put(f"/v1/chunks/{key(2)}", content=v2).status_code == 409
        assert http.put(f"/v1/chunks/{key(2)}", content=v1).status_code == 200
        assert http.get(f"/v1/chunks/{key(2)}").content == served(v1)


def test_delete_then_put_replaces_the_chunk_in_every_tier(tmp_path):
    v1, v2 = chunk(key(3), seed=1), chunk(key(3), seed=2)
    with running(_state(tmp_path)) as url, httpx.Client(base_url=url) as http:
        assert http.put(f"/v1/chunks/{key(3)}", params={"tier": "disk"}, content=v1).status_code == 201
        assert http.put(f"/v1/chunks/{key(3)}", content=v1).status_code == 200  # RAM copy too
        assert http.delete(f"/v1/chunks/{key(3)}").status_code in (200, 204)
        assert http.put(f"/v1/chunks/{key(3)}", content=v2).status_code == 201
        _push_out_of_ram(http)
        assert http.get(f"/v1/chunks/{key(3)}").content == served(v2)


def test_a_batch_reports_conflicts_per_chunk_and_stores_the_rest(tmp_path):
    with running(_state(tmp_path)) as url, Client(url) as kv:
        kv.put_chunk(key(4), chunk(key(4), seed=1))
        out = kv.put_chunks({key(4): chunk(key(4), seed=2), key(5): chunk(key(5), seed=5),
                             key(6): chunk(key(6), seed=6)})
        assert sorted(out["stored"]) == [key(5), key(6)]
        assert list(out["failed"]) == [key(4)] and "conflict" in out["failed"][key(4)]
        out = kv.put_chunks({key(5): chunk(key(5), seed=5)})
        assert out["present"] == [key(5)] and not out["failed"]
        assert kv.get_chunk(key(4)) == served(chunk(key(4), seed=1))


def test_a_region_put_of_another_version_is_refused(tmp_path):
    cfg = _config(tmp_path, shm_dir=str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    v1, v2 = chunk(key(7), seed=1), chunk(key(7), seed=2)
    with running(ServiceState.sidecar(cfg)) as url, httpx.Client(base_url=url) as http:
        assert http.put(f"/v1/chunks/{key(7)}", content=v1).status_code == 201
        reg = http.post("/v1/regions", json={"bytes": 1 << 16}).json()
        with open(reg["path"], "r+b") as f:
            f.write(v2)
        params = {"region": reg["id"], "length": len(v2)}
        assert http.put(f"/v1/chunks/{key(7)}", params=params).status_code == 409
        with open(reg["path"], "r+b") as f:
            f.write(v1)
        assert http.put(f"/v1/chunks/{key(7)}", params=params).status_code == 200
        assert http.get(f"/v1/chunks/{key(7)}").content == served(v1)


def test_concurrent_puts_of_two_versions_leave_exactly_one(tmp_path):
    versions = [chunk(key(8), seed=s) for s in (1, 2)]
    with running(_state(tmp_path)) as url:
        codes: list[int] = []

        def put(blob: bytes) -> None:
            with httpx.Client(base_url=url) as http:
                for _ in range(10):
                    codes.append(http.put(f"/v1/chunks/{key(8)}", content=blob).status_code)

        threads = [threading.Thread(target=put, args=(v,)) for v in versions]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert codes.count(201) == 1 and set(codes) <= {200, 201, 409}
        with httpx.Client(base_url=url) as http:
            first = http.get(f"/v1/chunks/{key(8)}").content
            assert first in [served(v) for v in versions]
            _push_out_of_ram(http)
            assert http.get(f"/v1/chunks/{key(8)}").content == first
