"""Each reader of one service names the codecs of stored KV it takes
(``X-KVTier-Accept-Codecs``): over real HTTP, a service whose disk keeps chunks as int8
serves them to a reader that takes int8 and to no other (lookups, HEAD, GET, batch GET);
a header naming no codec is a 400; a second upload of a chunk the disk holds encoded is
a conflict, never a reason to drop the stored one."""

from __future__ import annotations

import httpx
import msgpack

from kvtier.chunk_format import parse_header
from kvtier.config import load_config
from kvtier.server.state import ServiceState
from tests.http_server import running
from tests.server.test_server_chunks import chunk, key

EXACT = {"X-KVTier-Accept-Codecs": "none"}
INT8 = {"X-KVTier-Accept-Codecs": "none,int8"}


def _state(tmp_path, accept: list[str] | None = None) -> ServiceState:
    cfg = load_config(environ={}, overrides={"tiers": {
        "cpu_bytes": 0, "disk_dir": str(tmp_path / "chunks"), "disk_fsync": False,
        "disk_codec": "int8", "accept_codecs": accept}})
    return ServiceState.sidecar(cfg)


def test_each_reader_gets_only_the_codecs_it_takes(tmp_path):
    k = key(1)
    with running(_state(tmp_path)) as url, httpx.Client(base_url=url) as http:
        assert http.put(f"/v1/chunks/{k}", content=chunk(k, seed=1)).status_code == 201
        for headers, stored in ((EXACT, False), (INT8, True), ({}, True)):  # {}: the server's own
            look = http.post("/v1/chunks/lookup", json={"keys": [k], "each": True}, headers=headers)
            assert look.json()["length"] == int(stored) and look.json()["present"] == [stored]
            assert http.head(f"/v1/chunks/{k}", headers=headers).status_code == (200 if stored else 404)
            got = http.get(f"/v1/chunks/{k}", headers=headers)
            assert got.status_code == (200 if stored else 404)
            if stored:
                assert parse_header(got.content)[0].codec == "int8"
            batch = http.post("/v1/chunks/batch/get", json={"keys": [k]}, headers=headers)
            assert (msgpack.unpackb(batch.content)[0] is not None) == stored
        for bad in ("zstd", "none,fp9", ","):
            r = http.get(f"/v1/chunks/{k}", headers={"X-KVTier-Accept-Codecs": bad})
            assert r.status_code == 400 and "X-KVTier-Accept-Codecs" in r.json()["error"]["message"]


def test_a_second_upload_of_an_encoded_chunk_keeps_the_stored_one(tmp_path):
    k = key(2)
    with running(_state(tmp_path, accept=["none"])) as url, httpx.Client(base_url=url) as http:
        assert http.put(f"/v1/chunks/{k}", content=chunk(k, seed=2)).status_code == 201
        again = http.put(f"/v1/chunks/{k}", content=chunk(k, seed=2))
        assert again.status_code == 409  # the disk holds it as int8: another version of the key
        assert http.head(f"/v1/chunks/{k}", headers=INT8).status_code == 200  # kept
