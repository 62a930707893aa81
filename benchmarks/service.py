"""``kvtier bench service``: load test of the chunk data plane over loopback HTTP.

A sidecar ``kvtier serve`` runs in its own process (so client and server do not share one
GIL); ``--clients`` concurrent clients PUT every chunk, then GET every chunk back (each
verified byte for byte), then fetch them again in batches. Reported: GB/s and p50/p99
latency per phase, next to the raw tier the server writes into, timed in-process on the
same chunks (the ceiling HTTP adds its cost to). Bounded in count (``--chunks``) and time
(``--max-seconds``: a phase stops issuing requests once past it).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "service",
        help="load test of kvtier serve's chunk data plane (GB/s, p50/p99, 64 clients)",
        description="PUT and GET chunks through a sidecar kvtier serve with many concurrent "
        "clients, next to the raw tier's speed in-process.",
    )
    p.add_argument("--chunks", type=int, default=512, help="chunks per phase")
    p.add_argument("--chunk-kib", type=int, default=1024, help="payload KiB per chunk")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients")
    p.add_argument("--batch", type=int, default=8, help="chunks per batch-get request")
    p.add_argument("--tier", default="cpu", choices=["cpu", "disk"], help="tier under test")
    p.add_argument("--max-seconds", type=float, default=120.0, help="time bound per phase")
    p.add_argument("--url", default=None, help="an already running server (else one starts)")
    p.add_argument("--no-shm", dest="shm", action="store_false",
                   help="skip the one-client run through a shared-memory region")
    p.add_argument("--out", default=None, help="write JSON results here")
    p.set_defaults(func=run)


def make_chunks(n: int, payload_kib: int, first: int = 0) -> dict[str, bytes]:
    import torch

    from kvtier.chunk_format import encode_chunk

    tokens = 16
    per_token = payload_kib * 1024 // tokens // 4  # float32 elements per token
    heads, dim = 1, per_token // 2  # [layers=1, 2, tokens, heads, dim]
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(first, first + n):
        key = f"{i:064x}"
        out[key] = encode_chunk(key, b"bench", torch.randn(1, 2, tokens, heads, dim, generator=g))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tier: str, total: int, slot: int, workdir: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ)
    env.update(
        KVTIER_TIERS__CPU_BYTES=str(slot * (total + 8) if tier == "cpu" else 0),
        KVTIER_TIERS__DISK_BYTES=str(0 if tier == "cpu" else 4 * total * slot),
        KVTIER_TIERS__DISK_DIR=str(workdir / "chunks"),
        KVTIER_SERVER__CHUNK_SLOT_BYTES=str(slot),
        KVTIER_SERVER__MAX_BODY_BYTES=str(max(64 << 20, 4 * slot)),
    )
    cmd = [sys.executable, "-m", "kvtier.cli.main", "serve", "--port", str(port),
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env)
    return proc, f"http://127.0.0.1:{port}"


def _stats(latencies: list[float], nbytes: int, wall: float, done: int, total: int) -> dict:
    lat = sorted(latencies)

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else float("nan")

    return {
        "requests": len(lat),
        "chunks": done,
        "chunks_planned": total,
        "bytes": nbytes,
        "seconds": wall,
        "gbps": nbytes / wall / 1e9 if wall else 0.0,
        "requests_per_s": len(lat) / wall if wall else 0.0,
        "p50_ms": pct(0.50) * 1e3,
        "p99_ms": pct(0.99) * 1e3,
        "mean_ms": statistics.fmean(lat) * 1e3 if lat else float("nan"),
    }


async def _phase(clients: int, jobs: list[Any], work, max_seconds: float) -> tuple[list, float]:
    """Run ``work(job)`` over ``jobs`` with ``clients`` concurrent workers; latencies."""
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    latencies: list[float] = []
    t0 = time.perf_counter()
    deadline = t0 + max_seconds

    async def worker() -> None:
        while not queue.empty() and time.perf_counter() < deadline:
            job = queue.get_nowait()
            s = time.perf_counter()
            await work(job)
            latencies.append(time.perf_counter() - s)

    await asyncio.gather(*(worker() for _ in range(clients)))
    return latencies, time.perf_counter() - t0


def _as_served(blobs: dict[str, bytes]) -> dict[str, bytes]:
    """What the server serves back for each upload: the same chunk naming the uploader's
    tenant (the benchmark's server runs open: tenant ``default``)."""
    from kvtier.chunk_format import with_namespace
    from kvtier.config import DEFAULT_TENANT

    return {k: with_namespace(b, DEFAULT_TENANT) for k, b in blobs.items()}


async def load(url: str, blobs: dict[str, bytes], clients: int, batch: int, max_s: float) -> dict:
    import httpx

    from kvtier.client import AsyncClient
    from kvtier.errors import KVTierError

    keys = list(blobs)
    served = _as_served(blobs)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with AsyncClient(url, timeout=300, limits=limits) as kv:
        for _ in range(600):
            try:
                await kv.health()
                break
            except httpx.HTTPError:
                await asyncio.sleep(0.1)
        put_done: list[str] = []

        async def put(key: str) -> None:
            await kv.put_chunk(key, blobs[key])
            put_done.append(key)

        lat, wall = await _phase(clients, keys, put, max_s)
        put = _stats(lat, sum(len(blobs[k]) for k in put_done), wall, len(put_done), len(keys))
        got: list[str] = []

        async def get(key: str) -> None:
            blob = await kv.get_chunk(key)
            if blob != served[key]:
                raise KVTierError(f"GET {key} returned other bytes than were put")
            got.append(key)

        lat, wall = await _phase(clients, put_done, get, max_s)
        get = _stats(lat, sum(len(blobs[k]) for k in got), wall, len(got), len(put_done))
        groups = [put_done[i : i + batch] for i in range(0, len(put_done), batch)]
        batched: list[str] = []

        async def get_many(group: list[str]) -> None:
            out = await kv.get_chunks(group)
            if out != [served[k] for k in group]:
                raise KVTierError("batch get returned other bytes than were put")
            batched.extend(group)

        lat, wall = await _phase(clients, groups, get_many, max_s)
        many = _stats(lat, sum(len(blobs[k]) for k in batched), wall, len(batched), len(put_done))
        many["chunks_per_request"] = batch
    return {"put": put, "get": get, "batch_get": many}


def one_client(url: str, blobs: dict[str, bytes], shm: bool = False) -> dict:
    """One synchronous :class:`~kvtier.client.Client`, as a connector calls it: PUT each
    chunk from its buffer, then GET each into one reused buffer (checked byte for byte).
    ``shm``: through a shared-memory region (a same-host client), not request bodies."""
    import numpy as np

    from kvtier.client import Client
    from kvtier.errors import KVTierError

    total = sum(len(b) for b in blobs.values())
    served = _as_served(blobs)
    out = bytearray(max(len(b) for b in served.values()))
    with Client(url, timeout=300, shm=shm) as kv:
        lat: list[float] = []
        for key, blob in blobs.items():
            s = time.perf_counter()
            kv.put_chunk(key, blob)
            lat.append(time.perf_counter() - s)
        put = _stats(lat, total, sum(lat), len(blobs), len(blobs))  # one request at a time
        lat = []
        for key in blobs:
            s = time.perf_counter()
            got = kv.get_chunk_into(key, out)
            lat.append(time.perf_counter() - s)
            if got is None or not np.array_equal(np.frombuffer(got, np.uint8),
                                                 np.frombuffer(served[key], np.uint8)):
                raise KVTierError(f"GET {key} returned other bytes than were put")
        get = _stats(lat, total, sum(lat), len(blobs), len(blobs))  # (checks off the clock)
        if shm and not kv.shm:
            raise KVTierError("the server offered no shared-memory region")
    return {"put": put, "get": get}


def raw_loopback(blobs: dict[str, bytes]) -> dict[str, float]:
    """The wire under the sidecar: the same chunks sent over one loopback TCP connection
    into a buffer that exists (``sendall`` / ``recv_into``, no HTTP), GB/s."""
    import threading

    size = max(len(b) for b in blobs.values())
    total = sum(len(b) for b in blobs.values())
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)

        def sink() -> None:
            conn, _ = srv.accept()
            mem = memoryview(bytearray(size))
            with conn:
                for blob in blobs.values():
                    got = 0
                    while got < len(blob):
                        got += conn.recv_into(mem[got : len(blob)])
                    conn.sendall(b"k")

        thread = threading.Thread(target=sink, daemon=True)
        thread.start()
        with socket.create_connection(srv.getsockname()) as cli:
            t0 = time.perf_counter()
            for blob in blobs.values():
                cli.sendall(blob)
                cli.recv(1)
            wall = time.perf_counter() - t0
        thread.join(timeout=30)
    return {"gbps": total / wall / 1e9}


