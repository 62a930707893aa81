"""LMCache 0.5.6 storing and retrieving KV, end to end from KV tensors to KV tensors.

The LMCache side of ``kvtier bench peers``. LMCache pins numpy <= 2.2.6, so it lives in
its own environment (``.venv-lmcache``) and ``lmcache`` is imported only inside the
functions here; its engine is a process-wide singleton and its teardown crashes on
CPU-only machines, so the benchmark runs :func:`main` once per backend in a subprocess,
which prints one ``RESULT {json}`` line and leaves with ``os._exit(0)``.

What is timed, per backend (``engine.store`` / ``engine.retrieve``, one call per session,
each session its own token ids so no prefix is shared):

- ``cpu``: LMCache's local CPU backend (``local_cpu: True``). A store copies each chunk
  into a memory object of LMCache's pool and keeps it in the hot cache; a retrieve copies
  it back out. Both are synchronous.
- ``disk``: its local disk backend, ``local_cpu: False`` so nothing stays in the CPU
  tier (the pool is only staging). A store returns once the chunks are copied into the
  pool and queued to the disk writer threads; the clock stops when every chunk is
  visible in the disk backend, which happens after its file is written. LMCache never
  fsyncs; its only knob on durability is ``extra_config.use_odirect`` (O_DIRECT
  ``open``/``write``: the bytes go to the device, bypassing the page cache, but there
  is no fsync of the file or the directory, nor a device-cache flush). It is on by
  default here (``disk_odirect``) as the closest LMCache gets to kvtier's write + fsync.
  ``store_fsync_s`` also times the same store made durable: after it, every file and
  directory LMCache wrote is fsynced (what kvtier's disk tier does before a chunk counts).
  Before the retrieve, ``os.sync()`` then ``POSIX_FADV_DONTNEED`` on every file of the
  disk directory, so the read is cold.
- ``redis``: its Redis remote backend (``remote_url: redis://...``, ``remote_serde:
  naive``, ``local_cpu: False``). Puts are asynchronous; the clock stops when every
  chunk's metadata key (written after its data key) exists in Redis. redis-py's socket
  timeout (5 s by default in redis-py 8) and LMCache's ``blocking_timeout_secs`` are
  raised to 120 s: with the defaults, 32 MiB SETs queued on a 2-core machine time out
  and LMCache silently drops those chunks.

"Visible" is checked with ``engine.lookup(tokens, search_range=[backend])``; before a
retrieve the module checks that the CPU tier holds nothing of the session (disk, redis)
so the bytes really come from the backend measured.

The KV is ``[2, layers, tokens, kv_heads * head_dim]`` (LMCache's ``KV_2LTD`` memory
format, what its memory objects hold per chunk), a CPU tensor; the "GPU connector" is a
CPU copy between that tensor and LMCache's memory objects.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

BACKENDS = ("cpu", "disk", "redis")
_LOCATION = {"cpu": "LocalCPUBackend", "disk": "LocalDiskBackend", "redis": "RemoteBackend"}
_TOKEN_STRIDE = 1_000_000  # session s, repeat r: tokens start at (r*sessions+s)*stride


def cpu_copy_connector(shape_tail: tuple[int, int]) -> type:
    """A ``GPUConnectorInterface`` that copies between LMCache's memory objects and the
    CPU tensor passed as ``kvcaches`` (a ``[2, L, T, H*D]`` view). Built lazily because
    the base class lives in lmcache."""
    from lmcache.v1.gpu_connector import GPUConnectorInterface

    layers, hidden = shape_tail

    class CPUCopyConnector(GPUConnectorInterface):
        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, layers, num_tokens, hidden])

        def from_gpu(self, memory_obj, start, end, **kw):
            memory_obj.tensor.copy_(kw["kvcaches"][:, :, start:end, :])

        def to_gpu(self, memory_obj, start, end, **kw):
            kw["kvcaches"][:, :, start:end, :].copy_(memory_obj.tensor)

        def batched_from_gpu(self, memory_objs, starts, ends, **kw):
            for m, s, e in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(m, s, e, **kw)

        def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kw):
            for m, s, e in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(m, s, e, **kw)

    return CPUCopyConnector


def _overrides(backend: str, workdir: str, redis_url: str | None, chunk_tokens: int,
               pool_gib: float, disk_gib: float, disk_odirect: bool) -> dict[str, Any]:
    """LMCache config per backend. ``max_local_cpu_size`` (GiB) is LMCache's memory-object
    pool: the CPU tier itself for ``cpu``, staging for puts and gets otherwise; it holds
    all the KV so LMCache is never throttled by it. ``force_store_wait`` makes a store
    wait for pool space instead of dropping chunks."""
    cfg: dict[str, Any] = {
        "chunk_size": chunk_tokens,
        "max_local_cpu_size": pool_gib,
        "save_unfull_chunk": False,
        "extra_config": {"force_store_wait": True},
    }
    if backend == "cpu":
        cfg.update(local_cpu=True)
    elif backend == "disk":
        cfg.update(local_cpu=False, local_disk=os.path.join(workdir, "disk"),
                   max_local_disk_size=disk_gib)  # fmt: skip
        cfg["extra_config"]["use_odirect"] = disk_odirect
    elif backend == "redis":
        if not redis_url:
            raise ValueError("backend 'redis' needs redis_url")
        cfg.update(local_cpu=False, remote_url=_with_socket_timeout(redis_url, 120),
                   remote_serde="naive", blocking_timeout_secs=120)  # fmt: skip
    else:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    return cfg


def _with_socket_timeout(url: str, seconds: int) -> str:
    """redis-py 8's default 5 s socket timeout trips on 32 MiB SETs queued behind each
    other on a small machine; LMCache then only logs "batched put error: Timeout writing
    to socket" and the chunk is never stored. A ``socket_timeout`` already in the URL
    wins."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query.setdefault("socket_timeout", str(seconds))
    return urlunsplit(parts._replace(query=urlencode(query)))


