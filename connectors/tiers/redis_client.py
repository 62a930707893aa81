"""The Redis tier's connection: URLs, clients, the private event loop, and fault mapping.

``RedisConnection`` owns what talks to the server: redis-py's asyncio client (a plain
client or a ``RedisCluster``) on a private event loop in a daemon thread, and, on a single
server, a blocking client with worker threads for whole-blob batches. Which exceptions mean
"the server is down, unreachable or stalled" (``FAULTS``) and how they are reported
(``error_kind``) live here too; what a fault turns into (a miss, a failed put) is the
tier's business.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis
from redis import exceptions as rexc
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.connection import Encoder, PythonRespSerializer
from redis.retry import Retry as SyncRetry

from kvtier.errors import InvalidArgumentError
from kvtier.thread_start import thread_started

T = TypeVar("T")

CLUSTER_SCHEME = "redis+cluster"


def parse_cluster_url(url: str) -> list[tuple[str, int]]:
    """``redis+cluster://h1:p1,h2:p2`` -> startup nodes."""
    rest = url.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]
    nodes = []
    for part in filter(None, rest.split(",")):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgumentError(f"cluster node {part!r} in {url!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise InvalidArgumentError(f"{url!r} names no cluster node; use redis+cluster://host:port,...")
    return nodes


FAULTS = (
    rexc.RedisError,
    rexc.RedisClusterException,
    OSError,
    TimeoutError,
    asyncio.TimeoutError,
    concurrent.futures.CancelledError,
)
"""What a down, unreachable, hung or closing server raises; each becomes a miss or a failure."""


def error_kind(exc: BaseException) -> str:
    if isinstance(exc, (rexc.TimeoutError, TimeoutError, asyncio.TimeoutError)):
        return "timeout"
    return "unavailable"


def reply_failure(reply: Exception) -> str:
    """The ``PutResult.failed`` reason of a command's error reply. Redis answers ``OOM ...``
    past its ``maxmemory`` (redis-py strips the prefix into ``OutOfMemoryError``): that is
    a full tier, as a full disk is, not an error."""
    if is_fault(reply):
        return f"{error_kind(reply)}: {reply}"
    if isinstance(reply, rexc.OutOfMemoryError) or str(reply).startswith("OOM"):
        return f"full: {reply}"
    return f"error: {reply}"


def is_wrong_type(reply: object) -> bool:
    """A per-command error reply saying the key holds a value of another type (a list, a
    hash, ...): under a chunk key, no chunk."""
    return isinstance(reply, rexc.ResponseError) and str(reply).startswith("WRONGTYPE")


def is_fault(reply: object) -> bool:
    """A per-command reply that is a connection fault (cluster pipelines return them)."""
    return isinstance(reply, (rexc.ConnectionError, rexc.TimeoutError, OSError))


async def make_async_client(url: str, *, cluster: bool, timeout_s: float, max_connections: int) -> Any:
    """The asyncio client (plain or cluster) for ``url``; to be awaited on the tier's loop."""
    # A stalled server must cost one timeout, not retries with backoff; a dropped
    # connection (server restarted) is retried once so the first call after a
    # restart already succeeds.
    common: dict[str, Any] = dict(
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1, supported_errors=(rexc.ConnectionError,)),
        max_connections=max_connections,
    )
    if not cluster:
        # A blocking pool: past max_connections a call waits for a connection (within its
        # own deadline) instead of failing with MaxConnectionsError, which under a load of
        # many sessions turned a healthy Redis into spurious misses.
        pool = aioredis.BlockingConnectionPool.from_url(url, timeout=None, **common)
        return aioredis.Redis(connection_pool=pool)
    if urlsplit(url).scheme == CLUSTER_SCHEME:
        nodes = [ClusterNode(h, p) for h, p in parse_cluster_url(url)]
        parts = urlsplit(url.replace(CLUSTER_SCHEME + "://", "redis://", 1).split(",", 1)[0])
        return RedisCluster(
            startup_nodes=nodes, username=parts.username, password=parts.password,
            **common,
        )
    return RedisCluster.from_url(url, **common)


