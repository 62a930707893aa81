"""A ``kvtier serve`` the vLLM connector starts for itself, for in-process tiers that vLLM's
processes must share: with tensor or pipeline parallelism every rank's worker is a process
of its own and the scheduler another, so tiers inside one of them would be seen by none of
the others. The scheduler side starts the server as a child process holding the tiers the
connector was given (``tiers``, ``config``), on a free loopback port with a bearer token
of its own, and the workers reach it through shared memory (``shm``), as they would a
sidecar an operator runs, with the same deadlines and back-off (``lookup_timeout_s``,
``transfer_timeout_s``, ``store_retry_s``: a stalled private sidecar costs vLLM one
deadline, not one per request). It stops with the process that started it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.connectors.tiers.connector_defaults import unset_defaults
from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

STARTUP_S = 60.0
MEMORY_DIR = "/dev/shm"
"""Where the sidecars' shared-memory regions are made: a memory filesystem, so that a
region's pages are never written back to a drive."""


@dataclass
class _Sidecar:
    proc: subprocess.Popen
    scratch: str | None = None
    """A directory of the sidecar's own (its regions, where the host has no memory
    filesystem to share): removed when it stops."""


_running: dict[str, _Sidecar] = {}
"""The sidecars this process started, by URL."""


@dataclass(frozen=True)
class SidecarAddress:
    """Where the private sidecar listens and the token it wants (the workers get both in
    the step plans the scheduler sends them)."""

    url: str
    token: str

    def options(self) -> dict[str, Any]:
        return {"url": self.url, "token": self.token, "shm": True}


def _env(options: Mapping[str, Any], slot_bytes: int, regions: str, token: str
         ) -> dict[str, str]:
    """The child's configuration: the connector's ``tiers`` as ``KVTIER_TIERS__*``, CPU slots
    sized to the connector's chunks, shared-memory regions in ``regions`` (see
    :func:`regions_dir`). The token travels in the environment, not argv: argv is visible
    to every user in ``ps``, and argparse reads a token that starts with ``-`` (one in 64
    of ``token_urlsafe``) as an option and refuses to start."""
    env = dict(os.environ, KVTIER_SERVER__CHUNK_SLOT_BYTES=str(slot_bytes),
               KVTIER_SERVER__SHM_DIR=regions,
               KVTIER_SERVER__AUTH_TOKEN=token)
    tiers = dict(options.get("tiers") or {})
    if not options.get("config"):  # the connector's own tiers (chunk_store.open_store's too)
        tiers = {**unset_defaults(tiers), **tiers}
    for name, value in tiers.items():
        env[f"KVTIER_TIERS__{name.upper()}"] = "" if value is None else str(value)
    return env


def regions_home() -> str | None:
    """This user's directory for sidecars' regions in :data:`MEMORY_DIR` (mode 0700), made
    once and shared by every sidecar of the user: a sidecar that was killed leaves its
    regions there, and the next one to start removes them (a server removes, at start, the
    regions of every server whose lock is free). None where the host has no memory
    filesystem, or where that path is not a private directory of this user's (another
    user made it, or a link)."""
    if not os.path.isdir(MEMORY_DIR):
        return None
    path = os.path.join(MEMORY_DIR, f"kvtier-regions-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        log.warning("kvtier: %s is not a private directory of this user's; a sidecar's "
                    "regions go to a temporary directory instead", path)
        return None
    return path


def regions_dir(prefix: str) -> tuple[str, str | None]:
    """Where a sidecar starting now makes its regions (it must exist: a server whose
    ``shm_dir`` is missing offers none), and a scratch directory made for it that the
    caller removes when the sidecar stops (None: :func:`regions_home` serves)."""
    home = regions_home()
    if home is not None:
        return home, None
    scratch = tempfile.mkdtemp(prefix=prefix)
    return scratch, scratch


def start(options: Mapping[str, Any], slot_bytes: int) -> SidecarAddress:
    """Start the private sidecar and wait until it answers; it is stopped at exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_urlsafe(24)
    regions, scratch = regions_dir("kvtier-vllm-sidecar-")
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning"]
    if options.get("config"):
        cmd += ["--config", str(options["config"])]
    sidecar = _Sidecar(subprocess.Popen(cmd, env=_env(options, slot_bytes, regions, token)), scratch)
    atexit.register(_stop, sidecar)
    address = SidecarAddress(f"http://127.0.0.1:{port}", token)
    _wait(sidecar, address)
    _running[address.url] = sidecar
    log.info("kvtier connector: private sidecar for %s at %s", dict(options.get("tiers") or {}),
             address.url)
    return address


def _wait(sidecar: _Sidecar, address: SidecarAddress) -> None:
    import httpx

    proc = sidecar.proc
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(f"{address.url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    _stop(sidecar)
    raise ConfigError("kvtier connector: the tiers' server for vLLM's ranks did not start "
                      f"(exit code {proc.returncode}); check the connector's tiers options")


def process_id(address: SidecarAddress) -> int | None:
    """The process id of a sidecar this process started and has not stopped (None: none)."""
    sidecar = _running.get(address.url)
    return None if sidecar is None else sidecar.proc.pid


def stop(address: SidecarAddress) -> None:
    """Stop a sidecar this process started (its tiers' in-memory chunks go with it)."""
    sidecar = _running.pop(address.url, None)
    if sidecar is not None:
        _stop(sidecar)


def _stop(sidecar: _Sidecar) -> None:
    proc = sidecar.proc
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if sidecar.scratch is not None:
        shutil.rmtree(sidecar.scratch, ignore_errors=True)