def _prefault_pool(engine: Any) -> bool:
    """Touch every page of LMCache's pool once. On a GPU host the pool is pinned memory,
    faulted in when LMCache starts; on a CPU-only host it is a plain ``torch.empty`` whose
    first touch would otherwise land inside the first timed store."""
    allocator = getattr(engine.storage_manager.allocator_backend, "memory_allocator", None)
    buf = getattr(allocator, "buffer", None)
    if not isinstance(buf, torch.Tensor):
        return False
    buf.fill_(0)
    return True


def _wait_visible(engine: Any, tokens: list[torch.Tensor], location: str,
                  stall_s: float) -> None:
    """Block until every session is fully visible in ``location``: disk and Redis puts
    finish in LMCache's background threads after ``store`` returns. A put that fails is
    only logged by LMCache, so give up once nothing new has become visible for
    ``stall_s`` seconds."""
    last, progress_at = -1, time.monotonic()
    for t in tokens:
        while (seen := engine.lookup(t, search_range=[location])) < len(t):
            if seen != last:
                last, progress_at = seen, time.monotonic()
            elif time.monotonic() - progress_at > stall_s:
                raise TimeoutError(f"stores stalled in {location} for {stall_s}s at "
                                   f"{seen}/{len(t)} tokens of a session (see LMCache's log)")
            time.sleep(0.001)
        last = -1


def _drop_page_cache(directory: str) -> int:
    """``os.sync()`` then ``POSIX_FADV_DONTNEED`` on every file under ``directory`` (we are
    not root, so no ``drop_caches``); returns the number of files."""
    os.sync()
    n = 0
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            n += 1
    return n


