"""Fault cases of hostile and careless clients (issue "the service survives its own
clients"): each against a real ``kvtier serve`` with two tenants, ``alice`` (the victim,
who only stores and reads her chunks) and ``mallory`` (read and write scope, who attacks),
while ``/healthz`` is probed.

- ``regions``: mallory shrinks her regions and PUTs and GETs through them, and abandons
  regions until the shared-memory budget is hers; the server must not fault, and alice's
  request for a region must succeed once mallory's leases ran out.
- ``hostile``: mallory holds unfinished chunked bodies, declares bodies she never sends,
  asks for replies she never reads and for one key 768 times; the server's memory stays
  within 1.2x (both in-flight budgets + tiers + regions), alice is never told 503 for
  longer than mallory's traffic lasts, and every chunk of alice's reads back exact.
- ``versions``: mallory overwrites her own keys (409, whether the first version is in RAM,
  on disk only or across a restart) and copies alice's chunk files under her own name (a
  miss, never alice's KV); alice's chunks read back exact.
- ``stop``: SIGTERM while clients work: exit 0 within seconds, regions removed, every
  acknowledged chunk served after a restart.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

from kvtier.benchmarks.fault_parts import HealthProbe, Row, Serve, make_chunk, row

ALICE, MALLORY = "token-alice-0001", "token-mallory-01"
TOKENS = json.dumps([{"token": ALICE, "tenant": "alice", "scopes": ["read", "write"]},
                     {"token": MALLORY, "tenant": "mallory", "scopes": ["read", "write"]}])
MiB = 1 << 20


def _serve(work: Path, **config) -> Serve:
    (work / "shm").mkdir(exist_ok=True)
    return Serve(work, server__tokens=TOKENS, server__shm_dir=str(work / "shm"), **config)


def _http(url: str, token: str):
    import httpx

    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)


def _raw(url: str, rcvbuf: int | None = None) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect((parts.hostname, parts.port))
    return sock


def _served(blob: bytes, tenant: str) -> bytes:
    from kvtier.chunk_format import with_namespace

    return with_namespace(blob, tenant)


def _other_version(key: str, blob: bytes) -> bytes:
    """Another chunk under the same key (the same shape, other KV)."""
    from kvtier.chunk_format import decode_chunk, encode_chunk

    header, kv = decode_chunk(blob, key)
    return encode_chunk(key, header.fingerprint, (kv.float() + 1).to(kv.dtype))


def _alice_reads_back(http, chunks: dict[str, bytes]) -> tuple[int, int]:
    """(wrong bytes, lost chunks) of alice's chunks read back."""
    wrong = lost = 0
    for k, b in chunks.items():
        r = http.get(f"/v1/chunks/{k}")
        if r.status_code != 200:
            lost += 1
        elif r.content != _served(b, "alice"):
            wrong += max(len(r.content), len(b))
    return wrong, lost


def case_regions(work: Path, scale: dict) -> Row:
    srv = _serve(work, tiers__cpu_bytes=64 * MiB, tiers__disk_bytes=256 * MiB,
                 server__shm_bytes=8 * MiB, server__shm_lease_s=2).start()
    failed = 0
    notes = []
    try:
        with HealthProbe(srv.url) as probe, _http(srv.url, ALICE) as alice, \
                _http(srv.url, MALLORY) as mallory:
            key, blob = make_chunk(1, tokens=256, layers=8)
            regions = [mallory.post("/v1/regions", json={"bytes": 2 * MiB}).json()
                       for _ in range(4)]  # all of shm_bytes, then abandoned
            with open(regions[0]["path"], "r+b") as f:
                f.write(blob)
                f.truncate(4096)  # shrunk below the chunk it names
            r = mallory.put(f"/v1/chunks/{key}", params={"region": regions[0]["id"],
                                                         "length": len(blob)})
            failed += r.status_code != 400
            failed += mallory.put(f"/v1/chunks/{key}", content=blob).status_code != 201
            os.truncate(regions[1]["path"], 0)
            r = mallory.get(f"/v1/chunks/{key}", params={"region": regions[1]["id"]})
            failed += r.status_code != 200
            first = alice.post("/v1/regions", json={"bytes": MiB}).status_code
            notes.append(f"alice's region while mallory held them all: {first}")
            time.sleep(2.5)  # mallory's leases run out
            got = alice.post("/v1/regions", json={"bytes": MiB})
            failed += got.status_code != 201
            notes.append(f"after mallory's leases ended: {got.status_code}")
            alive = srv.proc is not None and srv.proc.poll() is None
        ok = failed == 0 and alive and first == 507
        return row("regions shrunk and abandoned", ok, 0, failed, probe,
                   f"shrunk region PUT 400, GET 200, server alive: {alive}; " + "; ".join(notes))
    finally:
        srv.stop()