def raw_tier(tier: str, blobs: dict[str, bytes], slot: int, workdir: Path) -> dict[str, float]:
    """The tier the server writes into, timed in-process on the same chunks (GB/s)."""
    from kvtier.connectors.tiers.blobs import get_blobs, put_blobs

    keys = list(blobs)
    total = sum(len(b) for b in blobs.values())
    if tier == "cpu":
        from kvtier.connectors.tiers.cpu_tier import CPUTier

        t = CPUTier(slot * (len(blobs) + 8), slot)
    else:
        from kvtier.connectors.tiers.disk_tier import DiskTier

        t = DiskTier(workdir / "raw", None, fsync=True)
    puts, gets = [], []
    try:
        for _ in range(3):  # the median of three: the first pass also faults pages in
            t.delete(keys)
            s = time.perf_counter()
            put_blobs(t, blobs)
            puts.append(time.perf_counter() - s)
            s = time.perf_counter()
            get_blobs(t, keys)
            gets.append(time.perf_counter() - s)
    finally:
        t.close()
    put_s, get_s = statistics.median(puts), statistics.median(gets)
    return {"put_gbps": total / put_s / 1e9, "get_gbps": total / get_s / 1e9}


def run(args: argparse.Namespace) -> int:
    from kvtier.benchmarks.results import write_result
    from kvtier.errors import InvalidArgumentError

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request is noise
    if args.chunks < 1 or args.clients < 1 or args.chunk_kib < 1 or args.batch < 1:
        raise InvalidArgumentError("--chunks, --clients, --chunk-kib and --batch must be >= 1")
    blobs = make_chunks(args.chunks, args.chunk_kib)
    slot = max(len(b) for b in blobs.values()) + 4096
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-service-") as tmp:
        work = Path(tmp)
        raw = raw_tier(args.tier, blobs, slot, work)
        wire = raw_loopback(blobs)
        proc = None
        url = args.url
        if url is None:
            proc, url = start_server(args.tier, len(blobs), slot, work)
        try:
            result = asyncio.run(load(url, blobs, args.clients, args.batch, args.max_seconds))
            sync = one_client(url, make_chunks(args.chunks, args.chunk_kib, first=args.chunks))
            shm = one_client(url, make_chunks(args.chunks, args.chunk_kib, first=2 * args.chunks),
                             shm=True) if args.shm and os.path.isdir("/dev/shm") else None
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
    payload = {
        "tier": args.tier,
        "clients": args.clients,
        "chunk_bytes": len(next(iter(blobs.values()))),
        "raw_tier": raw,
        "raw_loopback_gbps": wire["gbps"],
        **result,
        "ratio_put_vs_raw": result["put"]["gbps"] / raw["put_gbps"],
        "ratio_get_vs_raw": result["get"]["gbps"] / raw["get_gbps"],
        "one_sync_client": {
            **sync,
            "ratio_put_vs_raw": sync["put"]["gbps"] / raw["put_gbps"],
            "ratio_get_vs_raw": sync["get"]["gbps"] / raw["get_gbps"],
            "ratio_put_vs_loopback": sync["put"]["gbps"] / wire["gbps"],
            "ratio_get_vs_loopback": sync["get"]["gbps"] / wire["gbps"],
        },
    }
    if shm is not None:
        payload["one_shm_client"] = {
            **shm,
            "ratio_put_vs_raw": shm["put"]["gbps"] / raw["put_gbps"],
            "ratio_get_vs_raw": shm["get"]["gbps"] / raw["get_gbps"],
        }
    _print(args, result, sync, shm, raw, wire)
    if args.out:
        write_result(args.out, "service", payload)
    return 0


def _print(args: argparse.Namespace, result: dict[str, Any], sync: dict[str, Any],
           shm: dict[str, Any] | None, raw: dict[str, Any], wire: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvtier serve data plane, {args.clients} clients, {args.tier} tier")
    for col in ("phase", "chunks", "GB/s", "req/s", "p50 ms", "p99 ms", "raw tier GB/s", "loopback GB/s"):
        table.add_column(col, justify="right")
    rows = [(p, result[p], k) for p, k in (("put", "put_gbps"), ("get", "get_gbps"), ("batch_get", "get_gbps"))]
    rows += [(f"sync {p}", sync[p], f"{p}_gbps") for p in ("put", "get")]
    if shm is not None:
        rows += [(f"shm {p}", shm[p], f"{p}_gbps") for p in ("put", "get")]
    for phase, r, raw_key in rows:
        table.add_row(phase, str(r["chunks"]), f"{r['gbps']:.3f}", f"{r['requests_per_s']:.0f}",
                      f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", f"{raw[raw_key]:.3f}", f"{wire['gbps']:.3f}")  # fmt: skip
    Console().print(table)
