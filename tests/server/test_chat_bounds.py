"""Chat turns bounded by their clients (docs/server.md, Chat): a non-streaming client that
goes away ends its turn at the engine's next step, and a history that cannot fit the
context is refused 400 before the engine sees it, leaving no session behind. Real HTTP on
loopback, the reference engine on a tiny model."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from kvtier.server.chat_bounds import ChatBounds
from kvtier.server.state import ServiceState
from tests.http_server import running
from tests.server.test_chat_streams import LONG, PROMPT, _engine_idle
from tests.server.test_server_engine import _config, model_dir  # noqa: F401 - fixture by name


@pytest.fixture
def served(model_dir, tmp_path):  # noqa: F811
    state = ServiceState.with_engine(_config(tmp_path), model_dir)
    with running(state) as url:
        yield url, state


def _wait_for(check, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_non_streaming_client_that_goes_away_stops_its_turn(served):
    url, state = served
    eng = state.engine.engine
    body = json.dumps({"messages": PROMPT, **LONG}).encode()
    host = urlsplit(url)
    sock = socket.create_connection((host.hostname, host.port), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nX-Session-Id: leaver\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    _wait_for(lambda: "leaver" in eng.busy_sessions, "the turn never started")
    sock.close()  # the client goes away while its reply is being generated
    _wait_for(lambda: "leaver" in eng.sessions and "leaver" not in eng.busy_sessions,
              "the turn never ended")
    _engine_idle(state)
    turn = eng.sessions["leaver"].turns[-1]
    assert turn.finish_reason == "abort"
    assert 0 < turn.output_tokens < LONG["max_tokens"] // 2
    metrics = httpx.get(f"{url}/metrics", timeout=60).text
    assert 'kvtier_chat_client_gone_total{stream="false"} 1.0' in metrics


def test_a_history_past_the_context_is_refused_before_tokenizing_and_stores_no_session(served):
    url, state = served
    bounds = ChatBounds.of(state.engine.engine, state.config.server.max_chat_chars)
    with httpx.Client(base_url=url, timeout=120) as http:
        # Far more characters than the context can hold: refused from its size alone.
        huge = "the quick brown fox " * (bounds.max_chars // 20 + 1000)
        resp = http.post("/v1/chat/completions", headers={"X-Session-Id": "huge"}, json={
            "messages": [{"role": "user", "content": huge},
                         {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": "and then?"}], "max_tokens": 4})
        assert resp.status_code == 400
        assert resp.json()["error"]["type"] == "context_length_exceeded"
        assert "characters" in resp.json()["error"]["message"]
        # Few enough characters, too many tokens: refused once rendered (off the engine).
        long = "zq " * (bounds.max_chars // 3 - 100)
        resp = http.post("/v1/chat/completions", headers={"X-Session-Id": "long"}, json={
            "messages": [{"role": "user", "content": long},
                         {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": "and then?"}], "max_tokens": 4})
        assert resp.status_code == 400
        assert resp.json()["error"]["type"] == "context_length_exceeded"
        assert "tokens" in resp.json()["error"]["message"]
        for session in ("huge", "long"):
            assert http.get(f"/v1/sessions/{session}").status_code == 404
        assert not state.engine.engine.sessions
        # A conversation that fits still runs.
        ok = http.post("/v1/chat/completions", headers={"X-Session-Id": "fits"}, json={
            "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
        assert ok.status_code == 200
