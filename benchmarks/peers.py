"""``kvtier bench peers``: kvtier and LMCache side by side, in one run, on the same KV.

Both move the same KV (a real model's shape, bf16, sessions of distinct tokens, 256-token
chunks) end to end from KV tensors to a tier and back into KV tensors, and both are
checked bit-exact:

- kvtier: the KV sits in a paged pool; ``KVTransfer.save`` stores each session (gather
  from the pool's blocks, checksum, header, into the tier), then the sessions are evicted
  from the pool and ``KVTransfer.load`` restores them (read, verify, scatter into new
  blocks), which the engine does for an idle session;
- LMCache 0.5.6: ``LMCacheEngine.store`` / ``retrieve`` with ``force_store_wait``, in the
  environment that holds it (``.venv-lmcache``), one subprocess per backend (its engine
  is a process-wide singleton); see :mod:`kvtier.benchmarks.peers_lmcache`.

With the CPU tier, kvtier's vLLM connector moves the same amount of KV laid out as vLLM
keeps it (:mod:`kvtier.benchmarks.peers_vllm`), compared with the engine's own rows.

Next to them, the physical operation on the same bytes, measured in the same run: a torch
copy into memory that already exists (CPU), write + fsync of one file per chunk and a
cold read with 1 and 4 threads (disk), redis-py SET / GET of one value per chunk (Redis).
Ratios are against that reference and against LMCache; where kvtier loses, the table
says so.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.benchmarks.tiers import MODELS, _fadvise_dontneed, _start_redis

TIERS = ("cpu", "disk", "redis")
REPO = Path(__file__).resolve().parent.parent


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "peers",
        help="kvtier vs LMCache store/retrieve per tier, next to the raw medium",
        description="Store and retrieve the same KV with kvtier and with LMCache (CPU, disk "
        "with fsync and a cold read, Redis), end to end from KV tensors to KV tensors, both "
        "checked bit-exact, next to the raw medium measured in the same run.",
    )
    p.add_argument("--model", choices=sorted(MODELS), default="llama-3-8b")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per session")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--tiers", default=",".join(TIERS), help="comma-separated: cpu,disk,redis")
    p.add_argument("--disk-dir", type=Path, default=None, help="default: a temp dir under /tmp")
    p.add_argument("--redis-url", default=None,
                   help="Redis to use; default: a private redis-server started for the run")
    p.add_argument("--lmcache-python", default=str(REPO / ".venv-lmcache" / "bin" / "python"),
                   help="the Python of the environment that holds LMCache ('' to skip it)")
    p.add_argument("--repeats", type=int, default=1, help="runs per row; the best is kept")
    p.add_argument("--buffered", dest="o_direct", action="store_false",
                   help="kvtier's disk tier through the page cache (default: O_DIRECT, as "
                   "LMCache's disk backend runs here)")
    p.add_argument("--no-connector", dest="connector", action="store_false",
                   help="skip the vLLM connector rows (with the CPU tier)")
    p.add_argument("--codecs", default="",
                   help="also kvtier's disk and Redis tiers keeping chunks encoded (fp8,int8,"
                        "int4): KV delivered per second against the uncompressed tier, same run "
                        "(the KV's NaN and infinite bit patterns zeroed first: codecs take "
                        "finite KV)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    p.set_defaults(func=run)


# --------------------------------------------------------------------------- the KV
@dataclass
class _Owner:
    """The pool and fingerprint the data path serves (the engine's model runner, minus
    the model: what ``KVTransfer`` needs of it, see ``PoolOwner``)."""

    pool: Any
    fingerprint: bytes
    layer_loads: list = field(default_factory=list)

    def add_layer_load(self, load: Any) -> None:
        self.layer_loads.append(load)

    def reap_layer_loads(self, wait: bool = False) -> None:
        self.layer_loads.clear()


def _sessions(args: argparse.Namespace) -> list[list[int]]:
    return [list(range(s * 10_000_000, s * 10_000_000 + args.tokens)) for s in range(args.sessions)]


def _make_pool(args: argparse.Namespace) -> _Owner:
    """A CPU pool holding every session's KV (random bf16), computed and cached, and a
    copy of the pool to check restores against."""
    import torch

    from kvtier.gpu_pool.kv_storage import KVStorage
    from kvtier.gpu_pool.paged_pool import PagedKVPool

    layers, heads, dim, _ = MODELS[args.model]
    bs = 16
    blocks = args.sessions * -(-args.tokens // bs) * 2 + 8  # room to restore beside the originals
    storage = KVStorage(layers, blocks, bs, heads, dim, torch.bfloat16, "cpu")
    g = torch.Generator().manual_seed(0)
    flat = storage.kv.view(torch.int16).view(-1)
    step = 1 << 26
    for i in range(0, flat.numel(), step):  # random bits (compared as bits: some are NaN)
        part = flat[i : i + step]
        part.copy_(torch.randint(-(1 << 14), 1 << 14, part.shape, generator=g, dtype=torch.int16))
    owner = _Owner(PagedKVPool(storage), b"bench-peers-fp")
    for s, tokens in enumerate(_sessions(args)):
        owner.pool.add_sequence(f"s{s}", tokens, owner.fingerprint)
        owner.pool.mark_computed(f"s{s}", len(tokens))
    return owner


def _session_kv(owner: _Owner, tokens: list[int]):
    from kvtier.gpu_pool.kernels import gather_blocks

    ids = owner.pool.manager.match_prefix(tokens, owner.fingerprint)
    return gather_blocks(owner.pool.storage.kv, ids, num_tokens=len(ids) * owner.pool.block_size)


# ------------------------------------------------------------------------ kvtier side
def _kvtier_tier(name: str, args: argparse.Namespace, workdir: Path, redis_url: str | None,
                 chunk_bytes: int, codec: str = "none"):
    from kvtier.kv_codecs import Codec

    tier = _kvtier_medium(name, args, workdir, redis_url, chunk_bytes)
    tier.codec = Codec.parse(codec)
    return tier


def _kvtier_medium(name: str, args: argparse.Namespace, workdir: Path, redis_url: str | None,
                   chunk_bytes: int):
    from kvtier.chunk_format import max_chunk_bytes
    from kvtier.connectors.tiers.cpu_tier import CPUTier
    from kvtier.connectors.tiers.disk_tier import DiskTier
    from kvtier.connectors.tiers.host_buffers import round_up
    from kvtier.connectors.tiers.redis_tier import RedisTier

    chunks = args.sessions * -(-args.tokens // args.chunk_tokens)
    if name == "cpu":
        layers = MODELS[args.model][0]
        slot = round_up(max_chunk_bytes(layers, chunk_bytes))
        return CPUTier(slot * chunks, slot)
    if name == "disk":
        return DiskTier(workdir / "kvtier-disk", fsync=True, o_direct=args.o_direct)
    assert redis_url is not None
    return RedisTier(redis_url, prefix="kvtier-peers:", timeout_s=30.0, op_timeout_s=600.0)


def _kvtier_run(name: str, args: argparse.Namespace, owner: _Owner, expected: list[Any],
                workdir: Path, redis_url: str | None, codec: str = "none") -> dict[str, Any]:
    """Store every session, make the tier cold (disk), evict them from the pool, restore
    them, check bit-exact (within the codec's bound for a lossy ``codec``)."""

    from kvtier.connectors.tiers.manager import TierManager
    from kvtier.transfer.kv_transfer import KVTransfer

    sessions = _sessions(args)
    chunk_bytes = owner.pool.storage.bytes_per_token * args.chunk_tokens
    tier = _kvtier_tier(name, args, workdir, redis_url, chunk_bytes, codec)
    manager = TierManager([tier], fingerprint=owner.fingerprint,
                          staging=getattr(tier, "staging", None))
    xfer = KVTransfer(owner, manager, args.chunk_tokens, stream=False)
    _warm_staging(getattr(tier, "staging", None), chunk_bytes, args)
    try:
        t0 = time.perf_counter()
        reports = [xfer.save(tokens, 0, f"s{s}") for s, tokens in enumerate(sessions)]
        store_s = time.perf_counter() - t0
        stored = all(r.tokens == args.tokens for r in reports)
        if name == "disk":
            os.sync()
            _fadvise_dontneed(sorted((workdir / "kvtier-disk").rglob("*.kvc")))
        for s, tokens in enumerate(sessions):
            owner.pool.free_sequence(f"s{s}")
            xfer.evict(tokens)
        t0 = time.perf_counter()
        loads = [xfer.load(tokens) for tokens in sessions]
        retrieve_s = time.perf_counter() - t0
        restored = all(r.from_tiers == args.tokens for r in loads)
        exact = stored and restored and all(  # bit patterns: random bits include NaNs
            _restored_as_stored(_session_kv(owner, tokens), want, codec)
            for tokens, want in zip(sessions, expected, strict=True)
        )
        for s, tokens in enumerate(sessions):  # hold them again for the next tier
            owner.pool.add_sequence(f"s{s}", tokens, owner.fingerprint)
            owner.pool.mark_computed(f"s{s}", len(tokens))
        payload = sum(r.bytes for r in loads)
        return {"store_s": store_s, "retrieve_s": retrieve_s, "bytes": payload, "bit_exact": exact}
    finally:
        xfer.close()
        if name == "redis":
            _redis_flush(redis_url, "kvtier-peers:*")
        manager.close()
        shutil.rmtree(workdir / "kvtier-disk", ignore_errors=True)  # every run starts empty


def _restored_as_stored(got: Any, want: Any, codec: str) -> bool:
    """Bit for bit (uncompressed), or every value within the codec's bound of the largest."""
    import torch

    from kvtier.kv_codecs import ERROR_BOUND, Codec

    if codec == "none":
        return torch.equal(got.view(torch.int16), want.view(torch.int16))
    err = (got.float() - want.float()).abs().amax()
    # twice the bound: random bits reach the dtype's largest values, which round toward zero
    return bool(err <= 2 * ERROR_BOUND[Codec(codec)] * want.float().abs().amax())


def _put_back(owner: _Owner, sessions: list[list[int]], kvs: list[Any]) -> None:
    """The sessions' blocks hold ``kvs`` again (a lossy restore left decoded KV there)."""
    from kvtier.gpu_pool.kernels import scatter_blocks

    for tokens, kv in zip(sessions, kvs, strict=True):
        ids = owner.pool.manager.match_prefix(tokens, owner.fingerprint)
        scatter_blocks(kv, owner.pool.storage.kv, ids)


def _codec_rows(name: str, args: argparse.Namespace, owner: _Owner, workdir: Path,
                redis_url: str | None, console: Any) -> list[dict[str, Any]]:
    """kvtier's ``name`` tier keeping chunks encoded by each of ``--codecs``, against the
    same tier uncompressed, in interleaved rounds (best kept): KV delivered per second."""
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip() and c.strip() != "none"]
    sessions = _sessions(args)
    expected = [_session_kv(owner, tokens).clone() for tokens in sessions]
    nbytes = sum(e.numel() * e.element_size() for e in expected)
    best: dict[str, dict[str, Any]] = {}
    for r in range(1, max(1, args.repeats) + 1):
        console.print(f"[bold]{name}[/bold] codecs round {r}: none, {', '.join(codecs)} ...")
        for codec in ("none", *codecs):
            got = _kvtier_run(name, args, owner, expected, workdir, redis_url, codec)
            best[codec] = _keep_best(best.get(codec), got)
            _put_back(owner, sessions, expected)  # the next run stores the original KV
    rows = []
    for codec in codecs:
        for op in ("store", "retrieve"):
            key = f"{op}_s"
            kv = nbytes / best[codec][key] / 1e9
            none = nbytes / best["none"][key] / 1e9
            rows.append({"tier": name, "op": op, "codec": codec, "kv_GBps": round(kv, 3),
                         "none_kv_GBps": round(none, 3), "vs_none": round(kv / none, 3),
                         "within_bound": bool(best[codec]["bit_exact"])})
    return rows


