"""``kvtier bench faults``: the sidecar attacked and loaded, case by case, with real parts.

Each case runs against a real ``kvtier serve`` process (CPU, disk and, where the case needs
it, a real ``redis-server``) over loopback HTTP, while a probe asks ``/healthz`` every
20 ms. A row says what happened, how many bytes served differed from what was stored
(``wrong_bytes``: must be 0 everywhere), how many requests failed that should not have,
and the worst ``/healthz`` latency seen during the case. The expectations of a case are
checked by the suite itself (``ok``); the latency goal (100 ms) is reported, not asserted,
as timing belongs to benchmarks. ``--quick`` runs the same cases smaller, for CI.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvtier.benchmarks import faults_clients, faults_reads, faults_tenants
from kvtier.benchmarks.fault_parts import (
    HEALTHZ_GOAL_S,
    HealthProbe,
    Redis,
    Row,
    Serve,
    make_chunk,
    row,
)
from kvtier.benchmarks.fault_parts import wrong_bytes as _wrong


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "faults",
        help="fault and load suite of the sidecar: corrupt files, kill -9, Redis down/paused/"
        "full, concurrent clients, body limits, metrics under load",
        description="Runs each fault case against a real kvtier serve (and redis-server) "
        "and prints case, outcome, wrong bytes served, failed requests and the worst "
        "/healthz latency.",
    )
    p.add_argument("--quick", action="store_true", help="smaller cases (CI)")
    p.add_argument("--sessions", type=int, default=None,
                   help="concurrent client sessions (default 1000; 64 with --quick)")
    p.add_argument("--cases", default=None, help="comma-separated subset of cases")
    p.add_argument("--out", type=Path, default=None)
    p.set_defaults(func=run)


# --- the cases ---------------------------------------------------------------------------


def case_corrupt_and_truncated_files(work: Path, scale: dict) -> Row:
    from kvtier.client import Client

    srv = Serve(work, tiers__cpu_bytes=0, tiers__disk_bytes=1 << 30).start()
    wrong = failed = 0
    try:
        chunks = dict(make_chunk(i) for i in range(scale["files"]))
        with Client(srv.url) as kv, HealthProbe(srv.url) as probe:
            for k, b in chunks.items():
                kv.put_chunk(k, b)
            files = sorted((work / "chunks").rglob("*.kvc"))
            flipped, cut = files[0], files[1]
            data = bytearray(flipped.read_bytes())
            data[len(data) // 2] ^= 0x40
            flipped.write_bytes(bytes(data))
            cut.write_bytes(cut.read_bytes()[:1000])
            bad = {p.name[: -len(".kvc")].partition(".")[2] for p in (flipped, cut)}
            misses = 0
            for k, b in chunks.items():
                got = kv.get_chunk(k)
                wrong += _wrong(got, b)
                misses += got is None
                failed += got is None and k not in bad
        ok = wrong == 0 and failed == 0 and misses == 2
        return row("corrupt and truncated files", ok, wrong, failed, probe,
                    f"{misses} of {len(chunks)} reads missed (the flipped and the cut file), "
                    "the rest exact")
    finally:
        srv.stop()


def case_kill_mid_write(work: Path, scale: dict) -> Row:
    from kvtier.client import Client, ServiceError

    srv = Serve(work, tiers__cpu_bytes=0, tiers__disk_bytes=1 << 30).start()
    acked: dict[str, bytes] = {}
    chunks = [make_chunk(i, tokens=64, layers=2) for i in range(scale["writes"])]

    def writer() -> None:
        with Client(srv.url, timeout=10) as kv:
            for k, b in chunks:
                try:
                    kv.put_chunk(k, b)
                    acked[k] = b
                except (ServiceError, OSError, Exception):  # noqa: BLE001 - the server died
                    return

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(scale["kill_after_s"])
    srv.kill()
    t.join()
    srv2 = Serve(work, tiers__cpu_bytes=0, tiers__disk_bytes=1 << 30)
    srv2.port, srv2.url = srv.port, srv.url
    srv2.start()
    wrong = lost = 0
    try:
        with Client(srv2.url) as kv, HealthProbe(srv2.url) as probe:
            for k, b in chunks:
                got = kv.get_chunk(k)
                wrong += _wrong(got, b)
                lost += k in acked and got is None
        ok = wrong == 0 and lost == 0 and 0 < len(acked) < len(chunks)
        return row("kill -9 mid-write, restart", ok, wrong, lost, probe,
                    f"killed after {len(acked)} of {len(chunks)} acknowledged writes; every "
                    "acknowledged chunk read back exact, no torn chunk served")
    finally:
        srv2.stop()


def case_redis_down_and_paused(work: Path, scale: dict) -> Row:
    from kvtier.client import Client

    red = Redis().start()
    srv = Serve(work, tiers__cpu_bytes=0, tiers__disk_bytes=0, tiers__redis_url=red.url,
                tiers__redis_timeout_s=0.5).start()
    wrong = failed = 0
    notes = []
    try:
        chunks = dict(make_chunk(i) for i in range(scale["files"]))
        with Client(srv.url, timeout=30) as kv, HealthProbe(srv.url) as probe:
            for k, b in chunks.items():
                kv.put_chunk(k, b)
            red.signal(signal.SIGSTOP)  # hung: accepts connections, never answers
            t0 = time.perf_counter()
            for k, b in list(chunks.items())[:5]:
                got = kv.get_chunk(k)
                wrong += _wrong(got, b)
            notes.append(f"paused: 5 reads answered in {time.perf_counter() - t0:.1f} s "
                         "(misses)")
            red.signal(signal.SIGCONT)
            for k, b in chunks.items():
                got = kv.get_chunk(k)
                wrong += _wrong(got, b)
                failed += got is None
            notes.append("resumed: every chunk read back exact")
            red.proc.kill()  # type: ignore[union-attr]
            red.proc.wait()  # type: ignore[union-attr]
            misses = sum(kv.get_chunk(k) is None for k in chunks)
            notes.append(f"killed: {misses} misses, the service answers")
            alive = kv.health()["status"] == "ok"
        ok = wrong == 0 and failed == 0 and misses == len(chunks) and alive
        return row("Redis paused, resumed, killed", ok, wrong, failed, probe, "; ".join(notes))
    finally:
        srv.stop()
        red.stop()


def case_redis_full(work: Path, scale: dict) -> Row:
    from kvtier.client import Client, ServiceError

    red = Redis("--maxmemory", "4mb", "--maxmemory-policy", "noeviction").start()
    srv = Serve(work, tiers__cpu_bytes=0, tiers__disk_bytes=0, tiers__redis_url=red.url).start()
    wrong = failed = 0
    try:
        chunks = dict(make_chunk(i, tokens=512) for i in range(24))
        statuses = []
        with Client(srv.url) as kv, HealthProbe(srv.url) as probe:
            for k, b in chunks.items():
                try:
                    kv.put_chunk(k, b)
                    statuses.append(201)
                except ServiceError as exc:
                    statuses.append(exc.status)
                    failed += exc.status != 507 or "full" not in exc.message
            for k, b in chunks.items():
                wrong += _wrong(kv.get_chunk(k), b)
        ok = wrong == 0 and failed == 0 and 507 in statuses and 201 in statuses
        return row("Redis at maxmemory", ok, wrong, failed, probe,
                    f"{statuses.count(201)} stored, {statuses.count(507)} refused as full (507)")
    finally:
        srv.stop()
        red.stop()


def case_concurrent_sessions(work: Path, scale: dict) -> Row:
    """Many clients at once, each writing and reading its own chunks through CPU, disk and
    Redis tiers, every byte checked."""
    from kvtier.client import Client

    red = Redis().start()
    srv = Serve(work, tiers__cpu_bytes=64 << 20, tiers__disk_bytes=1 << 30,
                tiers__redis_url=red.url).start()
    n = scale["sessions"]
    wrong = failed = 0
    lock = threading.Lock()

    def session(s: int) -> None:
        nonlocal wrong, failed
        mine = [make_chunk(i, tokens=32, layers=2, salt=s + 1) for i in range(3)]
        w = f = 0
        try:
            with Client(srv.url, timeout=120) as kv:
                for k, b in mine:
                    kv.put_chunk(k, b)
                for k, b in mine:
                    got = kv.get_chunk(k)
                    w += _wrong(got, b)
                    f += got is None
        except Exception:  # noqa: BLE001 - a failed request is what is counted
            f += 1
        with lock:
            wrong += w
            failed += f

    try:
        with HealthProbe(srv.url) as probe, ThreadPoolExecutor(min(n, 256)) as pool:
            list(pool.map(session, range(n)))
        ok = wrong == 0 and failed == 0
        return row(f"{n} concurrent sessions (CPU, disk, Redis)", ok, wrong, failed, probe,
                    f"{n} clients x 3 chunks put and read back")
    finally:
        srv.stop()
        red.stop()


def case_body_limits(work: Path, scale: dict) -> Row:
    """Oversize bodies are 413; concurrent large uploads stay within the in-flight budget
    (503 with Retry-After past it), and the server's memory stays near the budget."""
    import httpx

    body = scale["upload_bytes"]
    budget = 2 * body
    srv = Serve(work, tiers__cpu_bytes=0, tiers__disk_bytes=4 * body + (64 << 20),
                server__max_body_bytes=body + (1 << 20),
                server__max_inflight_bytes=budget).start()
    failed = 0
    try:
        base = srv.rss_bytes()
        peak = base
        key, blob = make_chunk(0, tokens=body // (4 * 2 * 2 * 16 * 2), layers=4)
        statuses: list[int] = []

        def upload(i: int) -> None:
            try:
                r = httpx.put(f"{srv.url}/v1/chunks/{key}", content=blob, timeout=120)
                statuses.append(r.status_code)
            except httpx.HTTPError:
                statuses.append(0)

        with HealthProbe(srv.url) as probe:
            threads = [threading.Thread(target=upload, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                peak = max(peak, srv.rss_bytes())
                time.sleep(0.01)
            big = httpx.put(f"{srv.url}/v1/chunks/{key}", content=b"x" * (body + (2 << 20)),
                            timeout=60)
        failed += sum(s not in (200, 201, 503) for s in statuses) + (big.status_code != 413)
        grown = peak - base
        within = grown <= 1.1 * budget
        ok = failed == 0 and within and any(s in (200, 201) for s in statuses)
        out = row("body limits and in-flight budget", ok, 0, failed, probe,
                  f"4 concurrent {body >> 20} MiB uploads: {sorted(statuses)}; server RSS "
                  f"grew {grown >> 20} MiB (budget {budget >> 20} MiB); oversize: "
                  f"{big.status_code}")
        return {**out, "rss_grown_bytes": grown, "inflight_budget_bytes": budget}
    finally:
        srv.stop()


def case_metrics_and_batches_under_load(work: Path, scale: dict) -> Row:
    """/metrics and /v1/stats scraped with many keys in Redis, and large batch transfers,
    while /healthz is probed."""
    import redis as redis_py

    from kvtier.client import Client

    red = Redis().start()
    srv = Serve(work, tiers__cpu_bytes=512 << 20, tiers__disk_bytes=2 << 30,
                tiers__redis_url=red.url, server__max_body_bytes=512 << 20).start()
    wrong = failed = 0
    try:
        raw = redis_py.Redis.from_url(red.url)
        pipe = raw.pipeline(transaction=False)
        for i in range(scale["redis_keys"]):
            pipe.set(f"kvtier:other{i:012d}", b"x")
            if i % 10000 == 9999:
                pipe.execute()
        pipe.execute()
        batch = dict(make_chunk(i, tokens=2048, layers=8) for i in range(scale["batch_chunks"]))
        nbytes = sum(len(b) for b in batch.values())
        with Client(srv.url, timeout=300) as kv, HealthProbe(srv.url) as probe:
            for _ in range(5):
                kv.stats()
                kv.metrics()
            kv.put_chunks(batch)
            got = kv.get_chunks(list(batch))
            for (_, want), have in zip(batch.items(), got, strict=True):
                wrong += _wrong(have, want)
                failed += have is None
        ok = wrong == 0 and failed == 0
        return row("metrics with many Redis keys; large batches", ok, wrong, failed, probe,
                    f"{scale['redis_keys']:,} foreign keys in Redis, 5 scrapes; batch of "
                    f"{nbytes >> 20} MiB put and read back")
    finally:
        srv.stop()
        red.stop()


CASES: dict[str, Callable[[Path, dict], Row]] = {
    "files": case_corrupt_and_truncated_files,
    "kill": case_kill_mid_write,
    "redis-down": case_redis_down_and_paused,
    "redis-full": case_redis_full,
    "sessions": case_concurrent_sessions,
    "limits": case_body_limits,
    "load": case_metrics_and_batches_under_load,
    **faults_tenants.CASES,
    **faults_reads.CASES,
    **faults_clients.CASES,
}


def scales(quick: bool, sessions: int | None) -> dict:
    if quick:
        return {"files": 8, "writes": 3000, "kill_after_s": 1.0, "sessions": sessions or 64,
                "upload_bytes": 32 << 20, "redis_keys": 20_000, "batch_chunks": 8,
                "hostile_budget": 32 << 20, "hostile_sockets": 4, "reads_budget": 32 << 20,
                "reads_derives": 24, "reads_hold_s": 3.0, "reads_baseline": 8,
                "redis_grown_bytes": 64 << 20, "conn_sockets": 1100, "conn_low_sockets": 300,
                "conn_head_timeout_s": 2.0, "turns_baseline": 6, "turns_hang_ups": 4,
                "turns_huge": 2, "turns_huge_bytes": 2 << 20, "pause_s": 2.0,
                "pause_chunks": 8}
    return {"files": 32, "writes": 3000, "kill_after_s": 1.5, "sessions": sessions or 1000,
            "upload_bytes": 250 << 20, "redis_keys": 300_000, "batch_chunks": 200,
            "hostile_budget": 128 << 20, "hostile_sockets": 16, "reads_budget": 64 << 20,
            "reads_derives": 24, "reads_hold_s": 3.0, "reads_baseline": 16,
            "redis_grown_bytes": 256 << 20, "conn_sockets": 1100, "conn_low_sockets": 300,
            "conn_head_timeout_s": 2.0, "turns_baseline": 12, "turns_hang_ups": 8,
            "turns_huge": 4, "turns_huge_bytes": 2 << 20, "pause_s": 4.0,
            "pause_chunks": 16}


@contextlib.contextmanager
def _workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvtier-faults-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def run_cases(names: list[str], scale: dict, report: Callable[[Row], None] = lambda r: None
              ) -> list[Row]:
    rows = []
    for name in names:
        with _workdir() as work:
            try:
                got = CASES[name](work, scale)
            except Exception as exc:  # noqa: BLE001 - a case that crashed is a failed row
                got = {"case": name, "ok": False, "outcome": f"crashed: {exc!r}",
                       "wrong_bytes": None, "failed_requests": None, "healthz_worst_ms": None,
                       "healthz_failures": None, "healthz_goal_met": False}
        rows.append(got)
        report(got)
    return rows


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvtier.errors import InvalidArgumentError

    names = list(CASES) if not args.cases else [c.strip() for c in args.cases.split(",")]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise InvalidArgumentError(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request is noise here
    console = Console() if Console().is_terminal else Console(width=160)
    scale = scales(args.quick, args.sessions)
    rows = run_cases(names, scale, lambda r: console.print(
        f"{'ok  ' if r['ok'] else 'FAIL'} {r['case']}: {r['outcome']}"))
    t = Table(title="kvtier bench faults", title_justify="left")
    for col in ("case", "ok", "wrong bytes", "failed requests", "worst /healthz ms", "outcome"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["case"], "yes" if r["ok"] else "NO", str(r["wrong_bytes"]),
                  str(r["failed_requests"]), str(r["healthz_worst_ms"]), r["outcome"])
    console.print(t)
    if args.out:
        from kvtier.benchmarks.results import write_result

        path = write_result(args.out, "faults", {
            "config": {"quick": args.quick, **scale, "healthz_goal_ms": HEALTHZ_GOAL_S * 1e3},
            "rows": rows,
        })
        console.print(f"wrote {path}")
    return 0 if all(r["ok"] for r in rows) else 1
