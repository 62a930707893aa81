"""Streams that stop when the client goes: a streaming chat client that disconnects ends
its turn at the engine's next step (not after every token), a throwaway session goes with
it; a DELETE of a session during its turn wins; a second concurrent turn of a session is
409 (docs/server.md). Real HTTP on loopback, the reference engine on a tiny model."""

from __future__ import annotations

import json
import time

import httpx

from kvtier.server.state import ServiceState
from tests.http_server import running
from tests.server.test_server_engine import _config, model_dir  # noqa: F401 - fixture by name

LONG = {"temperature": 0, "max_tokens": 1500}
"""A turn long enough to still run when the test acts (the tiny model does not stop early
on this prompt: checked by the reference run in each test)."""
PROMPT = [{"role": "user", "content": "Count the mountains, one by one, as long as you can."}]


def _engine_idle(state: ServiceState, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while state.engine.engine.busy_sessions or state.engine.engine.scheduler.has_work:
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.02)


def _open_stream(http: httpx.Client, session: str | None):
    headers = {"X-Session-Id": session} if session else {}
    req = http.build_request("POST", "/v1/chat/completions", headers=headers,
                             json={"messages": PROMPT, "stream": True, **LONG})
    resp = http.send(req, stream=True)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    first = next(line for line in lines if line.startswith("data: "))
    assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
    return resp, lines


def test_a_client_that_goes_away_stops_its_turn_and_its_throwaway_session(model_dir, tmp_path):  # noqa: F811
    state = ServiceState.with_engine(_config(tmp_path), model_dir)
    eng = state.engine.engine
    with running(state) as url, httpx.Client(base_url=url, timeout=60) as http:
        full = http.post("/v1/chat/completions", headers={"X-Session-Id": "ref"},
                         json={"messages": PROMPT, **LONG}).json()
        assert full["usage"]["completion_tokens"] == LONG["max_tokens"]  # never stops early
        _engine_idle(state)
        # A named session: its client leaves after the first event.
        resp, _ = _open_stream(http, "leaver")
        resp.close()
        _engine_idle(state)
        turn = http.get("/v1/sessions/leaver").json()
        assert turn["turns"] == 1
        info = eng.sessions["leaver"].turns[-1]
        assert info.finish_reason == "abort"
        assert 0 < info.output_tokens < LONG["max_tokens"] // 2
        # A throwaway session (no id): gone with its client.
        resp, _ = _open_stream(http, None)
        resp.close()
        _engine_idle(state)
        assert not [s for s in eng.sessions if s.startswith("ephemeral-")]


def test_a_delete_during_a_turn_wins(model_dir, tmp_path):  # noqa: F811
    state = ServiceState.with_engine(_config(tmp_path), model_dir)
    with running(state) as url, httpx.Client(base_url=url, timeout=60) as http:
        resp, lines = _open_stream(http, "doomed")
        assert http.delete("/v1/sessions/doomed").status_code == 204
        finish = None
        for line in lines:  # the stream ends, at once, with the turn aborted
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                finish = choices[0].get("finish_reason") or finish
        assert finish == "abort"
        resp.close()
        _engine_idle(state)
        assert http.get("/v1/sessions/doomed").status_code == 404
        assert "doomed" not in state.engine.engine.sessions


def test_a_second_turn_of_a_busy_session_is_409(model_dir, tmp_path):  # noqa: F811
    state = ServiceState.with_engine(_config(tmp_path), model_dir)
    with running(state) as url, httpx.Client(base_url=url, timeout=60) as http:
        resp, _ = _open_stream(http, "busy")
        r = http.post("/v1/chat/completions", headers={"X-Session-Id": "busy"},
                      json={"messages": PROMPT, "max_tokens": 4})
        assert r.status_code == 409 and r.json()["error"]["type"] == "session_busy"
        resp.close()
        _engine_idle(state)
