"""``kvtier serve`` as its own process with a chosen descriptor limit and log pipes, and the
little a test needs to talk to it: raw sockets, metrics by name."""

from __future__ import annotations

import os
import re
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from kvtier.chunk_format import encode_chunk
from tests.serve_process import free_port


def chunk(key: str, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return encode_chunk(key, b"limits-test", torch.randn(4, 2, 16, 2, 8, generator=g).half())


class Served:
    """A running ``kvtier serve``; :meth:`stop` ends it (SIGKILL where it will not)."""

    def __init__(self, proc: subprocess.Popen, port: int) -> None:
        self.proc, self.port = proc, port
        self.url = f"http://127.0.0.1:{port}"

    def metric(self, name: str, **labels: str) -> float:
        """A sample of ``/metrics`` (0 where the series does not exist)."""
        text = httpx.get(f"{self.url}/metrics", timeout=60).text
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" (\S+)"
        found = re.search("^" + pattern + "$", text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    def descriptors(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def serve(tmp_path: Path, env: dict[str, str] | None = None, nofile: int | None = None,
          log_level: str = "warning", stdout: int | None = None) -> Served:
    """A sidecar with only a disk tier in ``tmp_path``; ``nofile``: its descriptor limit,
    soft and hard (so that it cannot raise it)."""
    port = free_port()
    full_env = dict(os.environ, KVTIER_TIERS__DISK_DIR=str(tmp_path / "chunks"),
                    KVTIER_TIERS__DISK_FSYNC="false", KVTIER_TIERS__CPU_BYTES="0",
                    **(env or {}))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli.main", "serve", "--port", str(port),
         "--log-level", log_level],
        env=full_env, preexec_fn=limit if nofile else None, stdout=stdout,
    )  # fmt: skip
    served = Served(proc, port)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{served.url}/healthz", timeout=30).status_code == 200:
                return served
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            served.stop()
            raise RuntimeError("kvtier serve did not start")
        time.sleep(0.2)


def closed_by_server(sock: socket.socket, timeout: float = 60.0) -> bytes | None:
    """What the server sent before closing ``sock`` (None: still open at ``timeout``)."""
    sock.settimeout(timeout)
    got = b""
    try:
        while True:
            piece = sock.recv(65536)
            if not piece:
                return got
            got += piece
    except (ConnectionResetError, BrokenPipeError):
        return got
    except TimeoutError:
        return None
