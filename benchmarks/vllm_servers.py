"""Real servers for ``kvtier bench vllm``: vLLM's OpenAI server (from the environment that
holds vLLM, e.g. ``.venv-integration``) in each configuration, and a sidecar ``kvtier
serve``; started on free loopback ports, waited for, their Prometheus metrics read, and
stopped. A server that does not come up is reported with the tail of its log."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STARTUP_S = 300.0


@dataclass(frozen=True)
class VllmSetup:
    """One way to run vLLM: no connector, kvtier's (in-process tiers or a sidecar), or a
    peer's, as ``kv_transfer_config`` says."""

    name: str
    kv_transfer_config: dict[str, Any] | None = None
    sidecar: bool = False
    """Start a ``kvtier serve`` first; its URL goes into the connector's options."""
    extra_path: str | None = None
    """Site-packages to append to vLLM's path (a peer's environment, e.g. LMCache's)."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment for vLLM beyond the bench's (e.g. one process: no multiprocessing)."""
    peer: bool = False
    """Another project's connector (LMCache, vLLM's own offloading): it may run fewer rounds
    and under a limit of its own (``--peer-rounds``, ``--peer-limit-s``)."""


@dataclass
class Running:
    proc: subprocess.Popen
    url: str
    log: Path
    scratch: str | None = None
    """A directory of the server's own outside the bench's (its regions), removed at stop."""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(running: Running, path: str) -> None:
    import httpx

    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if running.proc.poll() is not None:
            break
        try:
            if httpx.get(running.url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    running.stop()
    text = running.log.read_text(errors="replace") if running.log.exists() else ""
    raise RuntimeError(f"{root_cause(text)} (server did not come up; {running.log}:\n"
                       f"{text[-2000:]})")


def root_cause(log: str) -> str:
    """What made a start fail: the first exception an ERROR line logged (vLLM's engine core
    logs its cause so), else the first exception a traceback ended with, else the last line."""
    import re

    exc = r"\b([A-Za-z_][\w.]*(?:Error|Exception): .+)$"
    for line in log.splitlines():
        if "ERROR" in line:
            found = re.search(exc, line)
            if found:
                return found.group(1).strip()
    found = re.search(r"^" + exc[2:], log, re.MULTILINE)
    if found:
        return found.group(1).strip()
    lines = [x for x in log.splitlines() if x.strip()]
    return lines[-1].strip() if lines else "no output"


def start_kvtier_serve(workdir: Path, slot_bytes: int) -> Running:
    """A sidecar ``kvtier serve`` (CPU arena + disk without fsync) on a free port, with
    the tiers docs/vllm.md gives a sidecar beside vLLM: the connector's own defaults
    (:data:`~kvtier.connectors.tiers.connector_defaults.CONNECTOR_TIER_DEFAULTS`), as its
    in-process tiers have them."""
    from kvtier.connectors.private_sidecar import regions_dir
    from kvtier.connectors.tiers.connector_defaults import CONNECTOR_TIER_DEFAULTS

    port = free_port()
    log = workdir / "kvtier-serve.log"
    regions, scratch = regions_dir("kvtier-bench-regions-")  # it must exist: else no regions
    env = dict(os.environ, KVTIER_TIERS__DISK_DIR=str(workdir / "chunks"),
               KVTIER_TIERS__DISK_FSYNC="false", KVTIER_SERVER__CHUNK_SLOT_BYTES=str(slot_bytes),
               KVTIER_SERVER__SHM_DIR=regions)
    env.update({f"KVTIER_TIERS__{k.upper()}": str(v).lower() if isinstance(v, bool) else str(v)
                for k, v in CONNECTOR_TIER_DEFAULTS.items()})
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "serve", "--port", str(port),
                             "--log-level", "warning"], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env=env)
    running = Running(proc, f"http://127.0.0.1:{port}", log, scratch=scratch)
    _wait(running, "/healthz")
    return running


def start_vllm(python: str, model: str, setup: VllmSetup, workdir: Path, args: Any,
               sidecar_url: str | None) -> Running:
    """vLLM's OpenAI server for ``setup`` (prefix caching on, as users run it)."""
    port = free_port()
    log = workdir / f"vllm-{setup.name}.log"
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--served-model-name", "m", "--port", str(port), "--dtype", "float32",
           "--block-size", str(args.block_size), "--max-model-len", str(args.max_model_len),
           "--num-gpu-blocks-override", str(args.kv_blocks), "--enforce-eager",
           "--seed", "0", "--disable-uvicorn-access-log"]
    if setup.kv_transfer_config is not None:
        config = json.loads(json.dumps(setup.kv_transfer_config))
        if sidecar_url:
            config.setdefault("kv_connector_extra_config", {})["url"] = sidecar_url
        cmd += ["--kv-transfer-config", json.dumps(config)]
    cores = args.cpu_bind or f"0-{(os.cpu_count() or 1) - 1}"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND=cores)  # the same cores in every setup
    env.update(setup.env)
    if setup.extra_path:  # a peer installed beside vLLM's own packages, not into them
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), setup.extra_path]))
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    running = Running(proc, f"http://127.0.0.1:{port}", log)
    _wait(running, "/health")
    return running


def settled_metrics(url: str, quiet_s: float = 1.0, limit_s: float = 30.0) -> dict[str, float]:
    """The server's samples once its counters stopped moving for ``quiet_s`` (at most
    ``limit_s``): a connector's last saves land after the last reply has been streamed
    (a finished request's blocks are held for them), and a scrape at once missed them."""
    import time

    deadline = time.monotonic() + limit_s
    last = metrics(url)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = metrics(url)
        if all(now.get(k) == v for k, v in last.items() if k.endswith("_total")):
            return now
        last = now
    return last


def _samples(url: str) -> Iterator[Any]:
    """The server's Prometheus samples (``name``, ``labels``, ``value``)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        yield from family.samples


def metrics(url: str) -> dict[str, float]:
    """The server's Prometheus samples, summed over labels (``name`` -> value)."""
    out: dict[str, float] = {}
    for sample in _samples(url):
        out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def route_requests(url: str) -> dict[str, int]:
    """A ``kvtier serve``'s HTTP requests so far by ``METHOD route`` (its
    ``kvtier_http_requests_total``, every status)."""
    out: dict[str, int] = {}
    for sample in _samples(url):
        if sample.name == "kvtier_http_requests_total":
            key = f"{sample.labels['method']} {sample.labels['route']}"
            out[key] = out.get(key, 0) + int(sample.value)
    return out
