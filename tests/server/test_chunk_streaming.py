"""The data plane moves chunk bodies through reused buffers and leased tier memory, over
real HTTP on loopback: uploads stream into staging buffers, downloads stream out of the
tier's slot under its lease, and neither a cut upload nor a client that walks away mid
download leaves anything behind (nothing stored, no lease held, no buffer lost)."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

from kvtier.chunk_format import namespaced_key, validate_chunk
from kvtier.client import Client, ServiceError
from kvtier.connectors.tiers.blobs import put_blobs
from kvtier.errors import InvalidArgumentError
from kvtier.server.state import ServiceState
from tests.http_server import running
from tests.serve_process import free_port
from tests.server.test_server_chunks import FP, _config, chunk, key, served


def stored_as(k: str) -> str:
    """Where the service files the default tenant's chunk ``k``."""
    return namespaced_key("default", k)

def _big(i: int, tokens: int = 512) -> bytes:
    """A chunk of 256 KiB (many socket reads); 3 MiB with ``tokens=6144`` (several
    response pieces: more than a socket's buffers hold)."""
    return chunk(key(i), seed=i, layers=8, tokens=tokens)


def _sidecar(tmp_path, slot: int = 13 << 20):
    cfg = _config(tmp_path, max_body_bytes=16 << 20, chunk_slot_bytes=slot)
    cfg.tiers.cpu_bytes = 96 << 20
    return ServiceState.sidecar(cfg)


def _until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _raw(url: str, rcvbuf: int | None = None) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.socket()
    if rcvbuf is not None:  # before connecting: the window is fixed then
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect((parts.hostname, parts.port))
    return sock


def test_streamed_put_and_leased_get_round_trip_reuse_their_buffers(tmp_path):
    state = _sidecar(tmp_path)
    blobs = {key(i): _big(i, tokens=6144 if i % 2 else 512) for i in range(6)}
    with running(state) as url, Client(url) as kv:
        staging = state.manager.staging
        for k, b in list(blobs.items())[:2]:  # the first uploads allocate the buffer
            assert kv.put_chunk(k, b)["status"] == "stored"
        allocated = staging.allocations
        for k, b in list(blobs.items())[2:]:
            assert kv.put_chunk(k, b)["status"] == "stored"
        for _ in range(2):
            for k, b in blobs.items():
                assert kv.get_chunk(k) == served(b)
        assert staging.allocations == allocated  # steady state: no new buffer per chunk
        cpu = state.manager.tiers[0]
        assert _until(lambda: not cpu._leased_keys)  # every download's lease was released
        assert state.manager.stats.hits_by_tier["cpu"] == 12