def _warm_staging(staging: Any, chunk_bytes: int, args: argparse.Namespace) -> None:
    """Fault in the staging buffers a session's restore (and a store's batches in flight)
    use, before the clock: a running server has them from its first transfers, and LMCache's
    side pre-faults its memory pool the same way. Buffers are kept up to the pool's idle
    cap, so this is what a warm process holds."""
    if staging is None:
        return
    n = -(-args.tokens // args.chunk_tokens) + 8
    room = chunk_bytes + 4096  # header and page rounding: the chunk's buffer size class
    bufs = [staging.acquire(room) for _ in range(n)]
    for b in bufs:
        staging.release(b)


def _redis_flush(url: str | None, pattern: str) -> None:
    import redis

    r = redis.Redis.from_url(url)
    keys = list(r.scan_iter(pattern, count=1000))
    if keys:
        r.delete(*keys)


# ------------------------------------------------------------------------ LMCache side
def _lmcache_run(name: str, args: argparse.Namespace, workdir: Path, redis_url: str | None
                 ) -> dict[str, Any] | None:
    """LMCache on the same sizes, in its own environment and process."""
    if not args.lmcache_python or not Path(args.lmcache_python).exists():
        return None
    layers, heads, dim, _ = MODELS[args.model]
    cmd = [args.lmcache_python, "-m", "kvtier.benchmarks.peers_lmcache", "--backend", name,
           "--layers", str(layers), "--kv-heads", str(heads), "--head-dim", str(dim),
           "--tokens", str(args.tokens), "--sessions", str(args.sessions),
           "--chunk-tokens", str(args.chunk_tokens), "--workdir", str(workdir / "lmcache"),
           "--repeats", "1"]  # one round: the caller interleaves rounds with kvtier's
    if redis_url:
        cmd += ["--redis-url", redis_url]
    shutil.rmtree(workdir / "lmcache", ignore_errors=True)  # every run starts empty
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


# --------------------------------------------------------------------- the raw medium
def _raw_cpu(src: Any) -> dict[str, float]:
    import torch

    dst = torch.empty_like(src)
    dst.copy_(src)  # touch every page first: the reference copies into memory that exists
    t0 = time.perf_counter()
    dst.copy_(src)
    s = time.perf_counter() - t0
    return {"store_s": s, "retrieve_s": s}


def _raw_disk(src: Any, chunk_bytes: int, workdir: Path) -> dict[str, float]:
    """write + fsync of one file per chunk, then cold reads of them with 1 and 4 threads
    into memory that exists. Each kind of read gets files written anew just before it (as
    kvtier's and LMCache's restores read what their stores just wrote): on a VM whose host
    caches the disk, a second read of the same files is no longer cold."""
    import torch

    d = workdir / "raw-disk"
    d.mkdir(parents=True, exist_ok=True)
    data = memoryview(src.view(torch.uint8).view(-1).numpy())
    n = len(data) // chunk_bytes
    paths = [d / f"{i}.bin" for i in range(n)]

    def write_all() -> float:
        t0 = time.perf_counter()
        for i, p in enumerate(paths):
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = data[i * chunk_bytes : (i + 1) * chunk_bytes]
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done:])
                os.fsync(fd)
            finally:
                os.close(fd)
        return time.perf_counter() - t0

    store_s = write_all()
    times = _cold_reads(paths, chunk_bytes, write_all)
    shutil.rmtree(d, ignore_errors=True)
    return {"store_s": store_s, "retrieve_s": min(times["4"], times["4direct"]),
            "retrieve_1thread_s": times["1"], "retrieve_buffered_s": times["4"],
            "retrieve_direct_s": times["4direct"]}


