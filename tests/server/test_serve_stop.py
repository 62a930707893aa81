"""SIGTERM stops ``kvtier serve`` within ``server.stop_timeout_s`` whatever its threads are
doing (docs/server.md, Guards and errors). The stall is a real one: the server's log pipe,
which nobody reads, is full, so the thread writing the next access-log line blocks in
``write`` and holds the log handler's lock, and every other thread that logs (the drain
saying it gives up, the close saying it is done) blocks behind it."""

from __future__ import annotations

import fcntl
import signal
import subprocess
import termios

import httpx

from tests.server.serve_limits import serve

PIPE_BYTES = 4096
"""The stdout pipe's size, set small so that a few dozen access-log lines fill it."""


def _unread_bytes(fd: int) -> int:
    return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), "little")


def test_sigterm_ends_a_server_whose_threads_are_blocked(tmp_path):
    served = serve(tmp_path, env={"KVTIER_SERVER__DRAIN_TIMEOUT_S": "2",
                                  "KVTIER_SERVER__STOP_TIMEOUT_S": "5"},
                   log_level="info", stdout=subprocess.PIPE)
    try:
        fd = served.proc.stdout.fileno()
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        with httpx.Client(base_url=served.url, timeout=5) as http:
            answered = 0
            for _ in range(10_000):  # one access-log line each, until a write blocks
                try:
                    http.get("/healthz")
                except httpx.TimeoutException:
                    break
                answered += 1
        assert answered > 0
        assert _unread_bytes(fd) > PIPE_BYTES - 512  # the pipe is full: the server is stuck
        served.proc.send_signal(signal.SIGTERM)
        try:
            status = served.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            status = None
        assert status == 1  # gone, by the hard stop (its close never finished)
    finally:
        served.proc.kill()
        served.proc.wait()


def test_sigterm_stops_an_idle_server_cleanly(tmp_path):
    served = serve(tmp_path)
    try:
        assert httpx.get(f"{served.url}/healthz", timeout=60).status_code == 200
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=120) == 0
    finally:
        served.stop()