def _stalled_sockets(url: str, n: int, body: int, big_key: str) -> list[socket.socket]:
    """Mallory's ``n`` x 3 sockets: a chunked body half sent, a large body declared and
    never sent, a large reply asked for and never read."""
    auth = f"Authorization: Bearer {MALLORY}\r\n"
    held = []
    for i in range(n):
        s = _raw(url)
        s.sendall((f"PUT /v1/chunks/{i:064x} HTTP/1.1\r\nHost: x\r\n{auth}"
                   "Transfer-Encoding: chunked\r\n\r\n").encode()
                  + f"{MiB:x}\r\n".encode() + bytes(MiB) + b"\r\n")
        held.append(s)
        s = _raw(url)
        s.sendall((f"PUT /v1/chunks/{i + 1000:064x} HTTP/1.1\r\nHost: x\r\n{auth}"
                   f"Content-Length: {body}\r\n\r\n").encode())
        held.append(s)
        s = _raw(url, rcvbuf=4096)
        s.sendall(f"GET /v1/chunks/{big_key} HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode())
        held.append(s)
    return held


def case_hostile_clients(work: Path, scale: dict) -> Row:
    """Unfinished bodies, idle declared bodies, unread replies and duplicate keys against
    one budget, while alice stores and reads."""
    budget = scale["hostile_budget"]
    body = budget // 2
    srv = _serve(work, tiers__cpu_bytes=budget, tiers__disk_bytes=4 * budget,
                 server__max_body_bytes=body, server__max_inflight_bytes=budget,
                 server__body_idle_timeout_s=2, server__reply_write_timeout_s=2,
                 server__chunk_slot_bytes=body, server__shm_bytes=0).start()
    failed = 0
    held: list[socket.socket] = []
    try:
        base = srv.rss_bytes()
        peak = base
        mine = dict(make_chunk(i, tokens=1024, layers=8, salt=1) for i in range(8))
        big_key, big = make_chunk(99, tokens=body // (8 * 2 * 2 * 16 * 2) - 64, layers=8)
        with HealthProbe(srv.url) as probe, _http(srv.url, ALICE) as alice, \
                _http(srv.url, MALLORY) as mallory:
            failed += mallory.put(f"/v1/chunks/{big_key}", content=big).status_code != 201
            held += _stalled_sockets(srv.url, scale["hostile_sockets"], body, big_key)
            dup = mallory.post("/v1/chunks/batch/get", json={"keys": [big_key] * 768})
            failed += dup.status_code not in (413, 503)  # too large; or her budget is full
            # Alice goes on: any 503 she meets must end within mallory's timeouts.
            started = time.monotonic()
            busy_until = started
            for k, b in mine.items():
                while True:
                    peak = max(peak, srv.rss_bytes())
                    r = alice.put(f"/v1/chunks/{k}", content=b)
                    if r.status_code != 503:
                        failed += r.status_code != 201
                        break
                    busy_until = time.monotonic()
                    if busy_until - started > 30:
                        failed += 1
                        break
                    time.sleep(0.1)
            peak = max(peak, srv.rss_bytes())
            wrong, lost = _alice_reads_back(alice, mine)
            failed += lost
        grown = peak - base
        bound = 1.2 * (2 * budget + budget)  # the two in-flight budgets + the RAM tier
        waited = busy_until - started
        ok = failed == 0 and wrong == 0 and grown <= bound and waited <= 10
        out = row("hostile clients (bodies, replies, duplicates)", ok, wrong, failed, probe,
                  f"{3 * scale['hostile_sockets']} stalled sockets, a 768-key duplicate batch "
                  f"({dup.status_code}); server RSS grew {grown / MiB:.0f} MiB (bound "
                  f"{bound / MiB:.0f}); alice waited {waited:.1f} s; her 8 chunks exact")
        return {**out, "rss_grown_bytes": grown, "rss_bound_bytes": bound}
    finally:
        for s in held:
            s.close()
        srv.stop()


def case_versions_and_namespaces(work: Path, scale: dict) -> Row:
    cfg = {"tiers__cpu_bytes": 2 * MiB, "tiers__disk_bytes": 256 * MiB,
           "server__chunk_slot_bytes": 256 * 1024}
    srv = _serve(work, **cfg).start()
    failed = wrong = 0
    try:
        mine = dict(make_chunk(i, tokens=256, layers=4, salt=2) for i in range(4))
        k, v1 = make_chunk(50, tokens=256, layers=4, salt=3)
        v2 = _other_version(k, v1)
        with _http(srv.url, ALICE) as alice, _http(srv.url, MALLORY) as mallory:
            for key, b in mine.items():
                failed += alice.put(f"/v1/chunks/{key}", content=b).status_code != 201
            failed += mallory.put(f"/v1/chunks/{k}", content=v1).status_code != 201
            codes = [mallory.put(f"/v1/chunks/{k}", content=v2).status_code]  # v1 in RAM
            for i in range(40):  # push v1 out of RAM
                fk, fb = make_chunk(100 + i, tokens=256, layers=4, salt=5)
                mallory.put(f"/v1/chunks/{fk}", content=fb)
            codes.append(mallory.put(f"/v1/chunks/{k}", content=v2).status_code)  # disk only
            got = mallory.get(f"/v1/chunks/{k}").content
            wrong += 0 if got == _served(v1, "mallory") else len(got)
        srv.stop()
        for path in (work / "chunks").rglob("alice.*.kvc"):  # alice's files under her name
            shutil.copy(path, path.with_name(path.name.replace("alice.", "mallory.", 1)))
        srv = _serve(work, **cfg)
        srv.start()
        with HealthProbe(srv.url) as probe, _http(srv.url, ALICE) as alice, \
                _http(srv.url, MALLORY) as mallory:
            codes.append(mallory.put(f"/v1/chunks/{k}", content=v2).status_code)  # restarted
            stolen = sum(mallory.get(f"/v1/chunks/{key}").status_code == 200 for key in mine)
            w, lost = _alice_reads_back(alice, mine)
            wrong += w
            failed += lost + stolen
        ok = failed == 0 and wrong == 0 and codes == [409, 409, 409]
        return row("one version per key; chunks bound to their tenant", ok, wrong, failed,
                   probe, f"overwrites in RAM, on disk only, after a restart: {codes}; "
                   f"alice's files copied under mallory's name served to mallory: {stolen}")
    finally:
        srv.stop()


def case_clean_stop(work: Path, scale: dict) -> Row:
    srv = _serve(work, tiers__cpu_bytes=0, tiers__disk_bytes=256 * MiB).start()
    acked: dict[str, bytes] = {}
    stop = threading.Event()

    def writer() -> None:
        import httpx

        with _http(srv.url, ALICE) as alice:
            for i in range(100_000):
                if stop.is_set():
                    return
                k, b = make_chunk(i, tokens=64, layers=2, salt=6)
                try:
                    if alice.put(f"/v1/chunks/{k}", content=b).status_code == 201:
                        acked[k] = b
                except httpx.HTTPError:
                    return

    with _http(srv.url, ALICE) as alice:
        alice.post("/v1/regions", json={"bytes": MiB})
    t = threading.Thread(target=writer)
    t.start()
    time.sleep(1.0)
    assert srv.proc is not None
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    try:
        rc = srv.proc.wait(30)
    except Exception:  # noqa: BLE001 - a stop that hangs is a failed case
        rc = None
    took = time.monotonic() - t0
    stop.set()
    t.join()
    leftover = list((work / "shm").iterdir())
    srv2 = _serve(work, tiers__cpu_bytes=0, tiers__disk_bytes=256 * MiB).start()
    try:
        with HealthProbe(srv2.url) as probe, _http(srv2.url, ALICE) as alice:
            wrong, lost = _alice_reads_back(alice, acked)
        ok = rc == 0 and took < 15 and not leftover and wrong == 0 and lost == 0 and acked
        return row("SIGTERM while clients write", ok, wrong, lost, probe,
                   f"exit {rc} after {took:.1f} s; {len(leftover)} files left in shm_dir; "
                   f"{len(acked)} acknowledged chunks, all read back after a restart")
    finally:
        srv2.stop()


CASES = {
    "regions": case_regions,
    "hostile": case_hostile_clients,
    "versions": case_versions_and_namespaces,
    "stop": case_clean_stop,
}