def _cold_reads(paths: list[Path], chunk_bytes: int, write_all: Any) -> dict[str, float]:
    """Seconds to read every file cold into memory that exists: with 1 thread, 4 threads
    and 4 threads with O_DIRECT, files written anew (``write_all``) before each kind."""
    import torch

    n = len(paths)
    dst = torch.empty(n * chunk_bytes, dtype=torch.uint8)
    dst.fill_(0)
    out = memoryview(dst.numpy())

    def read(i: int) -> None:
        with open(paths[i], "rb", buffering=0) as f:
            f.readinto(out[i * chunk_bytes : (i + 1) * chunk_bytes])

    aligned = mmap.mmap(-1, n * chunk_bytes)  # page-aligned, for O_DIRECT
    direct_out = memoryview(aligned)
    direct_out[:] = bytes(len(direct_out))  # touched: memory that exists

    def read_direct(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            view, done = direct_out[i * chunk_bytes : (i + 1) * chunk_bytes], 0
            while done < chunk_bytes:
                got = os.preadv(fd, [view[done:]], done)
                if got <= 0:
                    raise OSError(f"short read of {paths[i]}")
                done += got
        finally:
            os.close(fd)

    times = {}
    for name, threads, fn in (("1", 1, read), ("4", 4, read), ("4direct", 4, read_direct)):
        if times:
            write_all()  # fresh files for every kind of read
        os.sync()
        _fadvise_dontneed(paths)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fn, range(n)))
        times[name] = time.perf_counter() - t0
    direct_out.release()
    aligned.close()
    return times


