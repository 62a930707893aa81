"""``kvtier bench vllm``'s summary of its rounds: first and returning turns apart, replies
compared with vLLM alone's of the same round, the connector's share of vLLM's step time
from its counters, and a setup that could not start reported with its root cause."""

from __future__ import annotations

import pytest

from kvtier.benchmarks.chat_replay import TurnResult
from kvtier.benchmarks.vllm_bench import _summarise
from kvtier.benchmarks.vllm_servers import root_cause, route_requests


def _turns(ttft_first: float, ttft_next: float, change: int | None = None) -> list[TurnResult]:
    out = []
    for c in range(2):
        for t in range(3):
            ids = [c, t, 7] if (c, t) != (1, change) else [0, 0, 0]
            out.append(TurnResult(c, t, ttft_first if t == 0 else ttft_next, [0.1, 0.3], ids))
    return out


def test_rounds_are_summarised_against_vllm_alone_of_the_same_round():
    metrics = {"vllm:kvtier_load_seconds_total": 0.5, "vllm:kvtier_save_wait_seconds_total": 0.5,
               "vllm:kvtier_step_seconds_total": 20.0}
    rounds = [
        {"alone": {"turns": _turns(2.0, 1.0), "wall_s": 10.0, "metrics": {}},
         "kvtier": {"turns": _turns(2.0, 0.25), "wall_s": 5.0, "metrics": metrics},
         "peer": {"error": "ValueError: No supported cpu connector found (server did not come up; log)"}},
        {"alone": {"turns": _turns(4.0, 3.0), "wall_s": 10.0, "metrics": {}},
         "kvtier": {"turns": _turns(4.0, 0.75, change=2), "wall_s": 5.0, "metrics": metrics},
         "peer": {"error": "ValueError: No supported cpu connector found (server did not come up; log)"}},
    ]
    alone, kvtier, peer = _summarise(["alone", "kvtier", "peer"], rounds)
    assert alone["returning_ttft_mean_s"] == pytest.approx(2.0)
    assert kvtier["returning_ttft_mean_s"] == pytest.approx(0.5)
    assert kvtier["first_ttft_mean_s"] == alone["first_ttft_mean_s"] == pytest.approx(3.0)
    assert kvtier["identical_turns"] == [11, 12]  # one reply differed in round 2
    assert alone["identical_turns"] is None  # the reference itself
    assert kvtier["connector_forward_share"] == pytest.approx(0.05)
    assert kvtier["output_tok_per_s"] == pytest.approx(18 / 5.0)
    assert kvtier["itl_mean_s"] == pytest.approx(0.2)
    assert peer["rounds"] == [] and peer["could_not_run"].startswith("ValueError: No supported")
    # each round against vLLM alone of the same round
    assert kvtier["returning_ttft_ratio"]["by_round"] == [0.25, 0.25]
    assert kvtier["first_ttft_ratio"]["by_round"] == [1.0, 1.0]
    assert kvtier["first_ttft_ratio"]["low"] == kvtier["first_ttft_ratio"]["high"] == 1.0
    assert "first_ttft_ratio" not in alone


def test_medians_are_reported_beside_means():
    """One slow turn (the opening burst) moves the mean, not the median."""
    turns = [TurnResult(c, 0, 9.0 if c == 0 else 1.0, [0.1], [c]) for c in range(5)]
    (alone,) = _summarise(["alone"], [{"alone": {"turns": turns, "wall_s": 1.0, "metrics": {}}}])
    assert alone["first_ttft_mean_s"] == pytest.approx(2.6)
    assert alone["first_ttft_median_s"] == pytest.approx(1.0)
    assert alone["returning_ttft_median_s"] is None  # no returning turns


