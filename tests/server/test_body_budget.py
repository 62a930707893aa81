"""Every byte of a request body is budgeted before the server holds it (server/middleware.py):
a route that takes no body refuses one unread, a chunked body counts as it arrives, a body
that stalls is cut off with 408, and one tenant's unfinished uploads cannot make another
tenant's wait. Raw sockets against a real server on loopback."""

from __future__ import annotations

import time

import httpx

from kvtier.config import TokenConfig
from kvtier.server.state import ServiceState
from tests.http_server import running
from tests.server.test_chunk_streaming import _raw
from tests.server.test_server_chunks import _config, chunk, key

MiB = 1 << 20


def _state(tmp_path, tokens=(), **server) -> ServiceState:
    cfg = _config(tmp_path, max_body_bytes=4 * MiB, max_inflight_bytes=8 * MiB,
                  chunk_slot_bytes=4 * MiB, body_idle_timeout_s=1.0, body_timeout_s=30.0,
                  **server)
    cfg.server.tokens = list(tokens)
    cfg.tiers.cpu_bytes = 32 * MiB
    return ServiceState.sidecar(cfg)


def _status(sock) -> int:
    head = sock.recv(4096)
    return int(head.split(b" ", 2)[1])


def _chunked_head(path: str, token: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (f"PUT {path} HTTP/1.1\r\nHost: x\r\n{auth}Transfer-Encoding: chunked\r\n\r\n").encode()


def _piece(n: int) -> bytes:
    return f"{n:x}\r\n".encode() + bytes(n) + b"\r\n"


def test_a_route_that_takes_no_body_refuses_one_before_reading_it(tmp_path):
    with running(_state(tmp_path)) as url:
        sock = _raw(url)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + _piece(64 * 1024))  # more would follow: the server must not wait for it
        assert _status(sock) == 400
        sock = _raw(url)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3000000\r\n\r\n")
        assert _status(sock) == 400
        assert httpx.get(f"{url}/healthz").status_code == 200


def test_a_chunked_body_counts_as_it_arrives_and_a_stalled_one_is_cut_off(tmp_path):
    state = _state(tmp_path)
    with running(state) as url, httpx.Client(base_url=url) as http:
        held = []
        for i in range(3):  # three unfinished uploads of 3 MiB each against an 8 MiB budget
            sock = _raw(url)
            sock.sendall(_chunked_head(f"/v1/chunks/{key(i)}"))
            for _ in range(3):
                sock.sendall(_piece(MiB))
            held.append(sock)
            time.sleep(0.2)
        # The third passed the budget while its pieces arrived: refused then, not held.
        assert _status(held[2]) == 503
        # The other two stall (no byte for over body_idle_timeout_s): 408, budget given back.
        assert _status(held[0]) == 408 and _status(held[1]) == 408
        blob = chunk(key(9), seed=9, layers=8, tokens=2048)
        assert http.put(f"/v1/chunks/{key(9)}", content=blob).status_code == 201
        assert http.get("/healthz").status_code == 200


def test_an_idle_declared_body_holds_budget_only_until_its_timeout(tmp_path):
    with running(_state(tmp_path)) as url, httpx.Client(base_url=url) as http:
        idle = []
        for i in range(2):  # 2 x 4 MiB declared, nothing sent: the whole 8 MiB budget
            sock = _raw(url)
            sock.sendall(f"PUT /v1/chunks/{key(i)} HTTP/1.1\r\nHost: x\r\n"
                         f"Content-Length: {4 * MiB}\r\n\r\n".encode())
            idle.append(sock)
        time.sleep(0.3)
        blob = chunk(key(5), seed=5, layers=8, tokens=256)
        assert http.put(f"/v1/chunks/{key(5)}", content=blob).status_code == 503
        assert [_status(s) for s in idle] == [408, 408]  # within body_idle_timeout_s
        assert http.put(f"/v1/chunks/{key(5)}", content=blob).status_code == 201


def test_one_tenants_unfinished_uploads_do_not_starve_another(tmp_path):
    tokens = [TokenConfig(token="token-alice-0123456789", tenant="alice"),
              TokenConfig(token="token-bob-0123456789ab", tenant="bob")]
    with running(_state(tmp_path, tokens=tokens)) as url:
        held = []
        for i in range(2):  # alice declares 2 x 4 MiB and sends nothing
            sock = _raw(url)
            sock.sendall(f"PUT /v1/chunks/{key(i)} HTTP/1.1\r\nHost: x\r\n"
                         f"Authorization: Bearer {tokens[0].token}\r\n"
                         f"Content-Length: {4 * MiB}\r\n\r\n".encode())
            held.append(sock)
        time.sleep(0.3)
        assert _status(held[1]) == 503  # past alice's share, not the whole budget
        blob = chunk(key(7), seed=7, layers=8, tokens=1024)
        bob = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {tokens[1].token}"})
        assert bob.put(f"/v1/chunks/{key(7)}", content=blob).status_code == 201
        bob.close()
