"""``kvtier bench tiers``: put and get throughput of every tier next to its physical reference.

Each tier moves real chunk blobs of a realistic model's size; the reference moves the same
bytes the plainest way in the same run: a torch copy (CPU arena); write + fsync and read of
the same bytes in plain files, from the page cache and cold (disk); raw redis-py pipelined
SET / GET of the same values with the hiredis parser (Redis). The ratio tier / reference
is what the tier's own machinery costs (target >= 0.8).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODELS = {
    # layers, kv_heads, head_dim, bytes per element: chunk payload = 2*L*T*H*D*e
    "smollm-135m": (30, 3, 64, 2),
    "llama-3.2-1b": (16, 8, 64, 2),
    "llama-3-8b": (32, 8, 128, 2),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tiers",
        help="put/get throughput per tier vs the raw medium (copy, file I/O, redis-py)",
        description="Throughput of the CPU, disk and Redis tiers on chunk blobs of a real "
        "model's size, each next to its physical reference measured in the same run.",
    )
    p.add_argument("--model", choices=sorted(MODELS), default="llama-3.2-1b")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--chunks", type=int, default=24, help="chunks per timed batch")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--disk-dir", type=Path, default=None, help="default: a temp dir under /tmp")
    p.add_argument("--redis-url", default=None,
                   help="Redis to use; default: start a private redis-server if installed")
    p.add_argument("--skip", default="", help="comma-separated tiers to skip (cpu,disk,redis)")
    p.add_argument("--out", type=Path, default=None)
    p.set_defaults(func=run)


def _median(fn: Callable[[], object], repeats: int, before: Callable[[], None] | None = None
            ) -> float:
    times = []
    for _ in range(repeats):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fadvise_dontneed(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _start_redis() -> tuple[subprocess.Popen, str, Path] | None:
    import socket

    exe = shutil.which("redis-server")
    if exe is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = Path(tempfile.mkdtemp(prefix="kvtier-bench-redis-"))
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(d), "--maxmemory", "0", "--protected-mode", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    import redis

    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            redis.Redis.from_url(url).ping()
            return proc, url, d
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    return None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    blobs = _make_blobs(args)
    total = sum(len(b) for b in blobs.values())
    console = Console() if Console().is_terminal else Console(width=140)
    rows: list[dict[str, Any]] = []
    if "cpu" not in skip:
        rows += _bench_cpu(blobs, args)
    if "disk" not in skip:
        rows += _bench_disk(blobs, args)
    if "redis" not in skip:
        rows += _bench_redis(blobs, args, console)
    _print_table(console, rows, args, total)
    if args.out:
        from kvtier.benchmarks.results import write_result

        path = write_result(args.out, "tiers", {
            "config": {"model": args.model, "chunk_tokens": args.chunk_tokens,
                       "chunks": args.chunks, "repeats": args.repeats,
                       "chunk_bytes": total // args.chunks},
            "target_ratio": 0.8,
            "rows": rows,
        })
        console.print(f"wrote {path}")
    return 0


def _make_blobs(args: argparse.Namespace) -> dict[str, bytes]:
    """``--chunks`` encoded chunks of random KV, keyed like the service keys them."""
    import torch

    from kvtier.chunk_format import encode_chunk

    layers, heads, dim, elem = MODELS[args.model]
    dtype = torch.bfloat16 if elem == 2 else torch.float32
    g = torch.Generator().manual_seed(0)
    blobs: dict[str, bytes] = {}
    for i in range(args.chunks):
        key = f"{i:064x}"
        kv = torch.randn(layers, 2, args.chunk_tokens, heads, dim, generator=g).to(dtype)
        blobs[key] = encode_chunk(key, b"bench", kv)
    return blobs


def _row(tier: str, op: str, total: int, ours_s: float, ref_s: float, ref: str
         ) -> dict[str, Any]:
    return {"tier": tier, "op": op, "bytes": total,
            "gbps": total / ours_s / 1e9, "ref_gbps": total / ref_s / 1e9,
            "ratio": ref_s / ours_s, "reference": ref}


def _bench_cpu(blobs: dict[str, bytes], args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from kvtier.connectors.tiers.blobs import get_blobs, put_blobs
    from kvtier.connectors.tiers.cpu_tier import CPUTier

    keys = list(blobs)
    total = sum(len(b) for b in blobs.values())
    slot = max(len(b) for b in blobs.values()) + 4096
    tier = CPUTier(slot * (args.chunks + 1), slot)
    arena = torch.empty(total, dtype=torch.uint8)
    srcs = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs.values()]

    def ref_put() -> None:
        off = 0
        for s in srcs:
            arena[off : off + len(s)].copy_(s)
            off += len(s)

    def ref_get() -> list[bytes]:
        # kept, like the tier's get returns them all: results in fresh Python memory
        out, off = [], 0
        for s in srcs:
            out.append(bytes(arena[off : off + len(s)].numpy()))
            off += len(s)
        return out

    put_s = _median(lambda: put_blobs(tier, blobs), args.repeats, before=lambda: tier.delete(keys))
    get_s = _median(lambda: get_blobs(tier, keys), args.repeats)
    rows = [_row("cpu", "put", total, put_s, _median(ref_put, args.repeats),
                 "torch copy into one arena")]
    rows.append(_row("cpu", "get", total, get_s, _median(ref_get, args.repeats),
                     "copy out of the arena into bytes"))
    tier.close()
    return rows + _bench_cpu_in_place(blobs, args)


def _bench_cpu_in_place(blobs: dict[str, bytes], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The data path's own use of the arena: KV tensors written into slots in place
    (``store_in_place`` + ``encode_into``: copy, checksums, header) and read back verified
    under a lease into KV tensors that already exist; the reference is a torch copy of the
    same KV into memory that already exists, measured in the same run."""
    import torch

    from kvtier.chunk_format import byte_view, chunk_layout, chunk_view, encode_into
    from kvtier.connectors.tiers.base import ChunkWrite
    from kvtier.connectors.tiers.cpu_tier import CPUTier

    kvs = {k: chunk_view(byte_view(b), k)[1].clone() for k, b in blobs.items()}
    fp = chunk_view(byte_view(next(iter(blobs.values()))))[0].fingerprint
    sizes = {k: chunk_layout(k, fp, kv.dtype, tuple(kv.shape))[1] for k, kv in kvs.items()}
    total = sum(kv.numel() * kv.element_size() for kv in kvs.values())
    slot = max(sizes.values()) + 4096
    tier = CPUTier(slot * (args.chunks + 1), slot)
    keys = list(kvs)
    outs = {k: torch.empty_like(kv) for k, kv in kvs.items()}
    arena = [torch.empty_like(kv) for kv in kvs.values()]

    def put() -> None:
        for k, kv in kvs.items():
            tier.store_in_place([ChunkWrite(k, sizes[k], fill=lambda dest, k=k, kv=kv: encode_into(
                dest, k, fp, kv.dtype, tuple(kv.shape), lambda payload, kv=kv: payload.copy_(kv)))])

    def read() -> None:
        with tier.lease(keys) as views:
            for k, view in zip(keys, views, strict=True):
                outs[k].copy_(chunk_view(view, k, fp)[1])

    def ref_copy() -> None:
        for dst, kv in zip(arena, kvs.values(), strict=True):
            dst.copy_(kv)

    put_s = _median(put, args.repeats, before=lambda: tier.delete(keys))
    read_s = _median(read, args.repeats)
    if not all(torch.equal(outs[k], kvs[k]) for k in keys):
        raise RuntimeError("the CPU tier's in-place path returned other KV than it stored")
    ref_s = _median(ref_copy, args.repeats)
    tier.close()
    return [
        _row("cpu", "put in place (KV)", total, put_s, ref_s, "torch copy into existing memory"),
        _row("cpu", "read leased (KV)", total, read_s, ref_s, "torch copy into existing memory"),
    ]


