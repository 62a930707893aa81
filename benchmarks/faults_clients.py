"""Fault cases of clients that hold what the service has least of (descriptors, engine
steps, a scheduler's patience), each against a real ``kvtier serve`` process over loopback,
with two tenants: ``alice`` (the victim, who works as usual) and ``mallory`` (who attacks).
An ``operator`` token (admin scope) reads ``/metrics`` and the sessions.

- ``connections``: a sidecar started with a soft descriptor limit of 1,024 (as a shell
  hands it over) and a short ``server.request_head_timeout_s``. Mallory opens more sockets
  than that limit and never sends a byte; meanwhile alice reads her chunk from disk and
  stores a new one (the server raised its limit at start), and the server closes every one
  of mallory's sockets at the head deadline. Then a server whose hard limit is 256 (it
  cannot raise it): under 300 idle sockets alice is served or refused honestly (never 404,
  500 or 507: a lack of descriptors is neither a missing chunk, a crash nor a full tier).
- ``turns``: an engine-mode server on a tiny generated model. Mallory sends chat turns
  with a large ``max_tokens`` and hangs up after 0.2 s, and histories far past the
  context; alice runs short greedy turns meanwhile. Alice is never refused and her replies
  are the ones she gets alone; the hung-up turns stop generating (aborted at the engine's
  next step); the histories are 400 ``context_length_exceeded`` and leave no session.
  How much slower alice's turns ran is recorded (the goal: at most 2x).
- ``sidecar-pause``: the vLLM connector's side of a stalled sidecar, without vLLM: its
  scheduler side looks up a stored prefix every 50 ms (as vLLM's scheduler does) while the
  server is paused (SIGSTOP), then resumed (SIGCONT). The first lookup pays the lookup
  deadline, the rest are misses at once; after the resume the breaker's probe finds the
  server and lookups hit again; loads are bit-exact. Lookup times and the seconds from
  SIGCONT to the first hit are recorded against their goals.

In every case the server's RSS growth is recorded.
"""

from __future__ import annotations

import json
import resource
import selectors
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kvtier.benchmarks.fault_parts import (
    HealthProbe,
    OpenFiles,
    PeakRSS,
    Row,
    Serve,
    differing_bytes,
    make_chunk,
    row,
    victim_during,
)
from kvtier.benchmarks.faults_reads import VICTIM_SLOWDOWN_GOAL
from kvtier.benchmarks.faults_tenants import ALICE, MALLORY, MiB, _http, _served

if TYPE_CHECKING:
    import torch

    from kvtier.connectors.chunk_store import RemoteChunkStore
    from kvtier.connectors.vllm_blocks import ChunkGrid
    from kvtier.connectors.vllm_scheduler import SchedulerSide
    from kvtier.connectors.vllm_worker import WorkerSide

OPERATOR = "token-operator-1"
TOKENS = json.dumps([
    {"token": ALICE, "tenant": "alice", "scopes": ["read", "write", "chat"]},
    {"token": MALLORY, "tenant": "mallory", "scopes": ["read", "write", "chat"]},
    {"token": OPERATOR, "tenant": "ops", "scopes": ["admin"]},
])
CONTEXT_EXCEEDED = "context_length_exceeded"
"""The error type of a chat history that cannot fit the model's context (OpenAI's)."""
PATIENCE_S = 60.0
"""How long a wait for the server to act may take before the case fails (a busy host)."""


def _serve(work: Path, **config) -> Serve:
    (work / "shm").mkdir(parents=True, exist_ok=True)
    return Serve(work, server__tokens=TOKENS, server__shm_dir=str(work / "shm"), **config)


