"""Serving the app with uvicorn, bounded: guarded connections, and a stop that always stops.

uvicorn drains requests in flight on SIGTERM or SIGINT, but the process only ends once
every thread lets it: a worker blocked in a system call (a file that never answers, a log
pipe nobody reads) keeps ``asyncio.run`` joining its executor, or the interpreter joining
its threads, for ever. :class:`HardStop` is armed by the first signal and ends the process
``server.stop_timeout_s`` later whatever its threads are doing; a stop that finishes
earlier never notices it.
"""

from __future__ import annotations

import os
import select
import threading
from types import FrameType

import uvicorn
from fastapi import FastAPI

from kvtier.config import ServerConfig
from kvtier.server.guarded_protocol import guarded_protocol

FORCED_EXIT_STATUS = 1
"""The exit status of a stop that did not finish within ``server.stop_timeout_s``."""


class HardStop:
    """Ends the process (``os._exit``) ``timeout_s`` after :meth:`arm`, unless it exits
    first. Its thread is a daemon: it never keeps the process alive itself."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._armed = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self) -> None:
        """Start the clock (once; later calls change nothing). Safe in a signal handler."""
        if self._armed.is_set():
            return
        self._armed.set()
        self._thread = threading.Thread(target=self._expire, name="kvtier-hard-stop",
                                        daemon=True)
        self._thread.start()

    def _expire(self) -> None:
        threading.Event().wait(self.timeout_s)
        _say(f"kvtier serve: not stopped {self.timeout_s:g} s after the signal "
             "(server.stop_timeout_s); exiting now\n")
        os._exit(FORCED_EXIT_STATUS)


def _say(text: str) -> None:
    """A last line on stderr, only where it cannot block (its reader may be the stall)."""
    try:
        _, ready, _ = select.select([], [2], [], 0)
        if ready:
            os.write(2, text.encode()[:512])
    except (OSError, ValueError):
        pass


class BoundedServer(uvicorn.Server):
    """uvicorn's server whose exit signal also arms a :class:`HardStop`."""

    def __init__(self, config: uvicorn.Config, hard_stop: HardStop) -> None:
        super().__init__(config)
        self.hard_stop = hard_stop

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.hard_stop.arm()
        super().handle_exit(sig, frame)


def bounded_server(app: FastAPI, server: ServerConfig, log_level: str,
                   hard_stop: HardStop) -> BoundedServer:
    """uvicorn serving ``app`` on ``server.host:port`` with the app's connection table
    (:func:`kvtier.server.app.create_app` made it), requests drained for at most
    ``server.drain_timeout_s`` on a stop."""
    config = uvicorn.Config(
        app, host=server.host, port=server.port, log_level=log_level,
        http=guarded_protocol(app.state.connections),
        timeout_graceful_shutdown=server.drain_timeout_s,
    )
    return BoundedServer(config, hard_stop)
