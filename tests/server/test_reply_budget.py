"""Replies are budgeted until written (server/reply_budget.py): a batch GET reads a key asked
for twice once and refuses a reply larger than the budget; clients that never read their
replies hold their bytes (and the tier's slots) only until the write timeout, and past the
budget the next GET is told 503, not given more memory. Raw sockets on loopback."""

from __future__ import annotations

import time

import msgpack

from kvtier.client import Client
from kvtier.server.state import ServiceState
from tests.http_server import running
from tests.server.test_chunk_streaming import _big, _raw, _until
from tests.server.test_server_chunks import _config, chunk, key, served

MiB = 1 << 20


def _state(tmp_path, **server) -> ServiceState:
    cfg = _config(tmp_path, max_body_bytes=4 * MiB, max_inflight_bytes=8 * MiB,
                  chunk_slot_bytes=4 * MiB, reply_write_timeout_s=1.0, **server)
    cfg.tiers.cpu_bytes = 64 * MiB
    return ServiceState.sidecar(cfg)


def test_a_batch_get_reads_a_repeated_key_once_and_is_bounded_by_bytes(tmp_path):
    state = _state(tmp_path)
    blob = chunk(key(1), seed=1, layers=8, tokens=512)  # 256 KiB
    with running(state) as url, Client(url) as kv:
        kv.put_chunk(key(1), blob)
        hits = state.manager.stats.hits_by_tier.get("cpu", 0)
        got = kv.http.post("/v1/chunks/batch/get", json={"keys": [key(1)] * 20})
        assert got.status_code == 200
        assert msgpack.unpackb(got.content) == [served(blob)] * 20
        assert state.manager.stats.hits_by_tier["cpu"] == hits + 1  # read once
        r = kv.http.post("/v1/chunks/batch/get", json={"keys": [key(1)] * 768})  # 200 MiB
        assert r.status_code == 413 and "smaller batches" in r.json()["error"]["message"]
        assert _until(lambda: state.replies.held == 0)


def test_replies_nobody_reads_are_cut_off_and_never_pass_the_budget(tmp_path):
    state = _state(tmp_path)
    blob = _big(1, tokens=6144)  # 3 MiB: more than the socket buffers hold
    with running(state) as url, Client(url) as kv:
        kv.put_chunk(key(1), blob)
        cpu = state.manager.tiers[0]
        readers = []
        for _ in range(2):  # two clients ask and never read: 6 MiB of an 8 MiB budget
            sock = _raw(url, rcvbuf=4096)
            sock.sendall(f"GET /v1/chunks/{key(1)} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            readers.append(sock)
        assert _until(lambda: state.replies.held >= 6 * MiB)
        r = kv.http.get(f"/v1/chunks/{key(1)}")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        # Past the write timeout the stalled replies are cut off: leases and budget released.
        assert _until(lambda: state.replies.held == 0, timeout=15)
        assert _until(lambda: not cpu._leased_keys)  # noqa: SLF001
        assert kv.get_chunk(key(1)) == served(blob)
        for sock in readers:
            sock.close()
        time.sleep(0.1)
        assert kv.health()["status"] == "ok"
