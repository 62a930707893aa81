"""Fault cases of reads a client makes the server do on its behalf, and of foreign objects
an operator (or an attacker with the disk) leaves in the tiers. Each against a real
``kvtier serve`` with two tenants, ``alice`` (the victim, who stores and reads her chunks)
and ``mallory`` (read and write scope, who attacks), while ``/healthz`` is probed.

- ``reads``: mallory makes the server read for her without a body of hers to charge: one
  on-disk key prefetched 96 times, batches whose reply can never fit, a read into a 4 KiB
  region, 24 concurrent derives of one large chunk, large replies she never reads, and
  every byte of the shared-memory regions she may take. The server's memory stays within
  1.2x (CPU arena + in-flight budget + staging idle cap) over its idle footprint, alice
  is never refused, and her chunks read back exact; how much slower her requests ran
  while mallory attacked is recorded (the goal: at most 2x).
- ``foreign``: files that are not chunks in the disk tier's folder (a named pipe, a
  folder, a chunk file grown sparse far past its header) and Redis values that are not
  chunks (one grown far past its header, one of another type inside a batch): each is one
  miss at the header's cost, every other chunk is served exact, every such key is
  storable again, and SIGTERM stops the server within its drain limit.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median

from kvtier.benchmarks.fault_parts import (
    HealthProbe,
    PeakRSS,
    Redis,
    Row,
    make_chunk,
    row,
    victim_during,
)
from kvtier.benchmarks.faults_tenants import ALICE, MALLORY, MiB, _http, _raw, _serve, _served

VICTIM_SLOWDOWN_GOAL = 2.0
"""Alice's median request time while mallory attacks, over her median before (a goal,
recorded, not asserted: timings belong to benchmarks)."""


def _chunk_of(nbytes: int, i: int, salt: int, layers: int = 8) -> tuple[str, bytes]:
    """A valid chunk of about ``nbytes`` (a little under: its header fits beside it)."""
    tokens = max(16, nbytes // (layers * 2 * 2 * 16 * 2) - 64)
    return make_chunk(i, tokens=tokens, layers=layers, salt=salt)


class _Victim:
    """Alice storing and reading small chunks of her own: each request's time, and every
    request the server refused (any status but 201 / 200)."""

    def __init__(self, url: str, salt: int) -> None:
        self.url = url
        self.salt = salt
        self.times: list[float] = []
        self.refused: list[int] = []
        self.stored: dict[str, bytes] = {}
        self._n = 0

    def one(self, http) -> None:
        key, blob = make_chunk(self._n, tokens=256, layers=8, salt=self.salt)
        self._n += 1
        for method, want in (("put", 201), ("get", 200)):
            t0 = time.perf_counter()
            if method == "put":
                r = http.put(f"/v1/chunks/{key}", content=blob)
            else:
                r = http.get(f"/v1/chunks/{key}")
            self.times.append(time.perf_counter() - t0)
            if r.status_code != want:
                self.refused.append(r.status_code)
        self.stored[key] = blob

    def run_until(self, done: threading.Event) -> None:
        with _http(self.url, ALICE) as http:
            while not done.is_set():
                self.one(http)


def _attack_reads(url: str, keys: dict[str, list[str]], scale: dict) -> dict[str, object]:
    """Mallory's reads, all at once; the status codes each kind of request got."""
    import httpx

    got: dict[str, object] = {}
    n_derives = scale["reads_derives"]

    def prefetch() -> None:
        with _http(url, MALLORY) as m:
            got["prefetch"] = m.post("/v1/chunks/prefetch",
                                     json={"keys": [keys["mid"][0]] * 96}).status_code

    def batch(i: int) -> int:
        with _http(url, MALLORY) as m:
            return m.post("/v1/chunks/batch/get", json={"keys": keys["big"]}).status_code

    def tiny_region() -> None:
        with _http(url, MALLORY) as m:
            region = m.post("/v1/regions", json={"bytes": 4096})
            if region.status_code != 201:
                got["tiny_region"] = region.status_code
                return
            got["tiny_region"] = m.post("/v1/chunks/batch/get-into-region", json={
                "keys": (keys["big"] + keys["big"])[:16], "region": region.json()["id"]}
            ).status_code
            m.delete(f"/v1/regions/{region.json()['id']}")

    def derive(i: int) -> int:
        with _http(url, MALLORY) as m:
            try:
                return m.post(f"/v1/chunks/{i:060x}dead/derive", json={
                    "source": keys["big"][0], "first_token": 0, "tokens": 64}).status_code
            except httpx.HTTPError:
                return -1

    def unread_replies() -> None:
        held = []
        auth = f"Authorization: Bearer {MALLORY}\r\n"
        for _ in range(8):
            s = _raw(url, rcvbuf=4096)
            s.sendall(f"GET /v1/chunks/{keys['huge'][0]} HTTP/1.1\r\nHost: x\r\n{auth}\r\n"
                      .encode())
            held.append(s)
        time.sleep(scale["reads_hold_s"])
        for s in held:
            s.close()

    with ThreadPoolExecutor(8 + n_derives) as pool:
        waits = [pool.submit(prefetch), pool.submit(tiny_region), pool.submit(unread_replies)]
        batches = [pool.submit(batch, i) for i in range(4)]
        derives = [pool.submit(derive, i) for i in range(n_derives)]
        for w in waits:
            w.result()
        got["batch"] = sorted({b.result() for b in batches})
        got["derive"] = sorted({d.result() for d in derives})
    return got


