"""Whole-chunk leases from Redis read straight into the tier's reused staging buffers
(``redis_bulk``): the bytes put, no buffer kept or made in steady state, and every way a
reply can go wrong (nil, an error reply, a hung server, a peer that breaks off mid-value or
answers nonsense) is a miss that hands no buffer out and leaves no connection mid-reply."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import torch

from kvtier.chunk_format import encode_chunk
from kvtier.connectors.tiers.blobs import put_blobs
from kvtier.connectors.tiers.host_buffers import StagingPool
from kvtier.connectors.tiers.manager import TierManager
from kvtier.connectors.tiers.redis_tier import RedisTier
from tests import redis_servers
from tests.redis_servers import RedisServer

redis_server = redis_servers.redis_server  # shared fixture, used by name

pytestmark = pytest.mark.timeout(60)
FP = b"model-fp"


def chunk(i: int, tokens: int = 16) -> bytes:
    g = torch.Generator().manual_seed(i)
    return encode_chunk(key(i), FP, torch.randn(4, 2, tokens, 2, 8, generator=g).to(torch.bfloat16))


def key(i: int) -> str:
    return f"{i:064x}"


def test_leased_chunks_are_the_bytes_put_in_reused_buffers(redis_server: RedisServer) -> None:
    staging = StagingPool()
    with RedisTier(redis_server.url, timeout_s=2.0, staging=staging) as t:
        blobs = {key(i): chunk(i, tokens=16 * (i + 1)) for i in range(4)}
        assert put_blobs(t, blobs).ok
        keys = [*blobs, key(99)]  # the last one was never stored
        with t.lease(keys) as views:
            assert views[-1] is None
            for k, v in zip(keys, views, strict=False):
                if k in blobs:
                    assert bytes(v.numpy()) == blobs[k]
            assert staging.lent == 4
        assert staging.lent == 0
        made = staging.allocations
        for _ in range(3):  # steady state: the same buffers again, none made
            with t.lease(keys) as views:
                assert sum(v is not None for v in views) == 4
        assert staging.allocations == made and staging.lent == 0
        assert t.stats.hits == 16 and t.stats.misses == 4


def test_a_key_of_another_type_is_a_miss_and_the_next_lease_works(redis_server: RedisServer) -> None:
    import redis

    with RedisTier(redis_server.url, timeout_s=2.0) as t:
        put_blobs(t, {key(1): chunk(1)})
        redis.Redis.from_url(redis_server.url).lpush("kvtier:" + key(2), b"x")  # WRONGTYPE
        with t.lease([key(1), key(2)]) as views:  # the error reply is key(2)'s alone
            assert bytes(views[0].numpy()) == chunk(1) and views[1] is None
        assert t.stats.corrupt == 1 and t.staging.lent == 0  # not a chunk: deleted
        with t.lease([key(1), key(2)]) as views:
            assert bytes(views[0].numpy()) == chunk(1) and views[1] is None


def test_a_corrupt_value_leased_is_rejected_by_the_manager(redis_server: RedisServer) -> None:
    import redis

    with RedisTier(redis_server.url, timeout_s=2.0) as t:
        bad = bytearray(chunk(3))
        bad[-5] ^= 0xFF
        redis.Redis.from_url(redis_server.url).set("kvtier:" + key(3), bytes(bad))
        put_blobs(t, {key(4): chunk(4)})
        manager = TierManager([t], fingerprint=FP)
        with manager.lease([key(3), key(4)]) as parts:
            assert parts[0] is None and parts[1] is not None
        assert manager.stats.rejected.get("corrupt", 0) == 1
        assert t.staging.lent == 0


def test_a_hung_server_is_a_bounded_miss(redis_server: RedisServer) -> None:
    with RedisTier(redis_server.url, timeout_s=0.3) as t:
        put_blobs(t, {key(5): chunk(5)})
        redis_server.pause()
        try:
            start = time.monotonic()
            with t.lease([key(5)]) as views:
                assert views == [None]
            assert time.monotonic() - start < 2.0
            assert t.stats.errors.get("timeout", 0) >= 1 and t.staging.lent == 0
        finally:
            redis_server.resume()
        with t.lease([key(5)]) as views:
            assert bytes(views[0].numpy()) == chunk(5)


class _BrokenPeer:
    """A loopback server that speaks enough RESP for redis-py's handshake (``HELLO 3``,
    ``+OK`` to every other command) and answers each GET with ``reply``: what a broken proxy or a server
    dying mid-value sends."""

    def __init__(self, reply: bytes, close_after: bool) -> None:
        self.reply, self.close_after = reply, close_after
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _client(self, conn: socket.socket) -> None:
        # The client hangs up on a reply it refuses (that is what is tested): not an error.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        buf = b""
        with conn:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                while True:
                    cmd, buf = _one_command(buf)
                    if cmd is None:
                        break
                    if cmd[0].upper() == b"HELLO":  # redis-py speaks RESP3
                        conn.sendall(b"%1\r\n$5\r\nproto\r\n:3\r\n")
                    elif cmd[0].upper() == b"GET":
                        conn.sendall(self.reply)
                        if self.close_after:
                            return
                    else:
                        conn.sendall(b"+OK\r\n")

    def close(self) -> None:
        self.sock.close()


def _one_command(buf: bytes) -> tuple[list[bytes] | None, bytes]:
    """The first whole RESP array of bulk strings in ``buf``, and what follows it."""
    if not buf.startswith(b"*") or b"\r\n" not in buf:
        return None, buf
    head, rest = buf.split(b"\r\n", 1)
    args = []
    for _ in range(int(head[1:])):
        if b"\r\n" not in rest:
            return None, buf
        size, rest = rest.split(b"\r\n", 1)
        n = int(size[1:])
        if len(rest) < n + 2:
            return None, buf
        args.append(rest[:n])
        rest = rest[n + 2 :]
    return args, rest


@pytest.mark.parametrize("reply, close_after", [
    (b"$1000\r\n" + b"x" * 100, True),      # the peer dies mid-value
    (b"$4\r\nabcdXY", False),               # a value not ended by CRLF
    (b"+OK\r\n", False),                    # not a bulk reply at all
    (b"$" + b"9" * 80 + b"\r\n", False),    # a header longer than any length
])
def test_a_broken_reply_is_a_miss_that_lends_no_buffer(reply: bytes, close_after: bool) -> None:
    peer = _BrokenPeer(reply, close_after)
    try:
        with RedisTier(peer.url, timeout_s=0.5) as t:
            start = time.monotonic()
            with t.lease([key(1), key(2)]) as views:
                assert views == [None, None]
            assert time.monotonic() - start < 3.0
            assert t.staging.lent == 0 and sum(t.stats.errors.values()) >= 1
    finally:
        peer.close()