def _raw_redis(src: Any, chunk_bytes: int, url: str) -> dict[str, float]:
    """redis-py SET then GET of one value per chunk (hiredis parser where installed)."""
    import redis
    import torch

    r = redis.Redis.from_url(url, socket_timeout=600)
    data = memoryview(src.view(torch.uint8).view(-1).numpy())
    n = len(data) // chunk_bytes
    t0 = time.perf_counter()
    for i in range(n):
        r.set(f"raw:{i}", data[i * chunk_bytes : (i + 1) * chunk_bytes])
    store_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = [r.get(f"raw:{i}") for i in range(n)]
    retrieve_s = time.perf_counter() - t0
    ok = all(g is not None and len(g) == chunk_bytes for g in got)
    del got
    r.delete(*[f"raw:{i}" for i in range(n)])
    if not ok:
        raise RuntimeError("raw redis GET returned short values")
    return {"store_s": store_s, "retrieve_s": retrieve_s}


RAW_WHAT = {
    ("cpu", "store"): "torch copy into existing memory",
    ("cpu", "retrieve"): "torch copy into existing memory",
    ("disk", "store"): "write + fsync, one file per chunk, 1 thread",
    ("disk", "retrieve"): "cold read into existing memory, 4 threads (best of buffered and O_DIRECT)",
    ("redis", "store"): "redis-py SET per chunk",
    ("redis", "retrieve"): "redis-py GET per chunk",
}


