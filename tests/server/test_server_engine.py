"""Engine mode over real HTTP: OpenAI-style chat with sessions, the session control routes,
and the acceptance case: a session offloaded after turn 1 is restored on turn 2 and the
reply equals a run that never offloaded (greedy)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from kvtier.client import AsyncClient, Client, ServiceError, chat_text
from kvtier.config import load_config
from kvtier.engine.engine import Engine
from kvtier.engine.sampling import SamplingParams
from kvtier.make_model.writer import make_model
from kvtier.server.state import ServiceState
from tests.engine_config import engine_config
from tests.http_server import running

SYSTEM = "You are a helpful assistant who answers about offloading KV caches. " * 3
Q1 = "Tell me about the mountains and the weather there."
Q2 = "And in winter?"
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_model("tiny", tmp_path_factory.mktemp("m") / "tiny", seed=7).path


def _config(tmp_path):
    return load_config(
        environ={},
        overrides={
            "pool": {"num_blocks": 128},
            "chunk_tokens": 64,
            "tiers": {
                "cpu_bytes": 16 << 20,
                "disk_dir": str(tmp_path / "chunks"),
                "disk_bytes": 64 << 20,
                "disk_fsync": False,
            },
        },
    )


@pytest.fixture
def server(model_dir, tmp_path):
    state = ServiceState.with_engine(_config(tmp_path), model_dir)
    with running(state) as url:
        yield url, state


@pytest.fixture(scope="module")
def expected(model_dir):
    """Two greedy turns on an engine that never offloads (the reference replies)."""
    eng = Engine(model_dir, engine_config(num_blocks=128, tiers=None))
    params = SamplingParams(max_tokens=8)
    t1 = eng.chat("s", Q1, params, system=SYSTEM)
    t2 = eng.chat("s", Q2, params)
    return t1.text, t2.text, t2.token_ids


def test_offload_after_turn_1_restore_on_turn_2_equals_no_offload(server, expected):
    url, _ = server
    text1, text2, _ = expected
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q1}]
    with Client(url) as kv:
        r1 = kv.chat(history, session_id="alice", **GREEDY)
        assert r1["choices"][0]["message"]["content"] == text1
        assert r1["kvtier"]["turn"] == 1 and r1["usage"]["completion_tokens"] > 0
        off = kv.offload("alice")
        assert off["stored_tokens"] > 0 and off["freed_blocks"] > 0 and not off["failed"]
        assert kv.session("alice")["offloaded"] is True
        history += [
            {"role": "assistant", "content": text1},
            {"role": "user", "content": Q2},
        ]
        r2 = kv.chat(history, session_id="alice", **GREEDY)
    assert r2["choices"][0]["message"]["content"] == text2
    t = r2["kvtier"]
    assert t["turn"] == 2 and t["restored_tokens"] == off["stored_tokens"]
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= off["stored_tokens"]
    assert t["ttft_s"] > 0


def test_streamed_turns_match_and_carry_timings(server, expected):
    url, _ = server
    text1, text2, _ = expected
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q1}]
    with Client(url) as kv:
        ev1 = list(kv.chat_stream(history, "bob", stream_options={"include_usage": True}, **GREEDY))
        assert ev1[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chat_text(ev1) == text1
        final = [e for e in ev1 if e["choices"] and e["choices"][0]["finish_reason"]]
        assert len(final) == 1 and final[0]["kvtier"]["turn"] == 1
        assert ev1[-1]["choices"] == [] and ev1[-1]["usage"]["completion_tokens"] > 0
        kv.offload("bob", tier="disk")
        history += [{"role": "assistant", "content": text1}, {"role": "user", "content": Q2}]
        ev2 = list(kv.chat_stream(history, "bob", **GREEDY))
    assert chat_text(ev2) == text2
    last = [e for e in ev2 if e["choices"] and e["choices"][0]["finish_reason"]][0]
    assert last["kvtier"]["restored_tokens"] > 0


def test_session_routes(server):
    url, state = server
    with Client(url) as kv:
        msgs = [{"role": "user", "content": Q1}]
        kv.chat(msgs, session_id="carol", **GREEDY)
        (info,) = kv.sessions()
        assert info["id"] == "carol" and info["turns"] == 1 and not info["offloaded"]
        assert info["tokens"] > 0 and info["busy"] is False
        detail = kv.session("carol")
        assert detail["messages"] == 2 and detail["history"][0]["prompt_tokens"] > 0
        assert kv.hint("carol") == "resident"
        kv.offload("carol", tier="disk")
        restored = kv.restore("carol")
        assert restored["from_tiers"] > 0 and restored["tier_hits"].get("disk", 0) > 0
        assert kv.session("carol")["offloaded"] is False
        kv.offload("carol")
        assert kv.hint("carol") in ("restoring", "prefetching")
        background = kv.offload("carol", wait=False)
        assert background["pending"] is True
        with pytest.raises(ServiceError) as err:
            kv.offload("carol", tier="tape")
        assert err.value.status == 400 and "unknown tier" in err.value.message
        kv.end_session("carol")
        assert kv.sessions() == []
        for call in (kv.session, kv.offload, kv.restore, kv.hint, kv.end_session):
            with pytest.raises(ServiceError) as err:
                call("carol")
            assert err.value.status == 404 and "unknown session" in err.value.message
        stats = kv.stats()
        assert stats["mode"] == "engine" and stats["pool"]["num_blocks"] == 128
        assert stats["policy"] is not None and stats["sessions"]["total"] == 0
        load, victims = stats["policy"]["load"], stats["policy"]["victims"]
        assert 0 < load["compute_busy_share"] <= 1  # the model ran
        assert 0 < load["link_busy_share"]["disk"] <= 1  # a synchronous offload to disk
        assert victims["let_go_blocks"] > 0 and 0 < victims["reuse_ratio"] <= 1
        text = kv.metrics()
    for name in (
        "kvtier_ttft_seconds_count 1.0",
        'kvtier_transfer_seconds_count{direction="offload"}',
        'kvtier_transfer_seconds_count{direction="restore"} 1.0',
        "kvtier_recompute_seconds_count 1.0",
        'kvtier_gpu_pool_blocks{state="used"}',
        "kvtier_gpu_pool_alloc_seconds_per_block",
        'kvtier_chat_tokens_total{kind="output"}',
        "kvtier_policy_decisions_total",
        "kvtier_policy_compute_busy_share",
        'kvtier_policy_link_busy_share{tier="disk"}',
        "kvtier_policy_victim_reuse_ratio",
        "kvtier_policy_pool_turnover_ratio",
        'kvtier_sessions{state="offloaded"} 0.0',
    ):
        assert name in text, name


def test_chat_errors_are_clear(server):
    url, _ = server
    with Client(url) as kv:
        for body, status in (
            ([{"role": "assistant", "content": "hi"}], 400),
            ([], 422),
            ([{"role": "wizard", "content": "hi"}], 422),
        ):
            with pytest.raises(ServiceError) as err:
                kv.chat(body, **GREEDY)
            assert err.value.status == status
        with pytest.raises(ServiceError) as err:
            kv.chat([{"role": "user", "content": "hi"}], n=2)
        assert err.value.status == 422
        with pytest.raises(ServiceError) as err:  # over max_model_len: refused, not a 5xx
            kv.chat([{"role": "user", "content": "word " * 5000}], session_id="long")
        assert err.value.status == 400
        with pytest.raises(ServiceError):
            list(kv.chat_stream([{"role": "user", "content": "word " * 5000}], "long2"))
        assert kv.sessions() == []  # failed turns leave no session behind
        ok = kv.chat([{"role": "user", "content": "hi"}], max_tokens=2)
        assert ok["usage"]["completion_tokens"] <= 2 and kv.sessions() == []  # ephemeral


def test_history_the_engine_has_not_seen_reseeds_the_session(server, model_dir):
    url, _ = server
    history = [
        {"role": "user", "content": Q1},
        {"role": "assistant", "content": "Cold and windy, mostly."},
        {"role": "user", "content": Q2},
    ]
    ref = Engine(model_dir, engine_config(num_blocks=128, tiers=None))
    ref.open_session("x", history[:-1])
    want = ref.chat("x", Q2, SamplingParams(max_tokens=8)).text
    with Client(url) as kv:
        r = kv.chat(history, session_id="dave", **GREEDY)
        assert r["choices"][0]["message"]["content"] == want
        assert kv.session("dave")["messages"] == 4


def test_concurrent_sessions_through_the_async_client(server, expected):
    url, _ = server
    text1 = expected[0]
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q1}]

    async def go():
        async with AsyncClient(url) as kv:
            replies = await asyncio.gather(
                *(kv.chat(history, session_id=f"u{i}", **GREEDY) for i in range(4))
            )
            events = [e async for e in kv.chat_stream(history, "u9", **GREEDY)]
            return replies, events, await kv.sessions()

    replies, events, sessions = asyncio.run(go())
    assert all(r["choices"][0]["message"]["content"] == text1 for r in replies)
    assert chat_text(events) == text1 and len(sessions) == 5


def test_degenerate_sampling_settings_answer_not_crash(server):
    """A temperature of 1e-300 once turned every probability into NaN and killed the engine
    thread (found by the schemathesis run); it now samples greedily and the server goes on."""
    url, _ = server
    with Client(url) as kv:
        r = kv.chat([{"role": "user", "content": Q1}], temperature=1e-300, max_tokens=4)
        assert r["usage"]["completion_tokens"] >= 1
        assert kv.chat([{"role": "user", "content": Q2}], max_tokens=2)["choices"]


def test_a_failing_step_fails_its_turns_with_500_and_the_engine_goes_on(server):
    url, state = server
    runner = state.engine.engine.runner
    real_run = runner.run
    calls = {"n": 0}

    def broken_once(*a, **kw):  # fault injection: the device fails for one step
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_run(*a, **kw)

    runner.run = broken_once
    with Client(url) as kv:
        with pytest.raises(ServiceError) as err:
            kv.chat([{"role": "user", "content": Q1}], session_id="eve", **GREEDY)
        assert err.value.status == 500 and err.value.type == "engine_error"
        assert "illegal memory access" in err.value.message
        r = kv.chat([{"role": "user", "content": Q1}], session_id="eve", **GREEDY)
        assert r["kvtier"]["turn"] == 1  # the failed turn left no trace in the session
    stats = state.engine.engine.runner.pool.stats()
    assert stats.num_sequences == 0


def test_the_reuse_ceiling_beside_the_hits_achieved(server, expected):
    """A second turn asks for the first turn's prompt and reply again: the ceiling rises
    above zero, and the blocks the pool still held count as achieved."""
    url, _ = server
    text1 = expected[0]
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q1}]
    with Client(url) as kv:
        kv.chat(history, session_id="erin", **GREEDY)
        first = kv.stats()["reuse"]
        assert first["ceiling"] < 0.05 and first["achieved"] == 0.0  # all first sightings
        history += [{"role": "assistant", "content": text1}, {"role": "user", "content": Q2}]
        kv.chat(history, session_id="erin", **GREEDY)
        second = kv.stats()["reuse"]
        text = kv.metrics()
    assert second["requested_blocks"] > first["requested_blocks"]
    assert 0.3 < second["ceiling"] <= 1.0
    assert 0 < second["achieved"] <= second["ceiling"] + 0.05
    assert "kvtier_reuse_ceiling_ratio" in text and "kvtier_reuse_achieved_ratio" in text


def test_turn_reports_are_refused_in_engine_mode(server):
    """The engine ranks its own sessions: a sidecar's turn reports are refused plainly, not
    taken and ignored."""
    url, _ = server
    resp = httpx.post(f"{url}/v1/chunks/turns", json={"turns": [{"session": "s", "event": "ended"}]})
    assert resp.status_code == 409 and "engine" in resp.json()["error"]["message"]
    from kvtier.connectors.chunk_store import RemoteChunkStore
    from kvtier.connectors.vllm_turns import TurnReporter

    store = RemoteChunkStore(url, 1 << 16)
    reporter = TurnReporter(store.report_turns)
    reporter.started("s")
    reporter.drain()
    assert not reporter.enabled and reporter.sent == 0  # told nothing more
    reporter.close()
    store.close()