_BUFFER_CUTOFF = 6000
"""redis-py's own cutoff: values longer than this go out as separate writes, uncopied."""
_ENCODER = Encoder(encoding="utf-8", encoding_errors="strict", decode_responses=False)


def make_sync_client(url: str, *, timeout_s: float, max_connections: int,
                     pool_wait_s: float = 30.0) -> redis.Redis:
    """The blocking single-server client, with the asyncio client's pool settings (a
    blocking pool whose wait is bounded: its worker threads are not cancelled)."""
    pool = redis.BlockingConnectionPool.from_url(
        url,
        # redis-py's Python packer sends a large value straight from the caller's buffer;
        # with hiredis installed it would pick hiredis's, which copies every value twice
        # (to bytes, then into one command buffer): a quarter of the socket's speed for a
        # 32 MiB chunk. Replies still parse with hiredis.
        command_packer=PythonRespSerializer(_BUFFER_CUTOFF, _ENCODER.encode),
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=SyncRetry(NoBackoff(), 1, supported_errors=(rexc.ConnectionError,)),
        max_connections=max_connections,
        timeout=pool_wait_s,
    )
    return redis.Redis(connection_pool=pool)


class RedisConnection:
    """The clients of one Redis tier and the daemon-thread event loop they run on.

    ``timeout_s`` bounds connecting, every socket read, and closing.
    """

    def __init__(self, url: str, *, cluster: bool, timeout_s: float, max_connections: int) -> None:
        self.timeout_s = timeout_s
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="kvtier-redis", daemon=True)
        self._thread.start()
        self.client = self.run_on_loop(
            make_async_client(url, cluster=cluster, timeout_s=timeout_s, max_connections=max_connections),
            5.0,
        )
        # Whole-blob batches on a single server move through redis-py's blocking client (same
        # pool settings, hiredis parser) in worker threads the loop awaits: asyncio's socket
        # transport joins a pipeline into one buffer and copies what the kernel does not take
        # at once, and its stream reader copies replies twice more, which halves throughput
        # for multi-MiB values. The loop still owns the deadline of every call.
        self.sync: redis.Redis | None = None
        self._io: concurrent.futures.ThreadPoolExecutor | None = None
        if not cluster:
            self.sync = make_sync_client(url, timeout_s=timeout_s, max_connections=max_connections)
            self._io = concurrent.futures.ThreadPoolExecutor(
                max_connections, thread_name_prefix="kvtier-redis-io", initializer=thread_started
            )

    def _run_loop(self) -> None:
        thread_started()
        self.loop.run_forever()

    def run_on_loop(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @staticmethod
    async def _deadline(coro: Awaitable[T], timeout: float) -> T:
        return await asyncio.wait_for(coro, timeout)

    def submit(self, coro: Coroutine[Any, Any, T], timeout: float) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop under a ``timeout`` deadline, from any thread."""
        return asyncio.run_coroutine_threadsafe(self._deadline(coro, timeout), self.loop)

    async def blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` (a blocking-client call) in the I/O threads; awaited by the loop."""
        assert self._io is not None
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    def close(self) -> None:
        """Close the pool and stop the loop; bounded even if the server is down or hung."""
        with contextlib.suppress(Exception):
            self.run_on_loop(asyncio.wait_for(self.client.aclose(), self.timeout_s), self.timeout_s + 0.5)
        with contextlib.suppress(Exception):
            self.run_on_loop(self._cancel_pending(), 1.0)
        if self._io is not None:
            self._io.shutdown(wait=False, cancel_futures=True)
        if self.sync is not None:
            with contextlib.suppress(Exception):
                self.sync.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=2.0)
        if not self._thread.is_alive():
            self.loop.close()

    async def _cancel_pending(self) -> None:
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=0.5)