def _take_every_region(url: str, shm_bytes: int) -> tuple[int, int]:
    """Mallory asks for four regions that together are all of ``shm_bytes``, then alice
    asks for 1 MiB: (regions mallory got, alice's status)."""
    with _http(url, MALLORY) as m, _http(url, ALICE) as a:
        took = sum(m.post("/v1/regions", json={"bytes": shm_bytes // 4}).status_code == 201
                   for _ in range(4))
        return took, a.post("/v1/regions", json={"bytes": MiB}).status_code


def case_reads(work: Path, scale: dict) -> Row:
    budget = scale["reads_budget"]
    shm = 4 * budget
    idle_cap = 2 * budget  # the staging pool keeps at most the bodies' + the reads' budgets
    srv = _serve(work, tiers__cpu_bytes=budget, tiers__disk_bytes=32 * budget,
                 server__max_body_bytes=budget, server__max_inflight_bytes=budget,
                 server__reply_write_timeout_s=2, server__shm_bytes=shm).start()
    failed = 0
    try:
        keys: dict[str, list[str]] = {"huge": [], "mid": [], "big": []}
        stored: dict[str, bytes] = {}
        for name, size, n in (("huge", 3 * budget // 4, 1), ("mid", budget // 8, 1),
                              ("big", budget // 4, 12)):  # the last ones push these to disk
            for i in range(n):
                key, blob = _chunk_of(size, i, salt={"huge": 11, "mid": 12, "big": 13}[name])
                keys[name].append(key)
                stored[key] = blob
        with _http(srv.url, MALLORY) as m:
            for key, blob in stored.items():
                failed += m.put(f"/v1/chunks/{key}", content=blob).status_code != 201
        victim = _Victim(srv.url, salt=14)
        with _http(srv.url, ALICE) as a:
            for _ in range(scale["reads_baseline"]):
                victim.one(a)
        before = median(victim.times)
        victim.times.clear()
        time.sleep(1.0)  # settle after the uploads
        base = srv.rss_bytes()
        with HealthProbe(srv.url) as probe, PeakRSS(srv) as peak:
            codes, (took, alice_region) = victim_during(victim, lambda: (
                _attack_reads(srv.url, keys, scale), _take_every_region(srv.url, shm)))
        during = median(victim.times) if victim.times else float("nan")
        with _http(srv.url, ALICE) as a:
            wrong = lost = 0
            for key, blob in victim.stored.items():
                r = a.get(f"/v1/chunks/{key}")
                lost += r.status_code != 200
                wrong += 0 if r.status_code != 200 or r.content == _served(blob, "alice") \
                    else len(blob)
        failed += lost + len(victim.refused) + (alice_region != 201)
        grown = peak.peak - base
        # CPU arena + in-flight budget + staging idle cap (regions live in shm_dir, which
        # the server never maps: none of their bytes is in its RSS)
        bound = 1.2 * (budget + budget + idle_cap)
        slowdown = during / before if before > 0 else float("nan")
        ok = failed == 0 and wrong == 0 and grown <= bound
        out = row("reads on a tenant's behalf held to the budget", ok, wrong, failed, probe,
                  f"mallory's reads got {codes}; she took {took} of 4 regions, alice's region "
                  f"{alice_region}; server RSS grew {grown / MiB:.0f} MiB (bound "
                  f"{bound / MiB:.0f}); alice refused {len(victim.refused)} times, her "
                  f"median request {slowdown:.2f}x of before")
        return {**out, "rss_grown_bytes": grown, "rss_bound_bytes": bound,
                "victim_slowdown": round(slowdown, 3),
                "victim_goal_met": slowdown <= VICTIM_SLOWDOWN_GOAL}
    finally:
        srv.stop()


def _disk_file(work: Path, tenant: str, key: str) -> Path:
    (path,) = (work / "chunks").rglob(f"{tenant}.{key}.kvc")
    return path


def _foreign_files(work: Path, keys: list[str]) -> None:
    """A named pipe, a folder and a sparse giant in three chunk files' places."""
    fifo, folder, sparse = (_disk_file(work, "alice", k) for k in keys[:3])
    fifo.unlink()
    os.mkfifo(fifo)
    folder.unlink()
    folder.mkdir()
    (folder / "inside").write_bytes(b"not a chunk")
    os.truncate(sparse, 768 * MiB)


def _stopped_within(srv, limit_s: float) -> tuple[int | None, float]:
    assert srv.proc is not None
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    try:
        rc = srv.proc.wait(limit_s)
    except Exception:  # noqa: BLE001 - a stop that hangs is a failed case
        rc = None
    return rc, time.monotonic() - t0


def case_foreign_objects(work: Path, scale: dict) -> Row:
    import redis

    red = Redis().start()
    cfg = {"tiers__cpu_bytes": 0, "tiers__disk_bytes": 1 << 30}
    chunks = dict(make_chunk(i, tokens=256, layers=8, salt=21) for i in range(8))
    srv = _serve(work, **cfg).start()
    failed = wrong = 0
    notes: list[str] = []
    try:
        with _http(srv.url, ALICE) as a:
            for k, b in chunks.items():
                failed += a.put(f"/v1/chunks/{k}", content=b).status_code != 201
        srv.stop()
        bad = list(chunks)[:3]
        _foreign_files(work, bad)
        srv = _serve(work, **cfg).start()
        base = srv.rss_bytes()
        with HealthProbe(srv.url) as probe, PeakRSS(srv) as peak, _http(srv.url, ALICE) as a:
            codes = [a.get(f"/v1/chunks/{k}").status_code for k in chunks]
            failed += sum(c != 404 for c in codes[:3]) + sum(c != 200 for c in codes[3:])
            for k, b in list(chunks.items())[3:]:
                got = a.get(f"/v1/chunks/{k}")
                wrong += 0 if got.status_code != 200 or got.content == _served(b, "alice") \
                    else len(b)
            again = [a.put(f"/v1/chunks/{k}", content=chunks[k]).status_code for k in bad]
            failed += sum(c != 201 for c in again)
            for k in bad:
                got = a.get(f"/v1/chunks/{k}")
                failed += got.status_code != 200
                wrong += 0 if got.status_code != 200 or got.content == _served(chunks[k], "alice") \
                    else len(chunks[k])
        notes.append(f"disk: a pipe, a folder, a sparse 768 MiB file read as {codes[:3]}, "
                     f"stored again as {again}, RSS grew {(peak.peak - base) / MiB:.0f} MiB")
        disk_grown = peak.peak - base
        rc, took = _stopped_within(srv, 15)
        notes.append(f"SIGTERM: exit {rc} after {took:.1f} s")
        failed += rc != 0
        (work / "redis").mkdir()
        srv = _serve(work / "redis", tiers__cpu_bytes=0, tiers__disk_bytes=0,
                     tiers__redis_url=red.url).start()
        with _http(srv.url, ALICE) as a:
            for k, b in chunks.items():
                failed += a.put(f"/v1/chunks/{k}", content=b).status_code != 201
            r = redis.Redis.from_url(red.url)
            grown_key, typed_key = (next(iter(r.scan_iter(f"*{k}*"))) for k in bad[:2])
            r.setrange(grown_key, scale["redis_grown_bytes"], b"x")
            r.delete(typed_key)
            r.rpush(typed_key, b"not a chunk")
            base = srv.rss_bytes()
            with PeakRSS(srv) as rpeak:
                import msgpack

                reply = a.post("/v1/chunks/batch/get", json={"keys": list(chunks)})
                values = msgpack.unpackb(reply.content) if reply.status_code == 200 else []
            served = [v is not None for v in values]
            failed += served != [False, False] + [True] * (len(chunks) - 2)
            for b, v in zip(chunks.values(), values, strict=False):
                if v is not None and v != _served(b, "alice"):
                    wrong += len(b)
            again = [a.put(f"/v1/chunks/{k}", content=chunks[k]).status_code for k in bad[:2]]
            notes.append(f"redis: a grown value and a list in a batch of {len(chunks)}: "
                         f"{sum(served)} served; stored again as {again}; RSS grew "
                         f"{(rpeak.peak - base) / MiB:.0f} MiB")
        redis_grown = rpeak.peak - base
        ok = failed == 0 and wrong == 0 and max(disk_grown, redis_grown) <= 64 * MiB
        return row("foreign objects in the tiers", ok, wrong, failed, probe, "; ".join(notes))
    finally:
        srv.stop()
        red.stop()


CASES = {
    "reads": case_reads,
    "foreign": case_foreign_objects,
}