def _fsync_tree(directory: str) -> None:
    """fsync every file under ``directory``, then every directory: what LMCache's disk
    backend would need to call for its stored chunks to survive a power loss (it never
    does; kvtier's disk tier syncs each file and directory before a chunk counts)."""
    dirs = []
    for root, _, files in os.walk(directory):
        dirs.append(root)
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in dirs:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _delete_redis_keys(redis_url: str, prefix: str) -> None:
    """LMCache's Redis connector has no remove: delete this run's keys (every key starts
    with the model name, unique per call) so repeats and later runs start empty."""
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        keys = list(r.scan_iter(f"{prefix}@*", count=1000))
        for i in range(0, len(keys), 1000):
            r.delete(*keys[i:i + 1000])
    finally:
        r.close()


def lmcache_store_retrieve(kv: torch.Tensor, tokens_per_session: int, sessions: int,
                           backend: str, workdir: str, redis_url: str | None,
                           chunk_tokens: int = 256, repeats: int = 1,
                           disk_odirect: bool = True, stall_s: float = 300.0,
                           warmup: bool = True) -> dict:
    """Store every session's KV with LMCache, then retrieve it into zeros, timed.

    ``kv``: a CPU tensor ``[2, layers, sessions * tokens_per_session, kv_heads * head_dim]``
    (any dtype; bf16 in the benchmark); session ``s`` is ``kv[:, :, s*T:(s+1)*T]``.
    ``backend``: ``"cpu"``, ``"disk"`` or ``"redis"`` (see the module docstring for the
    config of each). ``workdir``: where the disk backend writes (``workdir/disk``).
    ``repeats``: whole store + retrieve rounds, each on fresh token ids and with the
    previous round's entries removed; the best time of each is kept. ``disk_odirect``:
    LMCache's ``use_odirect`` for the disk backend. ``stall_s``: give up (TimeoutError)
    when a store makes no progress for that long (LMCache only logs failed puts).
    ``warmup``: first push one chunk through store and retrieve, untimed, so the first
    timed call does not carry LMCache's one-time costs (each run is a fresh process).

    Returns ``{"store_s", "retrieve_s", "bytes", "bit_exact", "notes", ...}``: seconds to
    store all sessions (until all are visible in the backend) and to retrieve all (disk:
    cold); payload bytes each way; whether every retrieve's mask was all True and the
    destination equals ``kv`` bit for bit. One engine per process: call it once per
    process (LMCache's engine and its stats are process-wide singletons).
    """
    if tokens_per_session % chunk_tokens:
        raise ValueError("tokens_per_session must be a multiple of chunk_tokens")
    two, layers, total_tokens, hidden = kv.shape
    if two != 2 or total_tokens != sessions * tokens_per_session:
        raise ValueError(f"kv shape {tuple(kv.shape)} is not [2, L, sessions*T, H*D]")
    kv = kv.contiguous()
    gib = kv.numel() * kv.element_size() / 1024**3
    os.makedirs(workdir, exist_ok=True)
    run = _open(kv, backend, workdir, redis_url, chunk_tokens, gib, repeats, disk_odirect)
    if warmup:  # one chunk through store, wait, retrieve: first-call costs off the clock
        t = torch.arange(chunk_tokens, dtype=torch.long) + (repeats * sessions) * _TOKEN_STRIDE
        run.engine.store(t, kvcaches=kv[:, :, :chunk_tokens])
        _wait_visible(run.engine, [t], run.location, stall_s)
        run.engine.retrieve(t, kvcaches=torch.zeros_like(kv[:, :, :chunk_tokens]))
        run.forget([t])
    rounds = [_round(run, kv, r, sessions, tokens_per_session, chunk_tokens, stall_s)
              for r in range(repeats)]
    notes = _notes(run, rounds[-1], warmup, repeats)
    durable = [x.durable_s for x in rounds if x.durable_s is not None]
    return {"store_s": min(x.store_s for x in rounds),
            "retrieve_s": min(x.retrieve_s for x in rounds),
            "bytes": kv.numel() * kv.element_size(),
            "bit_exact": all(x.exact for x in rounds), "notes": "; ".join(notes),
            "backend": backend, "store_runs_s": [x.store_s for x in rounds],
            "retrieve_runs_s": [x.retrieve_s for x in rounds],
            "disk_odirect": rounds[-1].odirect_used,
            "store_fsync_s": min(durable) if durable else None}  # fmt: skip


