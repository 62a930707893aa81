"""Over real HTTP: ``POST /v1/chunks/turns`` tells a sidecar when sessions' turns started
and ended; its session-aware tiers then rank those sessions by kvtier's think-time model
(a running turn is kept). Sessions are the caller's tenant's; a read-only token reports
nothing; a malformed report is refused whole."""

from __future__ import annotations

import time

import httpx
import pytest

from kvtier.client import Client, SessionTurn, TurnEvent
from kvtier.config import DEFAULT_TENANT, load_config
from kvtier.connectors.chunk_store import RemoteChunkStore
from kvtier.server.state import ServiceState
from tests.http_server import running
from tests.server.test_server_chunks import _config
from tests.server.test_tenants import TOKENS


def _rank(state: ServiceState, session: str) -> float:
    cpu = state.manager.tiers[0].eviction
    return state.turns.rank(cpu, session, time.monotonic())


def test_a_reported_turn_reaches_the_tiers_ranks(tmp_path) -> None:
    state = ServiceState.sidecar(_config(tmp_path))
    alice = f"{DEFAULT_TENANT}:alice"
    with running(state) as url, Client(url) as c:
        c.report_turns([SessionTurn("alice", TurnEvent.STARTED, ago_s=0.5)])
        assert _rank(state, alice) == -1.0  # her turn runs: kept
        c.report_turns([SessionTurn("alice", TurnEvent.ENDED)])
        assert 0.0 <= _rank(state, alice) <= 1.0
        assert state.turns.reported == 2
        assert c.stats()["turns"] == {"reported": 2, "sessions": 1, "running": 0}
        assert "kvtier_session_turns_reported_total 2.0" in c.metrics()
        store = RemoteChunkStore(url, 1 << 16)
        try:
            store.report_turns([SessionTurn("alice", TurnEvent.STARTED)])
        finally:
            store.close()
        assert _rank(state, alice) == -1.0


def test_a_session_with_an_odd_name_is_named_as_its_chunks_are(tmp_path) -> None:
    """A session the service's session parameter cannot carry goes by its digest, in its
    chunks' owner and in its turns alike."""
    import hashlib

    state = ServiceState.sidecar(_config(tmp_path))
    odd = "ünïcode\nsession"
    with running(state) as url, Client(url) as c:
        c.report_turns([SessionTurn(odd, TurnEvent.STARTED)])
    digest = hashlib.sha256(odd.encode()).hexdigest()
    assert _rank(state, f"{DEFAULT_TENANT}:{digest}") == -1.0


def test_turns_are_the_callers_tenants(tmp_path) -> None:
    cfg = load_config(environ={}, overrides={
        "tiers": {"cpu_bytes": 8 << 20, "disk_dir": str(tmp_path / "c"), "disk_bytes": 64 << 20,
                  "disk_fsync": False},
        "server": {"auth_token": "the-admin-token", "tokens": TOKENS}})
    state = ServiceState.sidecar(cfg)
    with running(state) as url, Client(url, token="alpha-writer-1") as a, \
            Client(url, token="alpha-reader-1") as reader:
        a.report_turns([SessionTurn("s", TurnEvent.STARTED)])
        assert _rank(state, "alpha:s") == -1.0
        assert _rank(state, "beta:s") != -1.0  # beta's "s" is another session
        with pytest.raises(Exception, match="403|scope"):
            reader.report_turns([SessionTurn("t", TurnEvent.STARTED)])
        assert _rank(state, "alpha:t") != -1.0


@pytest.mark.parametrize("bad", [
    {"turns": [{"session": "s", "event": "paused"}]},
    {"turns": [{"session": "s", "event": "ended", "ago_s": -1}]},
    {"turns": [{"session": "x" * 257, "event": "ended"}]},
    {"turns": [{"session": "s", "event": "ended", "extra": 1}]},
    {"turns": [{"session": "s", "event": "started"}] * 4097},
    {"turns": [{"session": "ok", "event": "started"}, {"session": "", "event": "ended"}]},
])
def test_a_malformed_report_is_refused_whole(tmp_path, bad) -> None:
    state = ServiceState.sidecar(_config(tmp_path))
    with running(state) as url:
        resp = httpx.post(f"{url}/v1/chunks/turns", json=bad)
    assert resp.status_code == 422
    assert state.turns.reported == 0
