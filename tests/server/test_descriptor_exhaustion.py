"""A server out of file descriptors says so: a stored chunk it cannot open is a 503
``descriptors_exhausted`` (retry), never 404 "not found"; a chunk it cannot write is a
503 too, never 507 "full"; nothing stored is deleted, and everything is served again once
descriptors are back. The server runs in a child process whose every descriptor is taken
after start (a keep-alive connection opened before stays usable)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_OUT_OF_DESCRIPTORS = """
import json, os, resource, sys
from pathlib import Path
import httpx
from kvtier.server.state import ServiceState
from tests.http_server import running
from tests.server.test_server_chunks import _config, chunk, key, served

tmp = Path(sys.argv[1])
cfg = _config(tmp, max_body_bytes=1 << 20)
cfg.tiers.cpu_bytes = 0  # disk only: every read and write opens a file
state = ServiceState.sidecar(cfg)
out = {}
with running(state) as url, httpx.Client(base_url=url, timeout=60) as http:
    stored, new = chunk(key(1), seed=1), chunk(key(2), seed=2)
    out["put"] = http.put(f"/v1/chunks/{key(1)}", content=stored).status_code
    assert http.get("/healthz").status_code == 200  # the keep-alive connection is open
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    r = http.get(f"/v1/chunks/{key(1)}")
    out["get"] = [r.status_code, r.json()["error"]["type"], r.headers.get("retry-after")]
    r = http.put(f"/v1/chunks/{key(2)}", content=new)
    out["put_new"] = [r.status_code, r.json()["error"]["type"]]
    r = http.post("/v1/chunks/batch/get", json={"keys": [key(1)]})
    out["batch"] = [r.status_code, r.json()["error"]["type"]]
    for fd in held:
        os.close(fd)
    out["get_after"] = http.get(f"/v1/chunks/{key(1)}").content == served(stored)
    out["put_after"] = http.put(f"/v1/chunks/{key(2)}", content=new).status_code
print(json.dumps(out))
"""


def test_a_server_out_of_descriptors_answers_retry_never_missing_or_full(tmp_path):
    done = subprocess.run([sys.executable, "-c", _OUT_OF_DESCRIPTORS, str(tmp_path)],
                          capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["put"] == 201
    assert got["get"] == [503, "descriptors_exhausted", "1"]  # not 404: it is stored
    assert got["put_new"] == [503, "descriptors_exhausted"]  # not 507: nothing is full
    assert got["batch"] == [503, "descriptors_exhausted"]
    assert got["get_after"] is True and got["put_after"] == 201  # nothing was lost
