"""``kvtier serve`` as a child process on a free loopback port, for the integration suites
(tests_vllm/, tests_lmcache/), which run it beside an engine in another environment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(disk_dir: Path, token: str, env: dict[str, str] | None = None
                ) -> tuple[subprocess.Popen, str, int]:
    """A sidecar with its disk tier in ``disk_dir`` and a bearer token, once it answers
    ``/healthz``; the caller terminates it. ``env``: more ``KVTIER_*`` settings."""
    port = free_port()
    env = dict(os.environ, KVTIER_TIERS__DISK_DIR=str(disk_dir), KVTIER_TIERS__DISK_FSYNC="false",
               KVTIER_SERVER__AUTH_TOKEN=token, **(env or {}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli.main", "serve", "--port", str(port),
         "--log-level", "warning"],
        env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/healthz").status_code == 200:
                return proc, url, port
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("kvtier serve did not start")
        time.sleep(0.2)