def test_the_root_cause_of_a_failed_start_is_the_first_error_logged():
    log = "WARNING ulimit: this can cause fd limit errors like `OSError: [Errno 24] Too many`\n" \
          "(EngineCore) ERROR [core.py] ValueError: invalid literal for int(): 'all'\n" \
          "Traceback ...\nRuntimeError: Engine core initialization failed.\n"
    assert root_cause(log) == "ValueError: invalid literal for int(): 'all'"
    assert root_cause("just a line\n") == "just a line"
    assert root_cause("Traceback\n  x\nKeyError: 'k'\n") == "KeyError: 'k'"


def test_no_two_rounds_share_a_store(tmp_path):
    """Rounds replay the same conversations: a setup whose tiers outlived its round would
    restore the earlier round's KV and look faster than it is."""
    from kvtier.benchmarks.vllm_bench import round_setups

    def strings(value) -> list[str]:
        if isinstance(value, dict):
            return [s for v in value.values() for s in strings(v)]
        return [value] if isinstance(value, str) else []

    def paths(r: int) -> set[str]:
        return {s for setup in round_setups(tmp_path, r).values()
                for s in strings(setup.kv_transfer_config or {}) if s.startswith(str(tmp_path))}

    first, second = paths(0), paths(1)
    assert first and second and not first & second


def test_each_round_starts_one_setup_later():
    """Every setup runs once a round, and each in every place of the order over as many
    rounds as there are setups: a drift over a round favours none."""
    from kvtier.benchmarks.vllm_bench import round_order

    names = ["alone", "kvtier-inprocess", "kvtier-serve"]
    orders = [round_order(names, r) for r in range(4)]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert {o[0] for o in orders[:3]} == set(names)
    assert orders[3] == orders[0] == names
    assert round_order([], 2) == []


def test_peers_run_in_their_rounds_only_and_under_their_own_limit(tmp_path):
    """``--peer-rounds 1``: LMCache and vLLM's own offloading run in the first round (a
    peer that cannot serve on this host says so once), kvtier and vLLM alone in every
    round; ``--peer-limit-s`` bounds the peers' replays only."""
    import argparse

    from kvtier.benchmarks.vllm_bench import _limit_s, round_runs, setups

    known = setups(tmp_path)
    names = ["alone", "kvtier-inprocess", "lmcache", "vllm-native"]
    assert sorted(round_runs(names, 0, known, 1)) == sorted(names)
    assert sorted(round_runs(names, 1, known, 1)) == ["alone", "kvtier-inprocess"]
    assert sorted(round_runs(names, 3, known, None)) == sorted(names)
    args = argparse.Namespace(setup_limit_s=1200.0, peer_limit_s=300.0)
    assert _limit_s(known["lmcache"], args) == 300.0
    assert _limit_s(known["kvtier-serve"], args) == 1200.0
    assert _limit_s(known["lmcache"], argparse.Namespace(setup_limit_s=900.0, peer_limit_s=None)) == 900.0


def test_a_setups_sidecar_slots_fit_its_own_chunks(tmp_path):
    """The shared sidecar's CPU slots are sized to the chunks the setup's connector writes:
    a one-block-chunk setup gets one-block slots (chunk-sized slots would leave most of each
    empty), the default setup 256-token ones."""
    import argparse
    import json

    from kvtier.benchmarks.vllm_bench import _chunk_bytes, setups

    (tmp_path / "config.json").write_text(json.dumps({
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
        "num_hidden_layers": 3}))
    args = argparse.Namespace(model=str(tmp_path), block_size=32)
    every = setups(tmp_path / "w")
    whole = _chunk_bytes(args, every["kvtier-serve"])
    one = _chunk_bytes(args, every["kvtier-serve-block-chunks"])
    block = 3 * 2 * 32 * 2 * 64 * 4
    assert block <= one < 2 * block and 8 * block <= whole < 9 * block


