"""The parts of the fault suite (:mod:`kvtier.benchmarks.faults`): a ``kvtier serve``
process, a private ``redis-server``, a ``/healthz`` probe, chunks, and a case's row."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

HEALTHZ_GOAL_S = 0.1
Row = dict[str, Any]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class OpenFiles:
    """A child's descriptor limit (``RLIMIT_NOFILE``), as a shell may hand it over:
    ``soft``, and ``hard`` (None: this process's hard limit, unchanged)."""

    soft: int
    hard: int | None = None

    def apply(self) -> None:
        """Set the limit in the child, before it runs (``preexec_fn``)."""
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE,
                           (self.soft, hard if self.hard is None else self.hard))


class Serve:
    """``kvtier serve`` as a child process with its config in the environment: a sidecar,
    or engine mode on ``model`` (a model directory); ``nofile``: its descriptor limit at
    start (unset: this process's)."""

    def __init__(self, workdir: Path, model: Path | None = None, nofile: OpenFiles | None = None,
                 **config: Any) -> None:
        self.workdir = workdir
        self.model = model
        self.nofile = nofile
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = dict(os.environ)
        self.env.update({
            "KVTIER_TIERS__DISK_DIR": str(workdir / "chunks"),
            "KVTIER_TIERS__DISK_FSYNC": "true",
            "KVTIER_SERVER__CHUNK_SLOT_BYTES": str(1 << 20),
        })
        self.env.update({f"KVTIER_{k.upper()}": str(v) for k, v in config.items()})
        self.proc: subprocess.Popen | None = None

    def start(self) -> Serve:
        import httpx

        model = ["--model", str(self.model)] if self.model is not None else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli.main", "serve", "--port", str(self.port),
             "--log-level", "error", *model], env=self.env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=self.nofile.apply if self.nofile is not None else None,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError("kvtier serve did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def rss_bytes(self) -> int:
        try:
            text = Path(f"/proc/{self.proc.pid}/status").read_text()  # type: ignore[union-attr]
        except OSError:
            return 0
        for line in text.splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0


class PeakRSS:
    """The server's largest RSS, sampled every 20 ms from a thread of this process."""

    def __init__(self, srv: Serve) -> None:
        self.srv = srv
        self.peak = srv.rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.srv.rss_bytes())

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.srv.rss_bytes())


class Victim(Protocol):
    """A tenant going on with its own requests until told to stop."""

    def run_until(self, done: threading.Event) -> None: ...


T = TypeVar("T")


def victim_during(victim: Victim, attack: Callable[[], T]) -> T:
    """``attack()`` run while ``victim`` goes on with its requests on a thread of its own
    (stopped, and waited for, once the attack is over): what the attack returned."""
    done = threading.Event()
    thread = threading.Thread(target=victim.run_until, args=(done,))
    thread.start()
    try:
        return attack()
    finally:
        done.set()
        thread.join()


class Redis:
    """A private ``redis-server`` that can be killed, paused and resumed."""

    def __init__(self, *extra: str) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-faults-redis-"))
        self.args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", str(self.dir), "--protected-mode", "no",
                     *extra]
        self.proc: subprocess.Popen | None = None

    def start(self) -> Redis:
        import redis

        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        for _ in range(200):
            with contextlib.suppress(redis.ConnectionError):
                redis.Redis.from_url(self.url).ping()
                return self
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None:
            self.signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_PROBE = r"""
import json, sys, threading, time
import httpx
url, stop, worst, failures = sys.argv[1], threading.Event(), 0.0, 0
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
with httpx.Client(timeout=5) as http:
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            ok = http.get(url + "/healthz").status_code == 200
        except httpx.HTTPError:
            ok = False
        worst = max(worst, time.perf_counter() - t0)
        failures += not ok
        stop.wait(0.02)
print(json.dumps({"worst": worst, "failures": failures}))
"""


class HealthProbe:
    """Asks ``/healthz`` every 20 ms from a process of its own (so the load the case makes
    in this process cannot delay the probe); ``worst`` is the slowest answer, a request
    that failed counts as its timeout."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst = 0.0
        self.failures = 0
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> HealthProbe:
        self._proc = subprocess.Popen([sys.executable, "-c", _PROBE, self.url],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        time.sleep(0.2)  # the probe is running before the case starts
        return self

    def __exit__(self, *exc: object) -> None:
        import json

        assert self._proc is not None
        out, _ = self._proc.communicate("stop\n", timeout=30)
        got = json.loads(out.strip().splitlines()[-1])
        self.worst, self.failures = got["worst"], got["failures"]


# --- chunks ------------------------------------------------------------------------------


def make_chunk(i: int, tokens: int = 64, layers: int = 4, salt: int = 0) -> tuple[str, bytes]:
    """A valid chunk under its own key, content determined by (i, salt)."""
    import torch

    from kvtier.chunk_format import encode_chunk

    key = f"{salt:08x}{i:056x}"
    g = torch.Generator().manual_seed(i * 7919 + salt)
    kv = torch.randn(layers, 2, tokens, 2, 16, generator=g).to(torch.float16)
    return key, encode_chunk(key, b"faults", kv)


def wrong_bytes(got: bytes | None, uploaded: bytes) -> int:
    """Bytes served that are not what was stored (a miss serves none: 0). What is stored
    for an upload is the same chunk naming the uploader's tenant (the suite's servers run
    open: tenant ``default``)."""
    from kvtier.chunk_format import with_namespace
    from kvtier.config import DEFAULT_TENANT

    want = with_namespace(uploaded, DEFAULT_TENANT)
    return 0 if got is None else differing_bytes(got, want)


def differing_bytes(got: bytes, want: bytes) -> int:
    """Bytes of ``got`` that differ from ``want``'s (a length difference counts in full)."""
    if got == want:
        return 0
    n = min(len(got), len(want))
    return sum(a != b for a, b in zip(got[:n], want[:n], strict=True)) + abs(len(got) - len(want))


def row(case: str, ok: bool, wrong: int, failed: int, probe: HealthProbe, outcome: str) -> Row:
    return {"case": case, "ok": bool(ok), "outcome": outcome, "wrong_bytes": int(wrong),
            "failed_requests": int(failed), "healthz_worst_ms": round(probe.worst * 1e3, 1),
            "healthz_failures": probe.failures,
            "healthz_goal_met": probe.worst <= HEALTHZ_GOAL_S}