# ----------------------------------------------------------------------------- run
def _keep_best(best: dict[str, Any] | None, got: dict[str, Any]) -> dict[str, Any]:
    """The quicker of two runs, time by time (``*_s``); bit-exact only if both were."""
    if best is None or "error" in best:
        return got
    if "error" in got:
        return best
    for k, v in got.items():
        if k.endswith("_s") and v is not None:
            best[k] = v if best.get(k) is None else min(best[k], v)
    best["bit_exact"] = best.get("bit_exact", True) and got.get("bit_exact", True)
    return best


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from kvtier.errors import InvalidArgumentError

    torch.manual_seed(0)
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    unknown = set(tiers) - set(TIERS)
    if unknown:
        raise InvalidArgumentError(f"unknown tiers {sorted(unknown)}; choose from {', '.join(TIERS)}")
    if args.sessions < 1 or args.tokens < args.chunk_tokens or args.tokens % args.chunk_tokens:
        raise InvalidArgumentError("--sessions must be >= 1 and --tokens a multiple of --chunk-tokens")
    console = Console() if Console().is_terminal else Console(width=160)
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-peers-", dir=args.disk_dir))
    started = None
    redis_url = args.redis_url
    if "redis" in tiers and redis_url is None:
        started = _start_redis()
        redis_url = started[1] if started else None
        if redis_url is None:
            console.print("redis: no redis-server (install it or pass --redis-url); skipped")
            tiers.remove("redis")
    rows: list[dict[str, Any]] = []
    codec_rows: list[dict[str, Any]] = []
    try:
        owner = _make_pool(args)
        sessions = _sessions(args)
        expected = [_session_kv(owner, tokens).clone() for tokens in sessions]
        src = torch.cat([e.reshape(-1) for e in expected])
        chunk_bytes = owner.pool.storage.bytes_per_token * args.chunk_tokens
        for name in tiers:
            rows += _tier_rows(name, args, owner, expected, src, workdir, redis_url, console)
        if args.codecs.strip():
            owner.pool.storage.kv.nan_to_num_(0.0, 0.0, 0.0)  # codecs take finite KV
            for name in (t for t in tiers if t != "cpu"):
                codec_rows += _codec_rows(name, args, owner, workdir, redis_url, console)
    finally:
        if started:
            started[0].kill()
            started[0].wait()
            shutil.rmtree(started[2], ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    _print(console, rows, args)
    _print_codecs(console, codec_rows)
    config = {"model": args.model, "sessions": args.sessions, "tokens": args.tokens,
              "chunk_tokens": args.chunk_tokens, "dtype": "bfloat16",
              "chunk_bytes": chunk_bytes, "total_bytes": int(src.numel() * src.element_size()),
              "lmcache": _lmcache_version(args)}
    if args.out:
        from kvtier.benchmarks.results import write_result

        path = write_result(args.out, "peers", {"config": config, "rows": rows,
                                                "codec_rows": codec_rows})
        console.print(f"wrote {path}")
    if args.plot:
        _plot(rows, args.plot, config)
        console.print(f"wrote {args.plot}")
    return 0


def _tier_rows(name: str, args: argparse.Namespace, owner: _Owner, expected: list[Any],
               src: Any, workdir: Path, redis_url: str | None, console: Any
               ) -> list[dict[str, Any]]:
    """kvtier, LMCache and the raw medium on one tier, in rounds. Rounds interleave the
    three, best of each kept: on a shared machine whose memory and disk speeds drift by
    minutes, each ratio compares runs minutes apart at most, never a quiet stretch for one
    against a busy one for another."""
    chunk_bytes = owner.pool.storage.bytes_per_token * args.chunk_tokens
    ours = peer = raw = None
    rounds: list[tuple[dict, dict, dict]] = []
    connector: list[dict[str, Any]] = []
    for r in range(1, max(1, args.repeats) + 1):
        console.print(f"[bold]{name}[/bold] round {r}: kvtier, LMCache, raw medium ...")
        k = _kvtier_run(name, args, owner, expected, workdir, redis_url)
        if name == "cpu" and args.connector:  # in the same round: compared round by round
            connector.append(_connector_run(args, console))
        lm = _lmcache_run(name, args, workdir, redis_url) or {"error": "LMCache environment not found"}
        if name == "cpu":
            rw = _raw_cpu(src)
        elif name == "disk":
            rw = _raw_disk(src, chunk_bytes, workdir)
        else:
            rw = _raw_redis(src, chunk_bytes, redis_url)
        rounds.append((dict(k), dict(lm), dict(rw)))
        ours, peer, raw = _keep_best(ours, k), _keep_best(peer, lm), _keep_best(raw, rw)
    assert ours is not None and peer is not None and raw is not None
    rows = _rows(name, ours, peer, raw, src.numel() * src.element_size(), args, rounds)
    if connector:
        from kvtier.benchmarks.peers_vllm import connector_rows

        rows += connector_rows(connector, [k for k, _, _ in rounds], rows)
    return rows


def _connector_run(args: argparse.Namespace, console: Any) -> dict[str, Any]:
    from kvtier.benchmarks.peers_vllm import connector_run

    console.print("[bold]cpu[/bold]: kvtier's vLLM connector ...")
    layers, heads, dim, _ = MODELS[args.model]
    return connector_run(layers, heads, dim, args.sessions * args.tokens, args.chunk_tokens)


def _round_ratios(rounds: list[tuple[dict, dict, dict]], key: str, nbytes: int
                  ) -> dict[str, list[float]]:
    """kvtier's speed over the raw medium's and over LMCache's, round by round (each pair
    measured minutes apart at most; the drift between rounds cancels)."""
    vs_raw, vs_lm, vs_lm_fsync = [], [], []
    for k, lm, rw in rounds:
        if "error" in k or "error" in rw:
            continue
        vs_raw.append(rw[key] / k[key])
        if "error" not in lm:
            vs_lm.append(lm[key] / k[key] * nbytes / lm["bytes"])
            if key == "store_s" and lm.get("store_fsync_s"):
                vs_lm_fsync.append(lm["store_fsync_s"] / k[key] * nbytes / lm["bytes"])
    return {"raw": vs_raw, "lmcache": vs_lm, "lmcache_fsync": vs_lm_fsync}


def _rows(name: str, ours: dict[str, Any], peer: dict[str, Any], raw: dict[str, Any],
          nbytes: int, args: argparse.Namespace,
          rounds: list[tuple[dict, dict, dict]] | None = None) -> list[dict[str, Any]]:
    out = []
    for op in ("store", "retrieve"):
        key = f"{op}_s"
        k = nbytes / ours[key] / 1e9
        lm = None if "error" in peer else peer["bytes"] / peer[key] / 1e9
        r = nbytes / raw[key] / 1e9
        ratios = _round_ratios(rounds or [], key, nbytes)
        vs_raw = statistics.median(ratios["raw"]) if ratios["raw"] else k / r
        vs_lm = (statistics.median(ratios["lmcache"]) if ratios["lmcache"] else k / lm) if lm else None
        row: dict[str, Any] = {
            "tier": name, "op": op, "kvtier_GBps": round(k, 3),
            "lmcache_GBps": None if lm is None else round(lm, 3),
            "raw_GBps": round(r, 3), "raw": RAW_WHAT[(name, op)],
            "kvtier_vs_raw": round(vs_raw, 3),
            "kvtier_vs_lmcache": None if vs_lm is None else round(vs_lm, 3),
            "round_ratios": {w: [round(x, 3) for x in v] for w, v in ratios.items() if v},
            "kvtier_bit_exact": bool(ours["bit_exact"]),
            "lmcache_bit_exact": None if "error" in peer else bool(peer["bit_exact"]),
        }
        if name == "disk":
            row["kvtier_notes"] = ("O_DIRECT writes and reads" if args.o_direct else
                                   "buffered I/O") + "; fsync of data and directories"
        if "error" in peer:
            row["lmcache_error"] = peer["error"]
        elif peer.get("notes"):
            row["lmcache_notes"] = peer["notes"]
        if "retrieve_1thread_s" in raw and op == "retrieve":
            for what in ("1thread", "buffered", "direct"):
                row[f"raw_{what}_GBps"] = round(nbytes / raw[f"retrieve_{what}_s"] / 1e9, 3)
        if name == "disk" and op == "store" and peer.get("store_fsync_s"):
            durable = peer["bytes"] / peer["store_fsync_s"] / 1e9
            row["lmcache_fsync_GBps"] = round(durable, 3)
            fs = ratios["lmcache_fsync"]
            row["kvtier_vs_lmcache_fsync"] = round(statistics.median(fs) if fs else k / durable, 3)
        out.append(row)
    return out


def _lmcache_version(args: argparse.Namespace) -> str | None:
    if not args.lmcache_python or not Path(args.lmcache_python).exists():
        return None
    proc = subprocess.run(
        [args.lmcache_python, "-c", "import importlib.metadata as m; print(m.version('lmcache'))"],
        capture_output=True, text=True)
    return proc.stdout.strip() or None


def _print(console: Any, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from rich.table import Table

    table = Table(title=f"kvtier vs LMCache, {args.sessions} x {args.tokens} tokens of "
                  f"{args.model} (GB/s, end to end KV -> tier -> KV; best of the rounds; "
                  f"ratios: median over rounds of each round's own ratio)")
    for col in ("tier", "op", "kvtier", "LMCache", "raw", "kvtier/raw", "kvtier/LMCache",
                "bit-exact", "raw is"):
        table.add_column(col)
    for r in rows:
        lm = "-" if r["lmcache_GBps"] is None else f"{r['lmcache_GBps']:.2f}"
        vs = "-" if r["kvtier_vs_lmcache"] is None else f"{r['kvtier_vs_lmcache']:.2f}x"
        if r.get("lmcache_fsync_GBps"):  # the same store made durable, as kvtier's is
            lm += f" ({r['lmcache_fsync_GBps']:.2f} +fsync)"
            vs += f" ({r['kvtier_vs_lmcache_fsync']:.2f}x +fsync)"
        exact = "yes" if r["kvtier_bit_exact"] else "[red]NO[/red]"
        if r["lmcache_bit_exact"] is not None:
            exact += " / " + ("yes" if r["lmcache_bit_exact"] else "[red]NO[/red]")
        table.add_row(r["tier"], r["op"], f"{r['kvtier_GBps']:.2f}", lm, f"{r['raw_GBps']:.2f}",
                      f"{r['kvtier_vs_raw']:.2f}x", vs, exact, r["raw"])
    console.print(table)
    for r in rows:
        if r.get("lmcache_error"):
            console.print(f"LMCache {r['tier']} {r['op']}: {r['lmcache_error']}")


def _print_codecs(console: Any, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    from rich.table import Table

    table = Table(title="kvtier tiers keeping chunks encoded, against the same tier "
                  "uncompressed (GB/s of KV delivered; best of the rounds)")
    for col in ("tier", "op", "codec", "KV GB/s", "uncompressed", "ratio", "within bound"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["tier"], r["op"], r["codec"], f"{r['kv_GBps']:.2f}",
                      f"{r['none_kv_GBps']:.2f}", f"{r['vs_none']:.2f}x",
                      "yes" if r["within_bound"] else "[red]NO[/red]")
    console.print(table)


def _plot(rows: list[dict[str, Any]], path: Path, config: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['tier']}\n{r['op']}" for r in rows]
    xs = range(len(rows))
    w = 0.27
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rows)), 4))
    ax.bar([x - w for x in xs], [r["kvtier_GBps"] for r in rows], w, label="kvtier")
    ax.bar(list(xs), [r["lmcache_GBps"] or 0 for r in rows], w, label="LMCache")
    ax.bar([x + w for x in xs], [r["raw_GBps"] for r in rows], w, label="raw medium")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("GB/s")
    ax.set_title(f"{config['sessions']} x {config['tokens']} tokens, {config['model']}, bf16")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