def test_metrics_are_read_once_the_counters_stop_moving():
    """A server whose counter still grows after the last reply (a connector's last saves
    landing): the bench reads it once it has stopped, not the first value it sees."""
    import http.server
    import threading
    import time

    from kvtier.benchmarks.vllm_servers import settled_metrics

    started = time.monotonic()

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            saved = min(5, int((time.monotonic() - started) / 0.3))  # grows for 1.5 s
            body = f"# TYPE kvtier_saved counter\nkvtier_saved_total {saved}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        got = settled_metrics(f"http://127.0.0.1:{server.server_address[1]}", quiet_s=0.5)
        assert got["kvtier_saved_total"] == 5
    finally:
        server.shutdown()


def test_the_cpu_split_is_averaged_over_rounds_thread_group_by_group():
    def cpu(vllm: float, save: float | None) -> dict:
        threads = {"vllm/VLLM::Worker/python": vllm}
        if save is not None:
            threads["kvtier_threads/VLLM::Worker/kvtier-vllm-sav"] = save
        return {"vllm_s": vllm, "kvtier_threads_s": save or 0.0, "sidecar_s": 0.0,
                "kvtier_s": save or 0.0, "threads": threads}

    rounds = [{"kvtier": {"turns": _turns(1.0, 1.0), "wall_s": 1.0, "metrics": {}, "cpu_s": cpu(10.0, 1.0)}},
              {"kvtier": {"turns": _turns(1.0, 1.0), "wall_s": 1.0, "metrics": {}, "cpu_s": cpu(12.0, None)}},
              {"kvtier": {"turns": _turns(1.0, 1.0), "wall_s": 1.0, "metrics": {}}}]  # off Linux
    (row,) = _summarise(["kvtier"], rounds)
    assert row["cpu_s"]["vllm_s"] == pytest.approx(11.0)
    assert row["cpu_s"]["kvtier_s"] == pytest.approx(0.5)
    assert row["cpu_s"]["threads"] == {"vllm/VLLM::Worker/python": pytest.approx(11.0),
                                       "kvtier_threads/VLLM::Worker/kvtier-vllm-sav": pytest.approx(0.5)}
    (without,) = _summarise(["kvtier"], rounds[2:])
    assert without["cpu_s"] is None


def test_a_sidecars_requests_are_counted_by_route(tmp_path):
    """What the bench reports as ``sidecar_requests``: a real ``kvtier serve``'s requests by
    method and route template, read from its ``/metrics``."""
    import httpx

    from kvtier.benchmarks.vllm_servers import start_kvtier_serve

    sidecar = start_kvtier_serve(tmp_path, slot_bytes=1 << 20)
    try:
        before = route_requests(sidecar.url)
        for key in ("a" * 32, "b" * 32):
            assert httpx.get(f"{sidecar.url}/v1/chunks/{key}", timeout=30).status_code == 404
        after = route_requests(sidecar.url)
    finally:
        sidecar.stop()
    assert after["GET /v1/chunks/{key}"] - before.get("GET /v1/chunks/{key}", 0) == 2


def test_each_round_splits_time_to_first_token_as_vllm_does():
    """vLLM's own histograms: time queued and time prefilling, a mean each; none where
    vLLM reported no request."""
    metrics = {"vllm:request_queue_time_seconds_sum": 0.3, "vllm:request_queue_time_seconds_count": 6,
               "vllm:request_prefill_time_seconds_sum": 2.4, "vllm:request_prefill_time_seconds_count": 6}
    (kvtier,) = _summarise(["kvtier"], [{"kvtier": {"turns": _turns(2.0, 1.0), "wall_s": 1.0,
                                                     "metrics": metrics}}])
    (row,) = kvtier["rounds"]
    assert row["queue_s_mean"] == pytest.approx(0.05)
    assert row["prefill_s_mean"] == pytest.approx(0.4)
    (empty,) = _summarise(["e"], [{"e": {"turns": _turns(2.0, 1.0), "wall_s": 1.0, "metrics": {}}}])
    assert empty["rounds"][0]["queue_s_mean"] is None