def _bench_disk(blobs: dict[str, bytes], args: argparse.Namespace) -> list[dict[str, Any]]:
    from kvtier.connectors.tiers.blobs import get_blobs, put_blobs
    from kvtier.connectors.tiers.disk_tier import DiskTier

    keys = list(blobs)
    total = sum(len(b) for b in blobs.values())
    base = Path(args.disk_dir or tempfile.mkdtemp(prefix="kvtier-bench-disk-"))
    tdir, rdir = base / "tier", base / "raw"
    rdir.mkdir(parents=True, exist_ok=True)
    tier = DiskTier(tdir, fsync=True)
    raw = [rdir / f"{k}.bin" for k in keys]

    def ref_write() -> None:
        for p, b in zip(raw, blobs.values(), strict=True):
            with open(p, "wb") as f:
                f.write(b)
                f.flush()
                os.fsync(f.fileno())

    def ref_read() -> list[bytes]:
        return [p.read_bytes() for p in raw]  # kept, like the tier's get returns them

    tier_files = lambda: [p for p in tdir.rglob("*.kvc")]  # noqa: E731
    rows = []
    put_s = _median(lambda: put_blobs(tier, blobs), args.repeats, before=lambda: tier.delete(keys))
    rows.append(_row("disk", "put", total, put_s, _median(ref_write, args.repeats),
                     "write + fsync per file"))
    get_s = _median(lambda: get_blobs(tier, keys), args.repeats)
    rows.append(_row("disk", "get (page cache)", total, get_s, _median(ref_read, args.repeats),
                     "read files"))
    cold_s = _median(lambda: get_blobs(tier, keys), args.repeats,
                     before=lambda: _fadvise_dontneed(tier_files()))
    ref_cold = _median(ref_read, args.repeats, before=lambda: _fadvise_dontneed(raw))
    rows.append(_row("disk", "get (cold)", total, cold_s, ref_cold,
                     "read files after POSIX_FADV_DONTNEED"))
    tier.close()
    if args.disk_dir is None:
        shutil.rmtree(base, ignore_errors=True)
    return rows