@dataclass(frozen=True)
class Scrape:
    """One read of a server's ``/metrics``: each sample by name and labels."""

    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]

    @classmethod
    def of(cls, url: str) -> Scrape:
        from prometheus_client.parser import text_string_to_metric_families

        with _http(url, OPERATOR) as ops:
            text = ops.get("/metrics").raise_for_status().text
        return cls({(s.name, frozenset(s.labels.items())): s.value
                    for family in text_string_to_metric_families(text)
                    for s in family.samples})

    def value(self, name: str, **labels: str) -> float:
        """A sample's value (0 where the server has not counted it yet)."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def by_label(self, name: str, label: str) -> dict[str, int]:
        """Every sample of ``name``, by the value of ``label``."""
        return {dict(labels)[label]: int(v) for (n, labels), v in self.samples.items()
                if n == name and label in dict(labels)}


# --- connections -------------------------------------------------------------------------


@contextmanager
def _soft_open_files(at_least: int) -> Iterator[None]:
    """This process's soft descriptor limit raised to hold ``at_least`` sockets (within
    the hard limit), and put back after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < at_least:
        raise RuntimeError(f"the bench needs {at_least} descriptors; the hard limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < at_least:
        resource.setrlimit(resource.RLIMIT_NOFILE, (at_least, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _idle_sockets(url: str, n: int) -> list[socket.socket]:
    """Mallory's ``n`` connections, which never send a byte."""
    parts = urlsplit(url)
    return [socket.create_connection((parts.hostname, parts.port), timeout=PATIENCE_S)
            for _ in range(n)]


def _closed_by_server(socks: list[socket.socket], timeout_s: float) -> int:
    """How many of ``socks`` the server closed (end of stream or a reset) within
    ``timeout_s``; each is read as it becomes readable."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    closed = 0
    deadline = time.monotonic() + timeout_s
    try:
        while closed < len(socks) and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.5):
                try:
                    ended = key.fileobj.recv(4096) == b""  # type: ignore[union-attr]
                except (ConnectionResetError, BrokenPipeError):
                    ended = True
                except BlockingIOError:
                    continue
                if ended:
                    closed += 1
                    sel.unregister(key.fileobj)
    finally:
        sel.close()
    return closed


@dataclass
class IdleSocketsRun:
    """What one server did with mallory's idle sockets and alice's requests among them."""

    sockets: int
    statuses: list[int]
    """Alice's GET of her stored chunk, PUT of a new one, while mallory's sockets were open
    (0: her connection failed without a status)."""
    wrong: int
    held: int
    """Connections the server counted open right after alice was served."""
    closed: int
    """Mallory's sockets the server closed."""
    descriptor_limit: int
    closed_by_reason: dict[str, int]
    rss_grown: int


def _alice_request(send) -> tuple[int, bytes]:
    import httpx

    try:
        r = send()
    except httpx.HTTPError:
        return 0, b""
    return r.status_code, r.content


def _alice_among_idle_sockets(srv: Serve, sockets: int, scale: dict) -> IdleSocketsRun:
    """Alice's stored chunk read and a new one stored while mallory holds ``sockets`` idle
    connections to ``srv``; then every one of them is waited on to be closed."""
    old_key, old = make_chunk(1, tokens=256, layers=8, salt=31)
    new_key, new = make_chunk(2, tokens=256, layers=8, salt=31)
    with _http(srv.url, ALICE) as a:
        a.put(f"/v1/chunks/{old_key}", content=old).raise_for_status()
    base = srv.rss_bytes()
    with PeakRSS(srv) as peak:
        held = _idle_sockets(srv.url, sockets)
        try:
            with _http(srv.url, ALICE) as a:  # a connection of her own among mallory's
                got, body = _alice_request(lambda: a.get(f"/v1/chunks/{old_key}"))
                put, _ = _alice_request(lambda: a.put(f"/v1/chunks/{new_key}", content=new))
            open_now = int(Scrape.of(srv.url).value("kvtier_connections_open"))
            closed = _closed_by_server(held, scale["conn_head_timeout_s"] + PATIENCE_S)
        finally:
            for s in held:
                s.close()
    wrong = differing_bytes(body, _served(old, "alice")) if got == 200 else 0
    if put == 201:
        with _http(srv.url, ALICE) as a:
            back = a.get(f"/v1/chunks/{new_key}")
        wrong += (differing_bytes(back.content, _served(new, "alice"))
                  if back.status_code == 200 else len(new))  # stored, then lost
    after = Scrape.of(srv.url)
    return IdleSocketsRun(
        sockets=sockets, statuses=[got, put], wrong=wrong, held=open_now, closed=closed,
        descriptor_limit=int(after.value("kvtier_descriptor_limit")),
        closed_by_reason=after.by_label("kvtier_connections_closed_total", "reason"),
        rss_grown=peak.peak - base)


def case_connections(work: Path, scale: dict) -> Row:
    head_s = scale["conn_head_timeout_s"]
    cfg = {"tiers__cpu_bytes": 0, "tiers__disk_bytes": 256 * MiB,
           "server__request_head_timeout_s": head_s}
    many, few = scale["conn_sockets"], scale["conn_low_sockets"]
    with _soft_open_files(many + few + 512):
        srv = _serve(work / "raised", nofile=OpenFiles(1024), **cfg).start()
        try:
            with HealthProbe(srv.url) as probe:
                raised = _alice_among_idle_sockets(srv, many, scale)
        finally:
            srv.stop()
        srv = _serve(work / "low", nofile=OpenFiles(256, 256), **cfg).start()
        try:
            low = _alice_among_idle_sockets(srv, few, scale)
            alive = srv.proc is not None and srv.proc.poll() is None
        finally:
            srv.stop()
    failed = sum(s != want for s, want in zip(raised.statuses, (200, 201), strict=True))
    lying = [s for s in low.statuses if s in (404, 500, 507)]
    failed += len(lying)
    at_deadline = raised.closed_by_reason.get("head_timeout", 0)
    ok = (failed == 0 and raised.wrong == 0 and low.wrong == 0 and alive
          and raised.closed == many and at_deadline >= many and low.closed == few)
    out = row("idle sockets past the descriptor limit", ok, raised.wrong + low.wrong, failed,
              probe,
              f"started at soft limit 1024 (raised to {raised.descriptor_limit}): alice "
              f"{raised.statuses} among {many} idle sockets ({raised.held} open), "
              f"{raised.closed} of them closed ({at_deadline} at the {head_s:g} s head "
              "deadline); hard limit "
              f"256: alice {low.statuses} among {few}, {low.closed} closed "
              f"({low.closed_by_reason}); RSS grew {raised.rss_grown / MiB:.0f} / "
              f"{low.rss_grown / MiB:.0f} MiB")
    return {**out, "idle_sockets": many, "idle_sockets_closed": raised.closed,
            "connections_open_at_victim": raised.held,
            "descriptor_limit": raised.descriptor_limit,
            "closed_by_reason": raised.closed_by_reason, "victim_statuses": raised.statuses,
            "low_limit_idle_sockets": few, "low_limit_idle_sockets_closed": low.closed,
            "low_limit_descriptor_limit": low.descriptor_limit,
            "low_limit_closed_by_reason": low.closed_by_reason,
            "low_limit_victim_statuses": low.statuses,
            "rss_grown_bytes": max(raised.rss_grown, low.rss_grown)}


# --- turns -------------------------------------------------------------------------------

ALICE_TURN = [{"role": "user", "content": "Name three rivers and the seas they reach."}]
ALICE_MAX_TOKENS = 12
LONG_TURN = [{"role": "user", "content": "Count the mountains, one by one, as long as you can."}]
"""A prompt the tiny model does not end early: a turn runs to its ``max_tokens``."""
LONG_MAX_TOKENS = 1500
HANG_UP_AFTER_S = 0.2


def _engine_config() -> dict:
    """A small engine: the tiny model's whole context in its pool, tiers of a few MiB."""
    return {"pool__num_blocks": 128, "chunk_tokens": 64, "tiers__cpu_bytes": 16 * MiB,
            "tiers__disk_bytes": 64 * MiB, "tiers__disk_fsync": "false"}


@dataclass
class _ChatVictim:
    """Alice's short greedy turns, each in a throwaway session: each turn's time, every
    status but 200, and every reply that differs from the first one (greedy decoding of
    one prompt gives one reply)."""

    url: str
    times: list[float] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)
    reference: str | None = None
    wrong: int = 0
    turns: int = 0

    def one(self, http) -> None:
        import httpx

        t0 = time.perf_counter()
        self.turns += 1
        try:
            r = http.post("/v1/chat/completions", json={
                "messages": ALICE_TURN, "max_tokens": ALICE_MAX_TOKENS, "temperature": 0})
        except httpx.HTTPError:
            self.refused.append(0)  # no answer at all
            return
        self.times.append(time.perf_counter() - t0)
        if r.status_code != 200:
            self.refused.append(r.status_code)
            return
        text = r.json()["choices"][0]["message"]["content"]
        if self.reference is None:
            self.reference = text
        self.wrong += differing_bytes(text.encode(), self.reference.encode())

    def run_until(self, done: threading.Event) -> None:
        with _http(self.url, ALICE) as http:
            while not done.is_set():
                self.one(http)


def _hang_up(url: str, session: str) -> None:
    """A non-streaming turn of ``LONG_MAX_TOKENS`` whose client goes away after
    :data:`HANG_UP_AFTER_S`."""
    body = json.dumps({"messages": LONG_TURN, "max_tokens": LONG_MAX_TOKENS,
                       "temperature": 0}).encode()
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=PATIENCE_S) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Authorization: Bearer {MALLORY}\r\nX-Session-Id: {session}\r\n".encode()
                     + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(HANG_UP_AFTER_S)  # the attack itself: a client that leaves


def _history_past_the_context(http, session: str, nbytes: int):
    """A conversation of ``nbytes`` of text: far more than the model's context."""
    huge = "the quick brown fox " * (nbytes // 20)
    return http.post("/v1/chat/completions", headers={"X-Session-Id": session}, json={
        "messages": [{"role": "user", "content": huge}, {"role": "assistant", "content": "ok"},
                     {"role": "user", "content": "and then?"}], "max_tokens": 4})


@dataclass
class _Attack:
    """Mallory's turns: the sessions she hung up on, and what her huge histories got."""

    hung_up: list[str] = field(default_factory=list)
    huge: list[str] = field(default_factory=list)
    huge_replies: list[tuple[int, str | None]] = field(default_factory=list)


def _attack_turns(url: str, scale: dict) -> _Attack:
    """Mallory alternates turns she hangs up on with histories past the context."""
    attack = _Attack()
    with _http(url, MALLORY) as http:
        for i in range(max(scale["turns_hang_ups"], scale["turns_huge"])):
            if i < scale["turns_hang_ups"]:
                attack.hung_up.append(f"hang-up-{i}")
                _hang_up(url, attack.hung_up[-1])
            if i < scale["turns_huge"]:
                attack.huge.append(f"huge-{i}")
                r = _history_past_the_context(http, attack.huge[-1], scale["turns_huge_bytes"])
                kind = r.json().get("error", {}).get("type") if r.status_code != 200 else None
                attack.huge_replies.append((r.status_code, kind))
    return attack


def _sessions(url: str) -> dict[str, dict]:
    with _http(url, OPERATOR) as ops:
        return {s["id"]: s for s in ops.get("/v1/sessions").raise_for_status().json()}


def _hung_up_turns(url: str, sessions: list[str]) -> list[dict]:
    """The last turn of each of mallory's hung-up sessions, once none is running."""
    ids = [f"mallory:{s}" for s in sessions]
    deadline = time.monotonic() + PATIENCE_S
    while True:
        held = _sessions(url)
        if all(i in held and held[i]["turns"] and not held[i]["busy"] for i in ids):
            break
        if time.monotonic() > deadline:
            return []
        time.sleep(0.05)
    with _http(url, OPERATOR) as ops:
        return [ops.get(f"/v1/sessions/{i}").json()["history"][-1] for i in ids]


def case_turns(work: Path, scale: dict) -> Row:
    from kvtier.make_model.writer import make_model

    model = make_model("tiny", work / "tiny", seed=7).path
    srv = _serve(work, model=model, **_engine_config()).start()
    try:
        victim = _ChatVictim(srv.url)
        with _http(srv.url, ALICE) as a:
            for _ in range(scale["turns_baseline"]):
                victim.one(a)
        before = median(victim.times)
        victim.times.clear()
        base = srv.rss_bytes()
        with HealthProbe(srv.url) as probe, PeakRSS(srv) as peak:
            attack = victim_during(victim, lambda: _attack_turns(srv.url, scale))
            turns = _hung_up_turns(srv.url, attack.hung_up)
        during = median(victim.times) if victim.times else float("nan")
        metrics = Scrape.of(srv.url)
        held = _sessions(srv.url)
        with _http(srv.url, OPERATOR) as ops:
            huge_found = sum(f"mallory:{s}" in held
                             or ops.get(f"/v1/sessions/mallory:{s}").status_code != 404
                             for s in attack.huge)
        gone = int(metrics.value("kvtier_chat_client_gone_total", stream="false"))
        generated = [t["output_tokens"] for t in turns]
        aborted = sum(t["finish_reason"] == "abort" for t in turns)
        stopped = (len(turns) == len(attack.hung_up)
                   and all(n < LONG_MAX_TOKENS // 2 for n in generated))
        refused_huge = sum(r != (400, CONTEXT_EXCEEDED) for r in attack.huge_replies)
        failed = len(victim.refused) + refused_huge + huge_found
        slowdown = during / before if before > 0 else float("nan")
        ok = (failed == 0 and victim.wrong == 0 and stopped and aborted == len(attack.hung_up)
              and gone == len(attack.hung_up))
        grown = peak.peak - base
        out = row("turns hung up on and histories past the context", ok, victim.wrong, failed,
                  probe,
                  f"{len(attack.hung_up)} turns of {LONG_MAX_TOKENS} tokens hung up after "
                  f"{HANG_UP_AFTER_S:g} s: {aborted} aborted after {generated} tokens, "
                  f"{gone} counted gone; {len(attack.huge)} histories of "
                  f"{scale['turns_huge_bytes'] / MiB:.0f} MiB: {sorted(set(attack.huge_replies))}, "
                  f"{huge_found} sessions left; alice's {victim.turns} turns refused "
                  f"{len(victim.refused)} times, her median turn {slowdown:.2f}x of before "
                  f"({before * 1e3:.0f} ms); RSS grew {grown / MiB:.0f} MiB")
        return {**out, "hung_up_turns": len(attack.hung_up), "hung_up_aborted": aborted,
                "hung_up_tokens": generated, "client_gone": gone,
                "huge_histories": len(attack.huge), "huge_sessions_left": huge_found,
                "victim_turns": victim.turns, "victim_refused": len(victim.refused),
                "victim_median_before_s": round(before, 4),
                "victim_median_during_s": round(during, 4),
                "victim_slowdown": round(slowdown, 3),
                "victim_goal_met": slowdown <= VICTIM_SLOWDOWN_GOAL,
                "rss_grown_bytes": grown}
    finally:
        srv.stop()


# --- sidecar-pause -----------------------------------------------------------------------

PAUSE_DEADLINES = {"lookup_timeout_s": 0.5, "transfer_timeout_s": 2.0, "store_retry_s": 0.5}
LOOKUP_EVERY_S = 0.05
"""How often vLLM's scheduler asks about a waiting request (a pass every few ms; a lookup
per pass for a request it could not schedule)."""
KEEP_LOOKING_S = 2.0
"""How long lookups go on once they hit again (while ``/healthz`` is probed)."""
LOOKUP_MARGIN_S = 0.25
"""What a lookup may take past its deadline (thread wake-ups on a busy host): the goal."""
BLOCK = 16
CHUNK_BLOCKS = 4
LAYERS = 4


@dataclass(frozen=True)
class _Request:
    """The fields of vLLM's request the connector's scheduler side reads."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


def _caches(blocks: int, seed: int) -> dict[str, torch.Tensor]:
    """vLLM's per-layer caches ``[blocks, 2, block, kv_heads, head_dim]``, random KV."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(blocks, 2, BLOCK, 2, 64, generator=g).to(torch.float16)
            for i in range(LAYERS)}


def _transfers(keys: list[str], req: str):
    from kvtier.connectors.vllm_blocks import ChunkSpan, ChunkTransfer

    return [ChunkTransfer(req, [ChunkSpan(k, tuple(range(i * CHUNK_BLOCKS, (i + 1) * CHUNK_BLOCKS)))
                                for i, k in enumerate(keys)])]


@dataclass(frozen=True)
class _Lookup:
    """One lookup of the scheduler side: how long it took, and the tokens it found
    (None: it had not ended after :data:`PATIENCE_S`, a hang)."""

    seconds: float
    tokens: int | None


class _SchedulerThread:
    """vLLM's scheduler asking about one waiting request, on a thread of its own, so that
    a lookup that hangs is measured as one instead of hanging the bench."""

    def __init__(self, sched: SchedulerSide, request: _Request) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._sched = sched
        self._request = request
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vllm-scheduler")
        self.hung = False

    def _ask(self) -> _Lookup:
        t0 = time.perf_counter()
        tokens = self._sched.matched_tokens(self._request, 0)
        return _Lookup(time.perf_counter() - t0, tokens)

    def lookup(self) -> _Lookup:
        from concurrent.futures import TimeoutError as Hung

        if self.hung:
            return _Lookup(0.0, None)  # the thread is still held by the hung one
        try:
            return self._pool.submit(self._ask).result(timeout=PATIENCE_S)
        except Hung:
            self.hung = True
            return _Lookup(PATIENCE_S, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _Pause:
    """The server stopped (SIGSTOP) for ``seconds``, resumed (SIGCONT) by a timer,
    whatever the caller is doing then; ``resumed_at``: when (monotonic)."""

    def __init__(self, srv: Serve, seconds: float) -> None:
        self.srv = srv
        self.resumed = threading.Event()
        self.resumed_at = 0.0
        self._timer = threading.Timer(seconds, self.resume)

    def resume(self) -> None:
        if not self.resumed.is_set():
            self.srv.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
            self.resumed_at = time.monotonic()
            self.resumed.set()

    def __enter__(self) -> _Pause:
        self.srv.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        self.resume()


def _while_paused(scheduler: _SchedulerThread, pause: _Pause) -> list[_Lookup]:
    """A lookup every :data:`LOOKUP_EVERY_S` until the server is resumed."""
    out: list[_Lookup] = []
    while not pause.resumed.is_set() and not scheduler.hung:
        out.append(scheduler.lookup())
        pause.resumed.wait(LOOKUP_EVERY_S)
    return out


def _seconds_to_hit(scheduler: _SchedulerThread, since: float, hit: int) -> float | None:
    """Lookups every :data:`LOOKUP_EVERY_S` until one finds ``hit`` tokens: the seconds
    from ``since`` (None: none did within :data:`PATIENCE_S`)."""
    while time.monotonic() - since < PATIENCE_S and not scheduler.hung:
        if scheduler.lookup().tokens == hit:
            return time.monotonic() - since
        time.sleep(LOOKUP_EVERY_S)
    return None


def _loaded(reader: WorkerSide, keys: list[str]) -> int | None:
    """Load ``keys`` until a load has no error (a load that misses its deadline on a busy
    host is an error, its blocks for vLLM to recompute): the tries it took (None: none
    loaded within :data:`PATIENCE_S`)."""
    deadline = time.monotonic() + PATIENCE_S
    tries = 0
    while time.monotonic() < deadline:
        tries += 1
        reader.load(_transfers(keys, f"load-{tries}"))
        if not reader.take_load_errors():
            return tries
        time.sleep(LOOKUP_EVERY_S)
    return None


def _differing_bytes(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> int:
    import torch

    return sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
               for a, b in zip(src.values(), dst.values(), strict=True))


@dataclass
class _ConnectorSides:
    """The connector's scheduler side and two worker sides (one saves, one loads into
    caches of its own) on two stores of one sidecar, as vLLM's processes hold them."""

    lookups: RemoteChunkStore
    loads: RemoteChunkStore
    sched: SchedulerSide
    writer: WorkerSide
    reader: WorkerSide
    grid: ChunkGrid

    @classmethod
    def open(cls, url: str, src: dict, dst: dict, blocks: int) -> _ConnectorSides:
        from kvtier.chunk_format import max_chunk_bytes
        from kvtier.connectors.chunk_store import RemoteChunkStore, open_store
        from kvtier.connectors.vllm_blocks import ChunkGrid
        from kvtier.connectors.vllm_scheduler import SchedulerSide
        from kvtier.connectors.vllm_worker import WorkerSide

        grid = ChunkGrid(BLOCK, CHUNK_BLOCKS, b"faults|sidecar-pause")
        layer = next(iter(src.values()))
        block_bytes = LAYERS * layer[0].numel() * layer.element_size()
        slot = max_chunk_bytes(LAYERS, block_bytes * CHUNK_BLOCKS)
        options = {"url": url, "shm": True, **PAUSE_DEADLINES}
        lookups, loads = open_store(options, slot), open_store(options, slot)
        if not isinstance(lookups, RemoteChunkStore) or not isinstance(loads, RemoteChunkStore):
            raise RuntimeError(f"the connector's options {options} opened no remote store")
        writer, reader = WorkerSide(lambda: loads, grid), WorkerSide(lambda: loads, grid)
        writer.register(src, blocks)
        reader.register(dst, blocks)
        return cls(lookups, loads, SchedulerSide(lambda: lookups, grid), writer, reader, grid)

    def close(self) -> None:
        for part in (self.writer, self.reader, self.lookups, self.loads):
            part.close()


def case_sidecar_pause(work: Path, scale: dict) -> Row:
    from kvtier.connectors.store_breaker import BreakerState

    (work / "shm").mkdir()
    srv = Serve(work, tiers__cpu_bytes=64 * MiB, tiers__disk_bytes=256 * MiB,
                server__shm_dir=str(work / "shm")).start()
    chunks = scale["pause_chunks"]
    blocks = chunks * CHUNK_BLOCKS
    src, dst = _caches(blocks, seed=41), _caches(blocks, seed=42)
    prompt = _Request("waiting", list(range(1000, 1000 + blocks * BLOCK + 3)))
    lookup_s, retry_s = PAUSE_DEADLINES["lookup_timeout_s"], PAUSE_DEADLINES["store_retry_s"]
    hit = blocks * BLOCK
    sides: _ConnectorSides | None = None
    scheduler: _SchedulerThread | None = None
    try:
        sides = _ConnectorSides.open(srv.url, src, dst, blocks)
        scheduler = _SchedulerThread(sides.sched, prompt)
        keys = [k.key for k in sides.grid.keys(prompt.prompt_token_ids)][:chunks]
        sides.writer.save(_transfers(keys, "save"))
        saved = sides.writer.stats.saved_blocks
        stored = _seconds_to_hit(scheduler, time.monotonic(), hit) is not None
        base = srv.rss_bytes()
        with PeakRSS(srv) as peak:
            with _Pause(srv, scale["pause_s"]) as pause:
                paused = _while_paused(scheduler, pause)
                pause.resumed.wait()
            back_after = _seconds_to_hit(scheduler, pause.resumed_at, hit)
            with HealthProbe(srv.url) as probe:
                after: list[_Lookup] = []
                until = time.monotonic() + KEEP_LOOKING_S
                while time.monotonic() < until and not scheduler.hung:
                    after.append(scheduler.lookup())
                    time.sleep(LOOKUP_EVERY_S)
                load_tries = _loaded(sides.reader, keys)
        wrong = _differing_bytes(src, dst)
        times = [p.seconds for p in paused]
        slowest = max(times, default=0.0)
        paid = sum(t >= lookup_s * 0.9 for t in times)
        faults = sides.lookups.faults.counters()
        failed = (load_tries is None) + (saved != blocks) + (not stored)
        ok = (wrong == 0 and failed == 0 and back_after is not None and not scheduler.hung
              and slowest <= 2 * lookup_s and sides.lookups.breaker.state is BreakerState.CLOSED)
        resume_goal_s = retry_s + lookup_s + LOOKUP_EVERY_S
        out = row("sidecar paused under the connector's lookups", ok, wrong, failed, probe,
                  f"{len(times)} lookups while paused {scale['pause_s']:g} s: {paid} paid the "
                  f"{lookup_s:g} s deadline, the slowest {slowest * 1e3:.0f} ms, the rest "
                  f"misses at once (median {median(times or [0.0]) * 1e3:.1f} ms); hits again "
                  f"{'never' if back_after is None else f'{back_after:.2f} s'} after SIGCONT, "
                  f"{sum(a.tokens == hit for a in after)} of the {len(after)} lookups after; "
                  f"{len(keys)} chunks loaded in {load_tries} tries, {wrong} bytes wrong; "
                  f"counters {faults}; "
                  f"RSS grew {(peak.peak - base) / MiB:.0f} MiB")
        return {**out, "paused_lookups": len(times), "lookups_paid_deadline": paid,
                "lookup_slowest_s": round(slowest, 4), "lookup_hung": scheduler.hung,
                "hits_after_resume": sum(a.tokens == hit for a in after),
                "lookups_after_resume": len(after), "load_tries": load_tries,
                "lookup_goal_met": slowest <= lookup_s + LOOKUP_MARGIN_S,
                "hit_again_after_s": None if back_after is None else round(back_after, 3),
                "hit_again_goal_s": resume_goal_s,
                "hit_again_goal_met": back_after is not None and back_after <= resume_goal_s,
                "connector_counters": faults, "rss_grown_bytes": peak.peak - base}
    finally:
        if scheduler is not None:
            scheduler.close()
        if sides is not None:
            sides.close()
        srv.stop()


CASES = {
    "connections": case_connections,
    "turns": case_turns,
    "sidecar-pause": case_sidecar_pause,
}
