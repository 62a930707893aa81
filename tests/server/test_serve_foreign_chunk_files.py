"""A real ``kvtier serve`` process whose disk tier finds a FIFO where a chunk file was: at
start-up (an operator's mistake while it was down) and behind its back while it runs.
Opening a FIFO to read blocks until a writer comes, so a server that tried would wedge a
worker per GET, time out other tenants and no longer stop on SIGTERM. Here every GET
answers (that key a miss, the others served, alone and in one batch), the key is
storable again, and SIGTERM stops the server."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from kvtier.chunk_format import chunk_view, encode_chunk
from kvtier.client import Client
from tests.serve_process import start_serve

pytestmark = pytest.mark.timeout(240)
TOKEN = "foreign-files-admin-token"
FP = b"model-fp"
SMALL_CPU = {"KVTIER_TIERS__CPU_BYTES": str(8 << 20)}


def key(i: int) -> str:
    return f"{i:064x}"


def kv(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, 2, 16, 2, 8, generator=g).to(torch.float16)


def chunk(i: int) -> bytes:
    return encode_chunk(key(i), FP, kv(i))


def held(got: list[bytes | None]) -> list[int | None]:
    """Which chunk each answer is (by its KV: the service binds a tenant's name into the
    header), None for a miss."""
    out: list[int | None] = []
    for blob in got:
        if blob is None:
            out.append(None)
            continue
        header, payload = chunk_view(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        out.append(next(i for i in range(1, 5) if torch.equal(payload, kv(i))))
    return out


def file_of(disk_dir: Path, i: int) -> Path:
    found = list(disk_dir.glob(f"*/*{key(i)}.kvc"))
    assert len(found) == 1, found
    return found[0]


def into_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM, and the exit status once it stopped (killed, and failed, past a minute)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("kvtier serve did not stop on SIGTERM")


def test_a_fifo_in_a_chunks_place_wedges_nothing(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    proc, url, _ = start_serve(disk, TOKEN, SMALL_CPU)
    try:
        with Client(url, token=TOKEN, timeout=30) as c:
            for i in (1, 2, 3, 4):
                c.put_chunk(key(i), chunk(i), tier="disk")
    finally:
        stop(proc)
    into_fifo(file_of(disk, 2))  # while the server is down

    proc, url, _ = start_serve(disk, TOKEN, SMALL_CPU)
    try:
        with Client(url, token=TOKEN, timeout=30) as c:
            assert held([c.get_chunk(key(2)), c.get_chunk(key(1))]) == [None, 1]
            assert held(c.get_chunks([key(1), key(2), key(3)])) == [1, None, 3]
            c.put_chunk(key(2), chunk(2), tier="disk")  # storable again
            assert held([c.get_chunk(key(2))]) == [2]

            into_fifo(file_of(disk, 4))  # behind the running server's back
            assert held(c.get_chunks([key(3), key(4)])) == [3, None]
            c.put_chunk(key(4), chunk(4), tier="disk")
            assert held(c.get_chunks([key(i) for i in (1, 2, 3, 4)])) == [1, 2, 3, 4]
        assert len(list((disk / ".quarantine").iterdir())) == 2
    finally:
        assert stop(proc) == 0