@dataclass
class _Run:
    """One LMCache engine on one backend, and what its rounds need of it."""

    engine: Any
    backend: str
    location: str
    model: str
    redis_url: str | None
    overrides: dict
    pool_gib: float
    prefaulted: bool

    @property
    def backends(self) -> dict:
        return self.engine.storage_manager.storage_backends

    def forget(self, toks: list[torch.Tensor]) -> None:
        """Remove a round's entries from the backend."""
        if self.backend == "redis":
            _delete_redis_keys(self.redis_url, self.model)
        else:
            for t in toks:
                self.engine.clear(t, locations=[self.location])


@dataclass
class _Round:
    store_s: float
    retrieve_s: float
    exact: bool
    durable_s: float | None = None
    cold_files: int = 0
    odirect_used: bool | None = None


def _open(kv: torch.Tensor, backend: str, workdir: str, redis_url: str | None,
          chunk_tokens: int, gib: float, repeats: int, disk_odirect: bool) -> _Run:
    """LMCache's engine for ``backend``, its memory pool pre-faulted."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import load_engine_config_with_overrides
    from lmcache.v1.metadata import LMCacheMetadata

    _, layers, _, hidden = kv.shape
    pool_gib = round(gib * 1.05 + 0.25, 3)
    # LMCache 0.5.6's disk remove() (what engine.clear uses between repeats) deletes the
    # file but never lowers the backend's size count, so the disk limit covers every
    # round; else round 2 evicts its own chunks and never becomes visible.
    overrides = _overrides(backend, workdir, redis_url, chunk_tokens, pool_gib,
                           round(gib * repeats * 1.1 + 0.5, 3), disk_odirect)  # fmt: skip
    model = f"kvtier-peers-{uuid.uuid4().hex[:12]}"  # unique: keys never meet old ones
    metadata = LMCacheMetadata(
        model_name=model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=kv.dtype, kv_shape=(layers, 2, chunk_tokens, 1, hidden),
        chunk_size=chunk_tokens,
    )  # fmt: skip
    engine = LMCacheEngineBuilder.get_or_create(
        model, load_engine_config_with_overrides(overrides=overrides), metadata,
        cpu_copy_connector((layers, hidden))(), lambda t, r: None, lambda o, r: o,
    )  # fmt: skip
    engine.post_init()
    location = _LOCATION[backend]
    backends = engine.storage_manager.storage_backends
    if location not in backends:
        raise RuntimeError(f"LMCache built no {location}: {list(backends)}")
    return _Run(engine, backend, location, model, redis_url, overrides, pool_gib,
                _prefault_pool(engine))


def _round(run: _Run, kv: torch.Tensor, r: int, sessions: int, tokens_per_session: int,
           chunk_tokens: int, stall_s: float) -> _Round:
    """Store every session (fresh token ids), then retrieve every one into zeros (disk:
    cold), timed; the entries removed after."""
    engine, backend, location = run.engine, run.backend, run.location

    def session(s: int) -> slice:
        return slice(s * tokens_per_session, (s + 1) * tokens_per_session)

    toks = [torch.arange(tokens_per_session, dtype=torch.long)
            + (r * sessions + s) * _TOKEN_STRIDE for s in range(sessions)]  # fmt: skip
    t0 = time.perf_counter()
    for s in range(sessions):
        engine.store(toks[s], kvcaches=kv[:, :, session(s)])
    _wait_visible(engine, toks, location, stall_s)
    out = _Round(time.perf_counter() - t0, 0.0, True)
    if backend == "disk":  # what the same store costs made durable, as kvtier's is
        t1 = time.perf_counter()
        _fsync_tree(run.backends[location].path)
        out.durable_s = out.store_s + time.perf_counter() - t1
    if backend != "cpu":  # the bytes must come from the backend, not the CPU tier
        for t in toks:
            if engine.lookup(t, search_range=["LocalCPUBackend"]) != 0:
                raise RuntimeError("the CPU tier holds chunks; retrieve would use it")
    if backend == "disk":
        disk = run.backends[location]
        out.cold_files = _drop_page_cache(disk.path)
        chunk_bytes = kv.numel() * kv.element_size() // sessions // (tokens_per_session // chunk_tokens)
        out.odirect_used = bool(disk.use_odirect) and chunk_bytes % disk.os_disk_bs == 0
    dst = torch.zeros_like(kv)  # allocated (and touched) before the clock starts
    t0 = time.perf_counter()
    masks = [engine.retrieve(toks[s], kvcaches=dst[:, :, session(s)]) for s in range(sessions)]
    out.retrieve_s = time.perf_counter() - t0
    out.exact = all(bool(m.all()) for m in masks) and torch.equal(
        dst.view(torch.uint8), kv.view(torch.uint8))
    del dst
    run.forget(toks)
    return out


def _notes(run: _Run, last: _Round, warmup: bool, repeats: int) -> list[str]:
    notes = [f"LMCache {_version()}; backends {list(run.backends)}; pool {run.pool_gib} GiB"
             + (" (pre-faulted)" if run.prefaulted else "")]  # fmt: skip
    if run.backend == "cpu":
        notes.append("local_cpu hot cache; store and retrieve are synchronous")
    elif run.backend == "disk":
        notes.append(
            f"local_cpu off; disk {run.overrides['local_disk']}, "
            f"{'O_DIRECT writes/reads (no fsync)' if last.odirect_used else 'buffered writes, no fsync'}"
            f"; store timed until every chunk is on disk in the backend's index; retrieve "
            f"cold after os.sync + POSIX_FADV_DONTNEED on {last.cold_files} files")
    else:
        notes.append("local_cpu off; redis SET per chunk (kv_bytes then metadata); store "
                     "timed until every chunk's metadata key exists; redis-py socket_timeout "
                     "and blocking_timeout_secs raised to 120 s")
    if warmup:
        notes.append("one-chunk warm-up before the clock")
    if repeats > 1:
        notes.append(f"best of {repeats}")
    return notes


def _version() -> str:
    import importlib.metadata

    return importlib.metadata.version("lmcache")


def main(argv: list[str] | None = None) -> None:
    """``python -m kvtier.benchmarks.peers_lmcache --backend cpu|disk|redis ...``: random
    bf16 KV of the given shape, one :func:`lmcache_store_retrieve`, one ``RESULT {json}``
    line (an ``error`` key on failure), then ``os._exit(0)`` past LMCache's teardown."""
    p = argparse.ArgumentParser(prog="peers_lmcache", description=main.__doc__)
    p.add_argument("--backend", choices=BACKENDS, required=True)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per session")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--redis-url", default=None)
    p.add_argument("--workdir", default=None, help="default: a temp dir")
    p.add_argument("--disk-buffered", action="store_true",
                   help="disk: LMCache's default buffered writes instead of use_odirect")
    args = p.parse_args(argv)
    try:
        import tempfile

        workdir = args.workdir or tempfile.mkdtemp(prefix="kvtier-peers-lmcache-")
        kv = torch.empty(2, args.layers, args.sessions * args.tokens,
                         args.kv_heads * args.head_dim, dtype=torch.bfloat16)  # fmt: skip
        kv.normal_(generator=torch.Generator().manual_seed(0))  # finite: no NaN != NaN
        result = lmcache_store_retrieve(
            kv, args.tokens, args.sessions, args.backend, workdir, args.redis_url,
            chunk_tokens=args.chunk_tokens, repeats=args.repeats,
            disk_odirect=not args.disk_buffered)  # fmt: skip
        if args.workdir is None:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    except Exception as e:  # one line back to the parent, whatever went wrong
        result = {"error": f"{type(e).__name__}: {e}"}
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