def test_a_cut_upload_stores_nothing_and_gives_its_buffer_back(tmp_path):
    state = _sidecar(tmp_path)
    blob = _big(1)
    with running(state) as url, Client(url) as kv:
        staging = state.manager.staging
        sock = _raw(url)
        head = f"PUT /v1/chunks/{key(1)} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(blob)}\r\n\r\n"
        sock.sendall(head.encode() + blob[: len(blob) // 2])
        time.sleep(0.2)
        sock.close()  # the client dies mid-body
        assert _until(lambda: staging.idle_bytes > 0)  # its buffer came back
        assert not kv.has_chunk(key(1))
        assert kv.put_chunk(key(1), blob)["status"] == "stored"  # the key is not poisoned
        assert kv.get_chunk(key(1)) == served(blob)


def test_a_body_longer_than_it_declared_is_400_and_stores_nothing(tmp_path):
    state = _sidecar(tmp_path)
    blob = _big(1)
    with running(state) as url, Client(url) as kv:
        sock = _raw(url)
        head = f"PUT /v1/chunks/{key(1)} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(blob) - 10}\r\n\r\n"
        sock.sendall(head.encode() + blob)  # the parser takes the declared length: a bad chunk
        reply = sock.recv(4096).decode(errors="replace")
        sock.close()
        assert reply.startswith("HTTP/1.1 400")
        assert not kv.has_chunk(key(1))


def test_a_reader_that_walks_away_releases_the_slot_it_was_sent_from(tmp_path):
    state = _sidecar(tmp_path)
    blob = _big(1, tokens=4 * 6144)  # 12 MiB: more than the socket buffers on both ends
    with running(state) as url, Client(url) as kv:
        kv.put_chunk(key(1), blob)
        cpu = state.manager.tiers[0]
        sock = _raw(url, rcvbuf=4096)
        sock.sendall(f"GET /v1/chunks/{key(1)} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")
        assert stored_as(key(1)) in cpu._leased_keys  # the slot is being sent from
        sock.close()
        assert _until(lambda: not cpu._leased_keys)
        assert kv.delete_chunk(key(1))  # and the slot is free to go
        assert len(cpu) == 0


def test_a_corrupt_cpu_copy_is_never_sent_and_the_disk_copy_is(tmp_path):
    state = _sidecar(tmp_path)
    blob = _big(1)
    with running(state) as url, Client(url) as kv:
        kv.put_chunk(key(1), blob, tier="disk")
        cpu = state.manager.tiers[0]
        stored = served(blob)
        assert put_blobs(cpu, {stored_as(key(1)): stored}).stored == [stored_as(key(1))]
        slot, _ = cpu._index.get(stored_as(key(1)), touch=False)
        cpu._arena[slot * cpu.slot_bytes + len(stored) - 100] ^= 0xFF  # a flipped bit at rest
        got = kv.get_chunk(key(1))
        assert got == stored
        validate_chunk(got, stored_as(key(1)), FP)
        assert state.manager.stats.rejected.get("corrupt") == 1
        assert _until(lambda: not cpu._leased_keys)


def test_a_disk_hit_is_sent_from_its_read_buffer_and_promoted(tmp_path):
    state = _sidecar(tmp_path)
    blob = _big(1)
    with running(state) as url, Client(url) as kv:
        kv.put_chunk(key(1), blob, tier="disk")
        assert kv.get_chunk(key(1)) == served(blob)
        assert state.manager.stats.hits_by_tier["disk"] == 1
        assert kv.lookup([key(1)]).tiers == ["cpu"]  # promoted: the next read is RAM
        assert kv.get_chunk(key(1)) == served(blob)


def test_the_sync_client_reads_into_a_buffer_and_shares_across_threads(tmp_path):
    state = _sidecar(tmp_path, slot=1 << 20)  # every chunk fits in RAM: reads are RAM hits
    blobs = {key(i): _big(i, tokens=512 * (1 + i % 3)) for i in range(8)}
    with running(state) as url, Client(url) as kv:
        assert kv.wire is not None  # plain http: single chunks bypass httpx
        with ThreadPoolExecutor(4) as pool:
            assert all(r["status"] == "stored" for r in pool.map(lambda kb: kv.put_chunk(*kb), blobs.items()))

            def read_back(k: str) -> bool:
                out = bytearray(1 << 20)
                got = kv.get_chunk_into(k, out)
                return got is not None and bytes(got) == served(blobs[k])

            assert all(pool.map(read_back, list(blobs) * 3))
        assert kv.get_chunk_into(key(99), bytearray(16)) is None
        with pytest.raises(InvalidArgumentError, match="does not fit"):
            kv.get_chunk_into(key(1), bytearray(100))
        assert kv.get_chunk(key(2)) == served(blobs[key(2)])  # the connection is still usable
        with pytest.raises(ServiceError) as err:
            kv.put_chunk(key(50), blobs[key(1)])  # a chunk under another key
        assert err.value.status == 400 and err.value.type == "invalid_chunk"
        assert not kv.has_chunk(key(50))


def test_the_sync_client_survives_a_server_restart_between_calls(tmp_path):
    blob = _big(1)
    port = free_port()
    first = _sidecar(tmp_path / "a")
    with running(first, port=port) as url:
        kv = Client(url)
        assert kv.put_chunk(key(1), blob)["status"] == "stored"  # a keep-alive connection now
    second = _sidecar(tmp_path / "b")
    with running(second, port=port):
        assert kv.get_chunk(key(1)) is None  # a fresh server: the stale connection is redialed
        assert kv.put_chunk(key(1), blob)["status"] == "stored"
        assert kv.get_chunk(key(1)) == served(blob)
    kv.close()


def test_bodies_past_the_inflight_budget_get_503_with_retry_after(tmp_path):
    """Two uploads of 3 MiB fit a 7 MiB budget; a third waiting to be read would not: 503
    with Retry-After, nothing stored; once one finishes, the same upload goes through."""
    cfg = _config(tmp_path, max_body_bytes=4 << 20, max_inflight_bytes=7 << 20,
                  chunk_slot_bytes=13 << 20)
    cfg.tiers.cpu_bytes = 96 << 20
    state = ServiceState.sidecar(cfg)
    blobs = {i: _big(i, tokens=6144) for i in (1, 2, 3)}
    with running(state) as url, Client(url) as kv:
        held = []
        for i in (1, 2):  # headers sent, bodies not yet: admitted and counted
            sock = _raw(url)
            sock.sendall(f"PUT /v1/chunks/{key(i)} HTTP/1.1\r\nHost: x\r\n"
                         f"Content-Length: {len(blobs[i])}\r\n\r\n".encode())
            held.append(sock)
        time.sleep(0.3)
        r = kv.http.put(f"/v1/chunks/{key(3)}", content=blobs[3])
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "max_inflight_bytes" in r.json()["error"]["message"]
        assert not kv.has_chunk(key(3))
        held[0].sendall(blobs[1])  # one upload completes and releases its share
        assert held[0].recv(4096).startswith(b"HTTP/1.1 201")
        # Its share is given back once the request is done (just after the reply is sent):
        # a client that honours Retry-After gets through.
        assert _until(lambda: kv.http.put(f"/v1/chunks/{key(3)}", content=blobs[3])
                      .status_code == 201, timeout=10)
        assert kv.get_chunk(key(3)) == served(blobs[3])
        for sock in held:
            sock.close()