def _bench_redis(blobs: dict[str, bytes], args: argparse.Namespace, console
                 ) -> list[dict[str, Any]]:
    """--redis-url, or a private redis-server started for the run (and stopped after)."""
    rows: list[dict[str, Any]] = []
    started = None
    url = args.redis_url
    if url is None:
        started = _start_redis()
        url = started[1] if started else None
    if url is None:
        console.print("redis: no server (install redis-server or pass --redis-url); skipped")
    else:
        rows = _redis_rows(url, blobs, args)
    if started:
        started[0].kill()
        started[0].wait()
        shutil.rmtree(started[2], ignore_errors=True)
    return rows


def _redis_rows(url: str, blobs: dict[str, bytes], args: argparse.Namespace
                ) -> list[dict[str, Any]]:
    import redis

    from kvtier.connectors.tiers.blobs import get_blobs, put_blobs
    from kvtier.connectors.tiers.redis_tier import RedisTier

    keys = list(blobs)
    total = sum(len(b) for b in blobs.values())
    tier = RedisTier(url, timeout_s=30.0)
    client = redis.Redis.from_url(url)

    def ref_set() -> None:
        pipe = client.pipeline(transaction=False)
        for k, b in blobs.items():
            pipe.set(f"raw:{k}", b)
        pipe.execute()

    def ref_get() -> None:
        client.mget([f"raw:{k}" for k in keys])

    def clear() -> None:
        client.delete(*[f"raw:{k}" for k in keys])

    put_s = _median(lambda: put_blobs(tier, blobs), args.repeats, before=lambda: tier.delete(keys))
    ref_put_s = _median(ref_set, args.repeats, before=clear)
    rows = [_row("redis", "put", total, put_s, ref_put_s, "redis-py pipelined SET (hiredis)")]
    get_s = _median(lambda: get_blobs(tier, keys), args.repeats)
    rows.append(_row("redis", "get", total, get_s, _median(ref_get, args.repeats),
                     "redis-py MGET (hiredis)"))
    tier.close()
    client.close()
    return rows


def _print_table(console, rows: list[dict[str, Any]], args: argparse.Namespace, total: int
                 ) -> None:
    from rich.table import Table

    t = Table(title=f"tiers: {args.chunks} chunks of {args.chunk_tokens} tokens of "
              f"{args.model} ({total / args.chunks / 2**20:.1f} MiB each)", title_justify="left")
    for col in ("tier", "op", "GB/s", "reference GB/s", "ratio", "reference"):
        t.add_column(col, justify="left" if col in ("tier", "op", "reference") else "right")
    for r in rows:
        t.add_row(r["tier"], r["op"], f"{r['gbps']:.2f}", f"{r['ref_gbps']:.2f}",
                  f"{r['ratio']:.2f}", r["reference"])
    console.print(t)
    console.print("ratio = tier throughput / reference throughput; target >= 0.8")
