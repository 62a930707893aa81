"""Redis (or Redis Cluster) as the shared, scale-out tier.

One key per chunk holds the whole chunk (header and payload together), so a chunk is
either wholly visible or absent — never the half-written pair of keys LMCache leaves.
Every batch is one pipelined round trip (per node on a cluster): ``SET NX [EX]`` for a
store, ``MGET`` (pipelined ``GET`` on a cluster) for a lease, ``EXISTS`` per key for
``contains_prefix``; a layer-range lease is two (header probe, then the byte range).

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
import threading
from collections.abc import Callable, Collection, Coroutine, Iterator, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import torch
from redis.utils import HIREDIS_AVAILABLE

from kvtier.chunk_format import byte_view, layer_span, parse_header, slice_chunk
from kvtier.connectors.tiers.base import Blob, ChunkWrite, PutResult, Tier
from kvtier.connectors.tiers.host_buffers import StagingPool
from kvtier.connectors.tiers.namespace_usage import NamespaceUsage
from kvtier.connectors.tiers.redis_bulk import get_into
from kvtier.connectors.tiers.redis_client import (
    CLUSTER_SCHEME,
    FAULTS,
    RedisConnection,
    error_kind,
    is_fault,
    parse_cluster_url,
    reply_failure,
)
from kvtier.errors import ChunkError, InvalidArgumentError

__all__ = ["CLUSTER_SCHEME", "FAULTS", "HEADER_PROBE_BYTES", "RedisTier", "parse_cluster_url"]

log = logging.getLogger(__name__)
T = TypeVar("T")

HEADER_PROBE_BYTES = 4096
"""First bytes read by a layer-range get; covers the header of any chunk up to ~400 layers."""


def _wire(blob: Blob) -> bytes | memoryview:
    """A value redis-py sends as it is (a byte memoryview goes out of the caller's buffer,
    a slot or a staging buffer, with no copy). A put that times out may still be sending
    when the caller reuses the buffer; the value is then torn, and every read checks key
    and checksums, so it is rejected, never served."""
    if isinstance(blob, bytes):
        return blob
    view = memoryview(blob)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


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
        self._chunk_hint = 0
        """The largest chunk seen: what a get of unknown sizes budgets per key (1 MiB
        until a chunk was seen, and no split)."""
        self._capacity = capacity_bytes
        self._used = 0
        self._count = 0
        """Chunks this instance stored minus those it deleted (for metrics, no SCAN)."""
        self._used_lock = threading.Lock()
        self._namespaces = NamespaceUsage()
        """Tenants' chunks this instance stored (quotas, per-tenant gauges; under
        ``_used_lock``): what Redis expired or evicted leaves when a read misses it."""
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

    def _set_batch(self, keys: Sequence[str], chunks: Mapping[str, Blob]) -> list[Any]:
        assert self._sync is not None
        pipe = self._sync.pipeline(transaction=False)
        for k in keys:
            pipe.set(self._rk(k), _wire(chunks[k]), nx=True, px=self.ttl_ms)
            if self.ttl_ms is not None:
                pipe.pexpire(self._rk(k), self.ttl_ms)  # a re-put keeps a live chunk alive
        return pipe.execute(raise_on_error=False)

    # --- async operations (run on the tier's loop) --------------------------------------
    async def _put(self, chunks: Mapping[str, Blob]) -> PutResult:
        result = PutResult()
        if not chunks:
            return result
        keys = list(chunks)
        if self._sync is not None:
            self.round_trips += 1
            replies = await self._conn.blocking(self._set_batch, keys, chunks)
        else:
            pipe = self._pipeline()
            for k in keys:
                pipe.set(self._rk(k), _wire(chunks[k]), nx=True, px=self.ttl_ms)
                if self.ttl_ms is not None:
                    pipe.pexpire(self._rk(k), self.ttl_ms)  # a re-put keeps a live chunk alive
            replies = await pipe.execute(raise_on_error=False)
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
        self._add_used(written, len(result.stored))
        with self._used_lock:
            for k in result.stored:
                self._namespaces.add(k, self.occupancy(len(chunks[k])))
        return result

    async def _get(self, keys: Sequence[str], layers: tuple[int, int] | None
                   ) -> list[bytes | None]:
        """The values (or layer ranges framed as chunks), unverified: the stack checks
        them. One whose header cannot be parsed is dropped here."""
        if not keys:
            return []
        if layers is None:
            out = await self._get_whole(keys)
        else:
            out, corrupt = await self._get_layers(keys, layers)
            if corrupt:
                await self._drop_corrupt(corrupt)
        self._account_get(keys, [None if b is None else len(b) for b in out])
        return out

    def _account_get(self, keys: Sequence[str], sizes: Sequence[int | None]) -> None:
        """Stats and tenant usage after a read: ``sizes`` per key, None for a miss."""
        hits = sum(n is not None for n in sizes)
        with self._used_lock:
            for k, n in zip(keys, sizes, strict=True):
                if n is None:
                    self._namespaces.remove(k)  # expired, evicted by Redis, or corrupt
                else:
                    self._namespaces.touch(k)
        with self.stats.lock:
            self.stats.gets += len(keys)
            self.stats.hits += hits
            self.stats.misses += len(keys) - hits
            self.stats.bytes_read += sum(n for n in sizes if n is not None)

    async def _get_whole(self, keys: Sequence[str]) -> list[bytes | None]:
        if self._sync is not None:
            self.round_trips += 1
            return await self._conn.blocking(self._sync.mget, [self._rk(k) for k in keys])
        pipe = self._pipeline()
        for k in keys:
            pipe.get(self._rk(k))
        replies = await pipe.execute(raise_on_error=False)
        self._count_reply_faults(replies)
        return [r if isinstance(r, bytes) else None for r in replies]

    def _count_reply_faults(self, replies: Sequence[object]) -> None:
        for r in replies:
            if is_fault(r):
                self.stats.count_error(error_kind(r))

    async def _get_layers(
        self, keys: Sequence[str], layers: tuple[int, int]
    ) -> tuple[list[bytes | None], dict[str, int]]:
        """Round 1: the first bytes of each value (header); round 2: each layer span."""
        pipe = self._pipeline()
        for k in keys:
            pipe.getrange(self._rk(k), 0, HEADER_PROBE_BYTES - 1)
        probes = await pipe.execute(raise_on_error=False)
        self._count_reply_faults(probes)
        out: list[bytes | None] = [None] * len(keys)
        corrupt: dict[str, int] = {}
        plan: list[tuple[int, Any, int | None]] = []  # (index, header, payload offset or None)
        for i, (k, probe) in enumerate(zip(keys, probes, strict=True)):
            if not isinstance(probe, bytes) or not probe:
                continue  # miss
            try:
                header, offset = parse_header(probe)
            except ChunkError:
                if len(probe) == HEADER_PROBE_BYTES:  # maybe a header longer than the probe
                    plan.append((i, None, None))
                else:
                    corrupt[k] = len(probe)
                continue
            if not 0 <= layers[0] < layers[1] <= header.num_layers:
                continue  # the chunk holds fewer layers than asked: a miss, not corruption
            plan.append((i, header, offset))
        if not plan:
            return out, corrupt
        pipe = self._pipeline()
        for i, header, offset in plan:
            if header is None:
                pipe.get(self._rk(keys[i]))
            else:
                start, length = layer_span(header, layers)
                pipe.getrange(self._rk(keys[i]), offset + start, offset + start + length - 1)
        parts = await pipe.execute(raise_on_error=False)
        self._count_reply_faults(parts)
        for (i, header, _), part in zip(plan, parts, strict=True):
            k = keys[i]
            if not isinstance(part, bytes):
                continue  # deleted or expired between the two round trips
            try:
                if header is None:
                    header, offset = parse_header(part)
                    start, length = layer_span(header, layers)
                    part = part[offset + start : offset + start + length]
                blob = slice_chunk(header, layers, part)
            except ChunkError:
                corrupt[k] = header.payload_nbytes if header is not None else len(part)
                continue
            out[i] = blob
        return out, corrupt

    async def _drop_corrupt(self, corrupt: Mapping[str, int]) -> None:
        pipe = self._pipeline()
        for k in corrupt:
            pipe.delete(self._rk(k))
        await pipe.execute(raise_on_error=False)
        with self.stats.lock:
            self.stats.corrupt += len(corrupt)
        self._add_used(-sum(corrupt.values()), -len(corrupt))

    async def _contains_prefix(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        pipe = self._pipeline()
        for k in keys:
            pipe.exists(self._rk(k))
        replies = await pipe.execute(raise_on_error=False)
        self._count_reply_faults(replies)
        n = 0
        for r in replies:
            if isinstance(r, Exception) or not r:
                break
            n += 1
        return n

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
        with self._used_lock:
            for k in keys:
                self._namespaces.remove(k)
        self._add_used(
            -sum(s for s, d in zip(sizes, dels, strict=True) if d == 1 and isinstance(s, int)),
            -removed,
        )
        return removed

    async def _count_keys(self) -> int:
        n = 0
        async for _ in self._client.scan_iter(match=self._scan_pattern(), count=1000):
            n += 1
        return n

    def _scan_pattern(self) -> str:
        escaped = "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix)
        return escaped + "*"

    def _add_used(self, delta: int, chunks: int = 0) -> None:
        with self._used_lock:
            self._used = max(0, self._used + delta)
            self._count = max(0, self._count + chunks)

    # --- the Tier interface (sync, from any thread) -------------------------------------
    @staticmethod
    def _check_layers(layers: tuple[int, int] | None) -> None:
        if layers is not None and not 0 <= layers[0] < layers[1]:
            raise InvalidArgumentError(f"layers must be (start, end) with 0 <= start < end, got {layers}")

    def _put_batches(self, writes: Sequence[ChunkWrite]) -> list[list[ChunkWrite]]:
        """``writes`` in calls of at most ``max_batch_bytes`` (a bigger chunk goes alone)."""
        batches: list[list[ChunkWrite]] = [[]]
        size = 0
        for write in writes:
            self._chunk_hint = max(self._chunk_hint, write.nbytes)
            if batches[-1] and size + write.nbytes > self.max_batch_bytes:
                batches.append([])
                size = 0
            batches[-1].append(write)
            size += write.nbytes
        return [b for b in batches if b]

    def _get_batches(self, keys: Sequence[str]) -> list[Sequence[str]]:
        if not self._chunk_hint:
            return [keys]
        per = max(1, self.max_batch_bytes // self._chunk_hint)
        return [keys[i : i + per] for i in range(0, len(keys), per)] or [keys]

    def _get_budget(self, n: int) -> int:
        return n * (self._chunk_hint or 1 << 20)

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
        for batch in self._put_batches(todo):
            with contextlib.ExitStack() as held:
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
        for batch in self._get_batches(keys):
            blobs = self._guarded("get", self._get(batch, layers),
                                  self._all_missed(batch), self._get_budget(len(batch)))
            for b in blobs:
                if b is not None:
                    self._chunk_hint = max(self._chunk_hint, len(b))
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
            for batch in self._get_batches(keys):
                got += self._get_into(batch)
            yield [None if g is None else g[0][: g[1]] for g in got]
        finally:
            for g in got:
                if g is not None:
                    self._staging.release(g[0])

    def _get_into(self, keys: Sequence[str]) -> list[tuple[torch.Tensor, int] | None]:
        """Whole chunks read straight into staging buffers (see :mod:`.redis_bulk`), on
        the calling thread; a fault is a miss of every key, counted as any read's."""
        assert self._sync is not None
        self.round_trips += 1
        try:
            got = get_into(self._sync.connection_pool, [self._rk(k) for k in keys],
                           self._staging.acquire, self._staging.release,
                           self.deadline(self._get_budget(len(keys))))
        except FAULTS as exc:
            got = self._fault("get", exc, lambda _: [None] * len(keys))
        sizes = [None if g is None else g[1] for g in got]
        for n in sizes:
            if n is not None:
                self._chunk_hint = max(self._chunk_hint, n)
        self._account_get(keys, sizes)
        return got

    @property
    def staging(self) -> StagingPool:
        """The reused buffers whole-chunk reads land in (share it with the manager's writes)."""
        return self._staging

    def contains_prefix(self, keys: Sequence[str]) -> int:
        return self._guarded("contains_prefix", self._contains_prefix(keys), lambda _: 0)

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
        with self._used_lock:
            return self._namespaces.held(namespace, keys)

    def namespace_bytes(self) -> dict[str, int]:
        with self._used_lock:
            return self._namespaces.snapshot()

    def evict_namespace(self, namespace: str, need: int, exclude: Collection[str] = ()) -> int:
        """Delete ``namespace``'s least recently used chunks (of those this instance
        stored) until ``need`` bytes are freed: the last tier, nothing to hand down."""
        with self._used_lock:
            victims = self._namespaces.coldest(namespace, need, exclude)
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
        with self._used_lock:
            return self._used

    def gauges(self) -> tuple[int, int]:
        """Chunks and bytes this instance stored minus those it deleted: counters, never a
        SCAN (what Redis expired or evicted, or other writers stored, is not seen)."""
        with self._used_lock:
            return self._count, self._used

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
