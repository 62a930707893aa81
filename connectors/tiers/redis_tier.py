"""Redis (or Redis Cluster) as the shared, scale-out tier.

One key per chunk holds the whole chunk (header and payload together), so a chunk is
either wholly visible or absent — never the half-written pair of keys LMCache leaves.
Every batch is one pipelined round trip (per node on a cluster): ``SET NX [EX]`` for a
store, pipelined ``GET`` for a lease, ``EXISTS`` per key for ``contains_prefix``; a
layer-range lease, and a cluster's whole-chunk lease, are two (header probe with
``STRLEN``, then the bytes). Every read sizes what it takes by the chunk's header, never by
the value: a value whose header disagrees with its length, or of another Redis type, is a
miss of that key alone, and deleted.

redis-py's asyncio client runs on a private event loop in a daemon thread; the Tier
methods submit to it and wait at most the configured deadline (whole-chunk reads go over a
plain connection straight into staging buffers, see ``redis_bulk``). A server that is down,
unreachable or stalled never raises out of a call: gets miss, puts report ``unavailable``
per key, and ``stats.errors`` counts ``unavailable`` / ``timeout``. The pool reconnects by
itself when the server is back. The connection itself (URLs, clients, the loop, which
exceptions are faults) lives in ``redis_client``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Coroutine, Iterator, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import torch
from redis.utils import HIREDIS_AVAILABLE

from kvtier.chunk_format import byte_view
from kvtier.connectors.tiers.base import ChunkWrite, PutResult, Tier
from kvtier.connectors.tiers.host_buffers import StagingPool
from kvtier.connectors.tiers.redis_batches import BatchSizer
from kvtier.connectors.tiers.redis_bulk import BadValue, get_into
from kvtier.connectors.tiers.redis_client import (
    CLUSTER_SCHEME,
    FAULTS,
    RedisConnection,
    error_kind,
    is_fault,
    reply_failure,
)
from kvtier.connectors.tiers.redis_ranges import read_layer_ranges, read_whole
from kvtier.connectors.tiers.redis_usage import RedisUsage
from kvtier.errors import InvalidArgumentError
from kvtier.io_priority import WaitedFirst

log = logging.getLogger(__name__)
T = TypeVar("T")



class RedisTier(Tier):
    """Tier over Redis or Redis Cluster.

    ``url``: ``redis://[user:pass@]host:port/db``, ``rediss://...``, ``unix:///path.sock``,
    or ``redis+cluster://host:port,host:port`` (any reachable nodes; the rest is discovered).
    ``cluster=True`` treats a ``redis://host:port`` URL as a cluster seed node.
    ``timeout_s`` bounds connecting and every socket read: a stalled server is noticed
    within it. A whole call is bounded by ``op_timeout_s`` (default ``max(4 * timeout_s,
    2 s)``) plus the time its bytes take at ``min_bandwidth_Bps`` (default 50 MB/s), so a
    batch of large chunks is not cut short on a loaded machine while a stall is still
    noticed; batches are split into calls of at most ``max_batch_bytes``. Past
    ``max_connections`` a call waits for a connection instead of failing. ``staging``: the
    reused buffers whole-chunk leases read into (default: its own). ``ttl_s`` gives
    every chunk an expiry (refreshed when put again).
    """

    name = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        cluster: bool | None = None,
        prefix: str = "kvtier:",
        ttl_s: float | None = None,
        timeout_s: float = 1.0,
        op_timeout_s: float | None = None,
        max_connections: int = 32,
        capacity_bytes: int | None = None,
        min_bandwidth_Bps: float = 50e6,
        max_batch_bytes: int = 64 << 20,
        staging: StagingPool | None = None,
    ) -> None:
        super().__init__()
        self.waited_first = WaitedFirst()
        """Background write batches wait for waited-for ones (see io_priority)."""
        self._own_staging = staging is None
        self._staging = StagingPool() if staging is None else staging
        if timeout_s <= 0:
            raise InvalidArgumentError(f"timeout_s must be > 0, got {timeout_s}")
        if ttl_s is not None and ttl_s <= 0:
            raise InvalidArgumentError(f"ttl_s must be > 0 or None, got {ttl_s}")
        scheme = urlsplit(url).scheme
        self.cluster = scheme == CLUSTER_SCHEME if cluster is None else cluster
        self.url = url
        self.prefix = prefix
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.timeout_s = timeout_s
        self.op_timeout_s = op_timeout_s or max(4 * timeout_s, 2.0)
        if min_bandwidth_Bps <= 0 or max_batch_bytes <= 0:
            raise InvalidArgumentError("min_bandwidth_Bps and max_batch_bytes must be > 0")
        self.min_bandwidth_Bps = min_bandwidth_Bps
        self.max_batch_bytes = max_batch_bytes
        self._batches = BatchSizer(max_batch_bytes)
        self._capacity = capacity_bytes
        self._usage = RedisUsage()
        """What this instance stored (bytes, chunks, tenants'), kept as counters."""
        self.round_trips = 0
        """Pipelines (network round trips; one per node on a cluster) sent so far."""
        self._closed = False
        self._conn = RedisConnection(
            url, cluster=self.cluster, timeout_s=timeout_s, max_connections=max_connections
        )
        self._client = self._conn.client
        self._sync = self._conn.sync

    # --- running on the connection's loop ---------------------------------------------
    def deadline(self, nbytes: int) -> float:
        """Seconds a call moving ``nbytes`` may take: a latency bound plus the bytes at the
        floor bandwidth."""
        return self.op_timeout_s + nbytes / self.min_bandwidth_Bps

    def _guarded(self, what: str, coro: Coroutine[Any, Any, T], fallback: Callable[[str], T],
                 nbytes: int = 0) -> T:
        """Run ``coro`` on the tier's loop from any thread; a Redis fault becomes ``fallback``."""
        if self._closed:
            coro.close()
            return fallback("unavailable: tier closed")
        limit = self.deadline(nbytes)
        fut = self._conn.submit(coro, limit)
        try:
            return fut.result(limit + 1.0)
        except FAULTS as exc:
            fut.cancel()
            return self._fault(what, exc, fallback)

    def _fault(self, what: str, exc: BaseException, fallback: Callable[[str], T]) -> T:
        kind = error_kind(exc)
        self.stats.count_error(kind)
        log.warning("redis tier %s failed (%s): %r", what, kind, exc)
        return fallback(f"{kind}: {exc!r}")

    def _rk(self, key: str) -> str:
        return self.prefix + key

    def _pipeline(self) -> Any:
        self.round_trips += 1
        return self._client.pipeline(transaction=False)

    def _queue_sets(self, pipe: Any, chunks: Mapping[str, memoryview]) -> Any:
        """``SET NX`` each value into ``pipe``, sent from the caller's buffer as it is (a
        slot or a staging buffer: no copy). A store that times out may still be sending
        when the caller reuses the buffer; the value is then torn, and every read checks
        key and checksums, so it is rejected, never served."""
        for k, value in chunks.items():
            pipe.set(self._rk(k), value, nx=True, px=self.ttl_ms)
            if self.ttl_ms is not None:
                pipe.pexpire(self._rk(k), self.ttl_ms)  # a re-put keeps a live chunk alive
        return pipe

    def _set_batch(self, chunks: Mapping[str, memoryview]) -> list[Any]:
        assert self._sync is not None
        pipe = self._queue_sets(self._sync.pipeline(transaction=False), chunks)
        return pipe.execute(raise_on_error=False)

    # --- async operations (run on the tier's loop) --------------------------------------
    async def _put(self, chunks: Mapping[str, memoryview]) -> PutResult:
        result = PutResult()
        if not chunks:
            return result
        keys = list(chunks)
        if self._sync is not None:
            self.round_trips += 1
            replies = await self._conn.blocking(self._set_batch, chunks)
        else:
            replies = await self._queue_sets(self._pipeline(), chunks).execute(raise_on_error=False)
        step = 1 if self.ttl_ms is None else 2
        written = 0
        for i, k in enumerate(keys):
            reply = replies[i * step]
            if isinstance(reply, Exception):
                result.failed[k] = reply_failure(reply)
            elif reply:
                result.stored.append(k)
                written += len(chunks[k])
            else:
                result.present.append(k)
        with self.stats.lock:
            self.stats.puts += len(result.stored)
            self.stats.bytes_written += written
        self._usage.stored({k: len(chunks[k]) for k in result.stored},
                           {k: self.occupancy(len(chunks[k])) for k in result.stored})
        return result

    async def _get(self, keys: Sequence[str], layers: tuple[int, int] | None
                   ) -> list[bytes | None]:
        """The values (or layer ranges framed as chunks), unverified: the stack checks
        them. Each is fetched by its header (:mod:`.redis_ranges`): a value that is not a
        chunk (an unreadable header, a length it disagrees with, another type) is a miss
        and deleted here."""
        if not keys:
            return []
        if layers is None:
            reads = await read_whole(self._pipeline, self._rk, keys, self._count_reply_faults)
        else:
            reads = await read_layer_ranges(self._pipeline, self._rk, keys, layers,
                                            self._count_reply_faults)
        if reads.not_chunks:
            await self._drop_corrupt(reads.not_chunks)
        self._account_get(keys, [None if b is None else len(b) for b in reads.chunks])
        return reads.chunks

    def _account_get(self, keys: Sequence[str], sizes: Sequence[int | None]) -> None:
        """Stats and tenant usage after a read: ``sizes`` per key, None for a miss."""
        hits = sum(n is not None for n in sizes)
        self._usage.read(keys, sizes)
        with self.stats.lock:
            self.stats.gets += len(keys)
            self.stats.hits += hits
            self.stats.misses += len(keys) - hits
            self.stats.bytes_read += sum(n for n in sizes if n is not None)

    def _count_reply_faults(self, replies: Sequence[object]) -> None:
        for r in replies:
            if is_fault(r):
                self.stats.count_error(error_kind(r))

    async def _drop_corrupt(self, keys: Sequence[str]) -> None:
        """Delete values found not to be chunks, counted as corrupt. What this instance
        stored under those keys, if anything, is unknown (a value grown, or of another
        type): the chunk count and the tenants' accounts drop them, the byte count stays."""
        log.warning("redis tier: %d values are not chunks (an unreadable header, a length "
                    "it disagrees with, or another type); deleted", len(keys))
        pipe = self._pipeline()
        for k in keys:
            pipe.delete(self._rk(k))
        await pipe.execute(raise_on_error=False)
        with self.stats.lock:
            self.stats.corrupt += len(keys)
        self._usage.removed(0, len(keys), keys)

    async def _contains_prefix(self, keys: Sequence[str]) -> int:
        held = await self._contains_each(keys)
        return held.index(False) if False in held else len(held)

    async def _contains_each(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        pipe = self._pipeline()
        for k in keys:
            pipe.exists(self._rk(k))
        replies = await pipe.execute(raise_on_error=False)
        self._count_reply_faults(replies)
        return [not isinstance(r, Exception) and bool(r) for r in replies]

    async def _sizes(self, keys: Sequence[str]) -> list[int | None]:
        if not keys:
            return []
        pipe = self._pipeline()
        for k in keys:
            pipe.strlen(self._rk(k))
        replies = await pipe.execute(raise_on_error=False)
        self._count_reply_faults(replies)
        return [r if isinstance(r, int) and not isinstance(r, bool) and r > 0 else None
                for r in replies]

    async def _delete(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        pipe = self._pipeline()
        for k in keys:
            pipe.strlen(self._rk(k))
            pipe.delete(self._rk(k))
        replies = await pipe.execute(raise_on_error=False)
        sizes, dels = replies[0::2], replies[1::2]
        removed = sum(1 for d in dels if d == 1)
        freed = sum(s for s, d in zip(sizes, dels, strict=True) if d == 1 and isinstance(s, int))
        self._usage.removed(freed, removed, keys)
        return removed

    async def _count_keys(self) -> int:
        n = 0
        async for _ in self._client.scan_iter(match=self._scan_pattern(), count=1000):
            n += 1
        return n

    def _scan_pattern(self) -> str:
        escaped = "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix)
        return escaped + "*"

    # --- the Tier interface (sync, from any thread) -------------------------------------
    @staticmethod
    def _check_layers(layers: tuple[int, int] | None) -> None:
        if layers is not None and not 0 <= layers[0] < layers[1]:
            raise InvalidArgumentError(f"layers must be (start, end) with 0 <= start < end, got {layers}")

    def store_in_place(self, writes: Sequence[ChunkWrite]) -> PutResult:
        """``SET NX`` each chunk from its bytes (a fill lands in a staging buffer first, sent
        from there with no copy), one pipeline per batch of ``max_batch_bytes``. Writes'
        ``info`` is not used: Redis evicts by its own ``maxmemory`` policy."""
        result = PutResult()
        todo: list[ChunkWrite] = []
        for write in writes:
            reason = write.admission_error()
            if reason is not None:
                result.failed[write.key] = reason
                self.stats.count_error("invalid")
            else:
                todo.append(write)
        for batch in self._batches.writes(todo):
            # Writes go one way on the link: a background batch yields to waited-for ones.
            self.stats.count_held(self.waited_first.before_background_write())
            with contextlib.ExitStack() as held, self.waited_first.during([]):
                values = {w.key: held.enter_context(w.bytes_from(self._staging)) for w in batch}
                part = self._guarded("put", self._put(values),
                                     lambda why, keys=list(values): PutResult(
                                         failed={k: why for k in keys}),
                                     sum(len(v) for v in values.values()))
            result.stored += part.stored
            result.present += part.present
            result.failed.update(part.failed)
        return result

    def _read(self, keys: Sequence[str], layers: tuple[int, int] | None) -> list[bytes | None]:
        """Values read as bytes (a layer range, or a cluster's whole chunks)."""
        out: list[bytes | None] = []
        for batch in self._batches.keys(keys):
            blobs = self._guarded("get", self._get(batch, layers),
                                  self._all_missed(batch), self._batches.budget(len(batch)))
            for b in blobs:
                self._batches.saw(None if b is None else len(b))
            out += blobs
        return out

    @contextlib.contextmanager
    def lease(
        self, keys: Sequence[str], layers: tuple[int, int] | None = None, background: bool = False
    ) -> Iterator[list[torch.Tensor | None]]:
        """The chunks as uint8 tensors, unverified (the stack checks them once): whole
        chunks read straight into staging buffers (one round trip); layer ranges, and a
        cluster's chunks, as tensors over the replies (two round trips: header, range)."""
        self._check_layers(layers)
        if layers is not None or self._sync is None or self._closed:
            blobs = self._read(keys, layers)
            yield [None if b is None else byte_view(b) for b in blobs]
            return
        got: list[tuple[torch.Tensor, int] | None] = []
        try:
            for batch in self._batches.keys(keys):
                got += self._get_into(batch)
            yield [None if g is None else g[0][: g[1]] for g in got]
        finally:
            for g in got:
                if g is not None:
                    self._staging.release(g[0])

    def _get_into(self, keys: Sequence[str]) -> list[tuple[torch.Tensor, int] | None]:
        """Whole chunks read straight into staging buffers (see :mod:`.redis_bulk`), on
        the calling thread. Each key is its own: a value that is not a chunk (its header
        unreadable or disagreeing with its length, or of another Redis type) is a miss and
        deleted, another error reply a miss; a fault is a miss of every key, counted as
        any read's."""
        assert self._sync is not None
        self.round_trips += 1
        reads = get_into(self._sync.connection_pool, [self._rk(k) for k in keys],
                         self._staging.acquire, self._staging.release,
                         self.deadline(self._batches.budget(len(keys))))
        if reads.fault is not None:
            self._fault("get", reads.fault, lambda _: None)
        bad = reads.bad()
        for why in bad.values():
            if why is BadValue.ERROR:
                self.stats.count_error("reply_error")
        not_chunks = [keys[i] for i, why in bad.items() if why is not BadValue.ERROR]
        if not_chunks:
            self._guarded("drop", self._drop_corrupt(not_chunks), lambda _: None)
        got = [v if isinstance(v, tuple) else None for v in reads.values]
        sizes = [None if g is None else g[1] for g in got]
        for n in sizes:
            self._batches.saw(n)
        self._account_get(keys, sizes)
        return got

    @property
    def staging(self) -> StagingPool:
        """The reused buffers whole-chunk reads land in (share it with the manager's writes)."""
        return self._staging

    def contains_prefix(self, keys: Sequence[str]) -> int:
        return self._guarded("contains_prefix", self._contains_prefix(keys), lambda _: 0)

    def contains_each(self, keys: Sequence[str]) -> list[bool]:
        return self._guarded("contains_each", self._contains_each(keys),
                             lambda _: [False] * len(keys))

    def stored_sizes(self, keys: Sequence[str]) -> list[int | None]:
        """Each value's length (``STRLEN``, one pipelined round trip for all ``keys``): what
        a read of it would lend, so a batch is budgeted by its real sizes rather than a
        ceiling per key. An upper bound only: a value whose header disagrees is a miss when
        it is read. None where nothing is stored, a value of another type, or Redis down."""
        return self._guarded("sizes", self._sizes(keys), lambda _: [None] * len(keys))

    def delete(self, keys: Sequence[str]) -> int:
        return self._guarded("delete", self._delete(keys), lambda _: 0)

    def _all_missed(self, keys: Sequence[str]) -> Callable[[str], list[bytes | None]]:
        def missed(_: str) -> list[bytes | None]:
            with self.stats.lock:
                self.stats.gets += len(keys)
                self.stats.misses += len(keys)
            return [None] * len(keys)

        return missed

    # --- tenants ---------------------------------------------------------------------
    def namespace_held(self, namespace: str, keys: Sequence[str] = ()) -> tuple[int, set[str]]:
        return self._usage.held(namespace, keys)

    def namespace_bytes(self) -> dict[str, int]:
        return self._usage.by_namespace()

    def evict_namespace(self, namespace: str, need: int, exclude: Collection[str] = ()) -> int:
        """Delete ``namespace``'s least recently used chunks (of those this instance
        stored) until ``need`` bytes are freed: the last tier, nothing to hand down."""
        victims = self._usage.coldest(namespace, need, exclude)
        if not victims:
            return 0
        before = self.namespace_held(namespace)[0]
        self.delete(victims)
        for key in victims:
            self._notify_evicted(key, None)
        return before - self.namespace_held(namespace)[0]

    # --- capacity ---------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int | None:
        """As configured; Redis itself enforces its ``maxmemory`` policy."""
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """Bytes this instance stored minus those it deleted (approximate: Redis-side TTL
        expiry, eviction and other writers are not seen)."""
        return self._usage.gauges()[1]

    def gauges(self) -> tuple[int, int]:
        """Chunks and bytes this instance stored minus those it deleted: counters, never a
        SCAN (what Redis expired or evicted, or other writers stored, is not seen)."""
        return self._usage.gauges()

    def __len__(self) -> int:
        """Keys under ``prefix`` on the server(s), by SCAN: exact but O(keys); 0 if down."""
        return self._guarded("len", self._count_keys(), lambda _: 0)

    def info(self) -> dict[str, object]:
        return {
            "url": self.url, "cluster": self.cluster, "prefix": self.prefix,
            "ttl_ms": self.ttl_ms, "timeout_s": self.timeout_s, "hiredis": HIREDIS_AVAILABLE,
            "round_trips": self.round_trips,
        }

    # --- shutdown ---------------------------------------------------------------------
    def close(self) -> None:
        """Close the pool and stop the loop; bounded even if the server is down or hung."""
        if self._closed:
            return
        self._closed = True
        self._conn.close()
        if self._own_staging:
            self._staging.close()
