"""Real ``redis-server`` processes for tests: one server, or a 3-node Redis Cluster.

Each server runs in its own process group on a free loopback port with a temp dir and no
persistence, so a test can kill it (SIGKILL), pause it (SIGSTOP: a "slow" server whose
sockets accept but never answer) and restart it on the same port. Fixtures stop every
process they started, also when a test fails. Never touches the system server on 6379.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
_CLUSTER_BUS_OFFSET = 10000


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """A free loopback port (and port + 10000 for the cluster bus when asked)."""
    for _ in range(200):
        port = random.randint(20000, 29999)
        if port == 6379 or not _port_free(port):
            continue
        if cluster_bus and not _port_free(port + _CLUSTER_BUS_OFFSET):
            continue
        return port
    raise RuntimeError("no free loopback port found")


class RedisServer:
    """One ``redis-server`` process; ``stop``/``start`` keep the port and directory."""

    def __init__(self, port: int | None = None, *, cluster: bool = False, extra: list[str] | None = None):
        self.cluster = cluster
        self.port = port or free_port(cluster_bus=cluster)
        self.dir = Path(tempfile.mkdtemp(prefix=f"kvtier-redis-{self.port}-"))
        self.extra = list(extra or [])
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        args = [
            REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.dir), "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--logfile", str(self.dir / "redis.log"),
            "--protected-mode", "no",
        ]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "2000"]
        return args + self.extra

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.proc = subprocess.Popen(
            self._args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on {self.port} exited: {log}")
            with contextlib.suppress(redis.RedisError), self.client(timeout=0.5) as c:
                if c.ping():
                    return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server on {self.port} did not answer PING in {timeout}s")

    def client(self, timeout: float = 2.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout,
                           socket_connect_timeout=timeout)

    def _signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections, nothing is answered (a hung server)."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def stop(self) -> None:
        """SIGKILL the process group (works while paused too) and reap it."""
        if self.proc is None:
            return
        self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisClusterProcs:
    """Three masters (no replicas) sharing the 16384 slots, ``cluster_state:ok``."""

    def __init__(self, n: int = 3):
        self.nodes = [RedisServer(cluster=True) for _ in range(n)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.nodes)

    def start(self, timeout: float = 20.0) -> RedisClusterProcs:
        try:
            return self._start(timeout)
        except BaseException:
            self.cleanup()
            raise

    def _start(self, timeout: float) -> RedisClusterProcs:
        for s in self.nodes:
            s.start()
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *[f"127.0.0.1:{s.port}" for s in self.nodes],
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self._state_ok(s) for s in self.nodes):
                return self
            time.sleep(0.1)
        raise RuntimeError("redis cluster did not reach cluster_state:ok")

    @staticmethod
    def _state_ok(s: RedisServer) -> bool:
        try:
            with s.client() as c:
                return c.cluster("info").get("cluster_state") == "ok"
        except redis.RedisError:
            return False

    def cleanup(self) -> None:
        for s in self.nodes:
            s.cleanup()


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh single server per test (faults tests kill and restart it)."""
    server = RedisServer()
    try:
        yield server.start()
    finally:
        server.cleanup()


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterProcs]:
    """One real 3-node cluster per test module (starting one takes about a second)."""
    cluster = RedisClusterProcs()
    try:
        yield cluster.start()
    finally:
        cluster.cleanup()
