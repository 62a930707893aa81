"""A real ``kvtier serve`` app on a free loopback port, run by uvicorn in a thread."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn

from kvtier.server.app import create_app
from kvtier.server.state import ServiceState
from tests.serve_process import free_port


@contextlib.contextmanager
def running(state: ServiceState, close_state: bool = True, port: int | None = None) -> Iterator[str]:
    """Serve ``state`` on loopback (on ``port``, else a free one); yields the base URL;
    stops the server (and closes the state) afterwards, also when the test fails."""
    port = port or free_port()
    config = uvicorn.Config(
        create_app(state), host="127.0.0.1", port=port, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="kvtier-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        if close_state:
            state.close()
