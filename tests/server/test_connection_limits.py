"""Connections bounded by their clients (docs/server.md, Guards and errors): sockets that
send nothing cannot take the descriptors a tenant's chunk reads need, a request head has a
deadline, and one tenant's connections hold at most its share of the cap. ``kvtier serve``
runs as its own process (its descriptor limit is the point), on real sockets."""

from __future__ import annotations

import http.client
import json

import pytest

from kvtier.chunk_format import with_namespace
from kvtier.client import Client
from tests.server.serve_limits import chunk, closed_by_server, serve


def _whole_reply(sock) -> bytes:
    """One reply with its ``Content-Length`` body, read whole."""
    got = b""
    while b"\r\n\r\n" not in got:
        got += sock.recv(65536)
    head, body = got.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


@pytest.fixture
def stopper():
    started = []
    yield started.append
    for served in started:
        served.stop()


def test_idle_sockets_past_the_descriptor_limit_leave_a_tenant_his_disk_chunks(tmp_path, stopper):
    # 256 descriptors, soft and hard: the server cannot raise its limit, and 300 sockets
    # that never send a byte would take every descriptor the disk tier opens chunks with.
    served = serve(tmp_path, nofile=256)
    stopper(served)
    key, other = "a" * 32, "b" * 32
    with Client(served.url) as kv:
        kv.put_chunk(key, chunk(key))
    idle = [served.connect() for _ in range(300)]
    with Client(served.url) as kv:  # a fresh connection, as a client that comes later
        assert kv.get_chunk(key) == with_namespace(chunk(key), "default")
        kv.put_chunk(other, chunk(other, seed=1))
        assert kv.get_chunk(other) == with_namespace(chunk(other, seed=1), "default")
    cap = served.metric("kvtier_connection_cap")
    assert 0 < cap <= 256 - 64
    assert served.metric("kvtier_connections_open") <= cap
    assert served.metric("kvtier_connections_closed_total", reason="evicted_idle") >= 300 - cap
    assert served.descriptors() < 256
    for sock in idle:
        sock.close()


def test_a_connection_without_a_whole_request_head_is_closed_at_its_deadline(tmp_path, stopper):
    served = serve(tmp_path, env={"KVTIER_SERVER__REQUEST_HEAD_TIMEOUT_S": "3"})
    stopper(served)
    silent = [served.connect() for _ in range(5)]
    partial = served.connect()
    partial.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never finished
    kept = served.connect()  # one whole request, then half of the next
    kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _whole_reply(kept).startswith(b"HTTP/1.1 200")
    kept.sendall(b"GET /hea")
    for sock in silent:
        assert closed_by_server(sock) == b""  # nothing read: closed without a reply
    for sock in (partial, kept):
        reply = closed_by_server(sock)
        assert reply is not None and reply.startswith(b"HTTP/1.1 408")
        body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == 408
        assert body["error"]["type"] == "request_timeout"
    assert served.metric("kvtier_connections_closed_total", reason="head_timeout") >= 7
    for sock in (*silent, partial, kept):
        sock.close()


def _head(conn: http.client.HTTPConnection, token: str) -> http.client.HTTPResponse:
    conn.request("HEAD", "/v1/chunks/" + "c" * 32, headers={"Authorization": f"Bearer {token}"})
    resp = conn.getresponse()
    resp.read()
    return resp


def test_a_tenant_past_its_share_of_connections_is_told_503_and_others_are_served(tmp_path, stopper):
    tokens = [{"token": "tenant-a-token", "tenant": "a"}, {"token": "tenant-b-token", "tenant": "b"}]
    served = serve(tmp_path, env={"KVTIER_SERVER__MAX_CONNECTIONS": "8",
                                  "KVTIER_SERVER__AUTH_TOKEN": "admin-token",
                                  "KVTIER_SERVER__TOKENS": json.dumps(tokens)})
    stopper(served)
    conns = [http.client.HTTPConnection("127.0.0.1", served.port, timeout=60) for _ in range(5)]
    for conn in conns[:4]:  # a's share of 8: 4 connections, each with a request answered
        assert _head(conn, "tenant-a-token").status == 404
    refused = _head(conns[4], "tenant-a-token")
    assert refused.status == 503
    assert refused.getheader("Retry-After") == "1"
    assert refused.will_close
    for conn in conns[:4]:  # a's own connections go on
        assert _head(conn, "tenant-a-token").status == 404
    other = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    assert _head(other, "tenant-b-token").status == 404
    metrics = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    metrics.request("GET", "/metrics", headers={"Authorization": "Bearer admin-token"})
    text = metrics.getresponse().read().decode()
    assert 'kvtier_connections_closed_total{reason="tenant_cap"} 1.0' in text
    for conn in (*conns, other, metrics):
        conn.close()
