"""The GPU kit kept from rotting: ``scripts/gpu_check.sh --dry-run`` runs every step of the
kit on the CPU (the CUDA suite under ``KVTIER_CUDA_TESTS_ON_CPU=1``, each benchmark at toy
sizes) and writes the same JSON a GPU run writes; the kit's own machinery (time budget,
test report, goals) is checked on real subprocesses and files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.benchmarks.gpu_kit import (
    GOALS,
    Step,
    _Log,
    cuda_test_figures,
    figures,
    judged_figures,
    load_results,
    plan,
    run_steps,
    ttft_figures,
)

REPO = Path(__file__).resolve().parents[2]


def _bash(args: list[str], env: dict[str, str] | None = None, timeout: float = 600):
    return subprocess.run(["bash", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_dry_run_runs_every_step_and_writes_the_results(tmp_path):
    out = tmp_path / "kit"
    proc = _bash(["scripts/gpu_check.sh", "--dry-run", "--out", str(out), "--work",
                  str(tmp_path / "work")],
                 env={"KVTIER_PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "gpu-kit.json").read_text())
    assert doc["suite"] == "gpu-kit" and doc["dry_run"] is True
    assert [s["name"] for s in doc["steps"]] == ["cuda-tests", "host-transfer", "kernels",
                                                 "codec-restores", "connector", "block-path",
                                                 "model", "ttft"]
    assert all(s["ok"] for s in doc["steps"]), doc["steps"]
    # The CUDA suite ran (on the CPU) and passed: the marker selects it and nothing is skipped.
    assert doc["tests"]["passed"] >= 20 and doc["tests"]["failures"] == 0
    assert doc["tests"]["errors"] == 0 and doc["tests"]["skipped"] == 0
    groups = {f["group"] for f in doc["figures"]}
    assert groups == {"tests", "host-transfer", "kernels", "codec-restores", "connector",
                      "block-path", "ttft"}
    assert all(f["met"] is None for f in doc["figures"] if f["group"] != "tests")  # not judged
    assert all(f["ratio"] > 0 for f in doc["figures"] if f["ratio"] is not None)
    for name in ("host-transfer", "kernels", "codec-restores", "connector", "ttft"):
        result = json.loads((out / f"{name}.json").read_text())
        assert result["machine"]["cpu_count"] >= 1 and "torch" in result["machine"]
    # The block path's result stays in the work folder ($OUT returns eight files) and
    # travels inside gpu-kit.json; the dry run took its device route in the interpreter.
    block = json.loads((tmp_path / "work" / "block-path.json").read_text())
    assert not (out / "block-path.json").exists()
    assert block["route"] == "device" and block["exact"] is True and block["hash_GBps"] > 0
    assert doc["block_path"]["rows"] == block["rows"]
    assert set(doc["judged"]) == {"restore_vs_h2d", "exact_save_vs_copy", "exact_load_vs_copy",
                                  "ttft_over_floor_32k"}
    assert all(j["met"] is None for j in doc["judged"].values())  # not judged in a dry run
    assert doc["judged"]["restore_vs_h2d"]["value"] == block["restore_vs_h2d"]
    assert doc["judged"]["ttft_over_floor_32k"]["value"] is None  # toy histories, no 32k
    ttft = json.loads((out / "ttft.json").read_text())
    assert [r["history_tokens"] for r in ttft["rows"]] == [128, 256]
    assert all(r["copy_kind"] == "host copy" for r in ttft["rows"])
    assert "CUDA tests" in proc.stdout and "reference (same run)" in proc.stdout
    assert (out / "kit.log").read_text().count("=====") >= 5


def test_without_a_wheelhouse_the_gpu_run_says_what_to_do(tmp_path):
    proc = _bash(["scripts/gpu_check.sh", "--out", str(tmp_path)],
                 env={"KVTIER_GPU_WHEELS": str(tmp_path / "missing")})
    assert proc.returncode == 2
    assert "scripts/gpu_wheels.sh" in proc.stderr and "carry .gpu-wheels" in proc.stderr


def test_unknown_arguments_are_refused():
    proc = _bash(["scripts/gpu_check.sh", "--dryrun"])
    assert proc.returncode == 2 and "unknown argument --dryrun" in proc.stderr


def test_the_wheelhouse_carries_kvtiers_dependencies_but_never_torch_triton_or_numpy():
    proc = subprocess.run([sys.executable, "scripts/gpu_wheels.py", "--list"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    reqs = proc.stdout.split()
    names = {r.split(">")[0].split("[")[0] for r in reqs}
    assert {"fastapi", "uvicorn", "pydantic", "pydantic-settings", "redis", "gguf"} <= names
    assert "setuptools>=77" in reqs and "wheel" in names
    assert not names & {"torch", "triton", "numpy"}


def test_steps_share_one_budget(tmp_path):
    """A step that outlives the budget is stopped (its whole process group), and the steps
    after it are reported as not run, not silently dropped."""
    py = sys.executable
    steps = [
        Step("quick", [py, "-c", "print('hi')"], cap_s=30),
        Step("hang", [py, "-c", "import subprocess, sys, time; "
                      "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
                      " time.sleep(60)"], cap_s=30),
        Step("after", [py, "-c", "print('late')"], cap_s=30),
    ]
    log = _Log(tmp_path / "kit.log")
    lines: list[str] = []
    outcomes = run_steps(steps, None, log, budget_s=4.0, echo=lines.append)
    assert [o.name for o in outcomes] == ["quick", "hang", "after"]
    assert outcomes[0].ok and outcomes[1].timed_out and not outcomes[1].ok
    assert outcomes[1].seconds < 10
    assert outcomes[2].rc is None and "budget spent" in outcomes[2].note
    assert "TIMEOUT" in lines[1] and "hi" in log.path.read_text()


def test_a_background_step_that_fails_skips_the_step_that_needs_it(tmp_path):
    py = sys.executable
    log = _Log(tmp_path / "kit.log")
    outcomes = run_steps([Step("first", [py, "-c", "pass"], 30), Step("needs", [py, "-c", "pass"], 30)],
                         Step("model", [py, "-c", "raise SystemExit(3)"], 30), log, 60,
                         echo=lambda _line: None)
    assert [(o.name, o.rc) for o in outcomes] == [("first", 0), ("model", 3), ("needs", None)]
    assert "its model failed" in outcomes[2].note
    # Why the model failed travels in the outcome (the device tool may not return kit.log).
    failing = run_steps([Step("bad", [py, "-c", "print('before'); raise SystemExit('why: ' + 'x')"], 30)],
                        None, log, 60, echo=lambda _line: None)
    assert "why: x" in failing[0].tail and "before" in failing[0].tail
    assert outcomes[0].tail == ""


def test_the_gpu_models_context_holds_the_longest_history():
    """The kit's TTFT model must admit its 32k history (Llama 3's own 8k context did not:
    the first GPU run's TTFT step stopped on it)."""
    from kvtier.benchmarks.gpu_kit import TTFT_HISTORIES, TTFT_PRESET
    from kvtier.benchmarks.ttft import NEW_TOKENS
    from kvtier.make_model.presets import PRESETS

    assert PRESETS[TTFT_PRESET].max_position_embeddings >= max(TTFT_HISTORIES) + NEW_TOKENS + 16


def test_failing_cuda_tests_fail_the_kit(tmp_path):
    (tmp_path / "cuda-tests.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="3" failures="1" errors="0" skipped="0">'
        '<testcase classname="tests.cuda.test_x" name="test_ok"/>'
        '<testcase classname="tests.cuda.test_x" name="test_bad"><failure message="boom"/></testcase>'
        '<testcase classname="tests.cuda.test_x" name="test_ok2"/>'
        '</testsuite></testsuites>')
    figs, summary = cuda_test_figures(tmp_path / "cuda-tests.xml")
    assert summary["passed"] == 2 and summary["failing"] == ["tests.cuda.test_x::test_bad"]
    assert figs[0].met is False and figs[0].value.startswith("2 passed, 1 failed")
    # Missing benchmark results are listed, judged as failures on a GPU.
    figs, _ = figures(tmp_path, judge=True)
    missing = [f for f in figs if f.name == "(no result)"]
    assert {f.group for f in missing} == {"host-transfer", "kernels", "codec-restores", "connector",
                                          "block-path", "ttft"}
    assert all(f.met is False for f in missing)


def test_the_gpu_plan_sizes_the_connector_and_block_path_steps(tmp_path):
    gpu = {s.name: s for s in plan(tmp_path / "out", tmp_path / "work", dry_run=False)}
    dry = {s.name: s for s in plan(tmp_path / "out", tmp_path / "work", dry_run=True)}
    assert list(gpu)[-2:] == ["block-path", "ttft"] == list(dry)[-2:]
    assert gpu["connector"].argv[-4:-2] == ["--chunks", "64"]
    assert "--chunks" not in dry["connector"].argv
    block = gpu["block-path"].argv
    assert block[block.index("--device") + 1] == "cuda" and "--device-copies" not in block
    assert gpu["block-path"].result == tmp_path / "work" / "block-path.json"
    assert gpu["block-path"].cap_s <= 120 and not gpu["block-path"].env
    assert "--device-copies" in dry["block-path"].argv
    assert dry["block-path"].env == {"TRITON_INTERPRET": "1"}


def ttft_row(h: int, **over) -> dict:
    """A ttft row with the fields the kit reads (seconds, bytes, GB/s)."""
    row = {"history_tokens": h, "recompute_s": 2.0, "pool_hit_s": 0.05, "cpu_s": 0.5,
           "cpu_stream_s": 1.0, "restored_bytes": {"cpu": 4_000_000_000, "disk": 4_000_000_000},
           "copy_GBps": 50.0, "copy_kind": "pinned H2D", "cpu_GBps": 9.0}
    return row | over


def write_results(out, work, *, sdpa: bool) -> None:
    out.mkdir()
    work.mkdir()
    rows = [ttft_row(8192, recompute_s=0.5, cpu_s=0.1),
            ttft_row(65536, cpu_s=0.26, pool_hit_s=0.1, copy_GBps=40.0,
                     **({"sdpa_recompute_s": 3.9} if sdpa else {})),
            ttft_row(32768, cpu_s=9.0)]  # not the largest: not read
    (out / "ttft.json").write_text(json.dumps({"rows": rows}))
    (out / "connector.json").write_text(json.dumps({"h2d_GBps": 50, "d2h_GBps": 50, "rows": [
        {"codec": "fp8", "save_vs_d2h": 2.0, "load_vs_h2d": 2.0},
        {"codec": "none", "save_vs_d2h": 0.81, "load_vs_h2d": 0.5}]}))
    (work / "block-path.json").write_text(json.dumps({"restore_vs_h2d": 0.79}))


@pytest.mark.parametrize("sdpa", [True, False])
def test_judged_figures_are_same_run_ratios_with_their_goals(tmp_path, sdpa):
    out, work = tmp_path / "out", tmp_path / "work"
    write_results(out, work, sdpa=sdpa)
    docs = load_results(out, work)
    judged = judged_figures(docs, judge=True)
    assert judged["restore_vs_h2d"] | {"ratio": ""} == {
        "step": "block-path", "ratio": "", "value": 0.79, "goal": ">= 0.8", "met": False}
    assert (judged["exact_save_vs_copy"]["value"], judged["exact_save_vs_copy"]["met"]) == (0.81, True)
    assert (judged["exact_load_vs_copy"]["value"], judged["exact_load_vs_copy"]["met"]) == (0.5, False)
    ttft = judged["ttft_over_floor_32k"]
    floor = 0.1 + 4e9 / 40e9  # the pool hit and the pinned copy of the restored bytes
    assert ttft["history_tokens"] == 65536 and ttft["goal"] == "<= 1.25"
    assert ttft["value"] == pytest.approx(0.26 / floor) and ttft["met"] is False  # 1.3
    assert ttft["speedup_vs_engine_32k"] == pytest.approx(2.0 / 0.26)
    if sdpa:
        assert ttft["speedup_vs_sdpa_32k"] == pytest.approx(3.9 / 0.26)
    else:
        assert ttft["speedup_vs_sdpa_32k"] is None
    # A dry run: the same values, nothing judged.
    dry = judged_figures(docs, judge=False)
    assert all(j["met"] is None for j in dry.values())
    assert {k: j["value"] for k, j in dry.items()} == {k: j["value"] for k, j in judged.items()}


def test_a_judged_figure_whose_step_left_no_result_is_not_met(tmp_path):
    judged = judged_figures(load_results(tmp_path, tmp_path), judge=True)
    assert set(judged) == {"restore_vs_h2d", "exact_save_vs_copy", "exact_load_vs_copy",
                           "ttft_over_floor_32k"}
    assert all(j["value"] is None and j["met"] is False for j in judged.values())
    ttft = judged["ttft_over_floor_32k"]
    assert ttft["speedup_vs_engine_32k"] is None and ttft["speedup_vs_sdpa_32k"] is None


def test_the_judged_ttft_restore_is_the_blocking_one_with_both_recompute_references():
    rows = [ttft_row(32768, cpu_s=0.1, sdpa_recompute_s=3.0), ttft_row(8192, cpu_s=1.0)]
    figs = {f.name: f for f in ttft_figures({"rows": rows}, judge=True)}
    blocking = figs["32768 tokens: CPU tier restore (blocking)"]
    assert blocking.ratio == pytest.approx(20.0) and blocking.met is True
    assert blocking.goal == f">= {GOALS['speedup_32k']:g}x"
    streamed = figs["32768 tokens: CPU tier restore (streamed)"]
    assert streamed.goal == "" and streamed.met is None  # shown, not judged
    over_sdpa = figs["32768 tokens: CPU tier restore (blocking), over SDPA"]
    assert over_sdpa.ratio == pytest.approx(30.0) and over_sdpa.met is None
    assert "8192 tokens: CPU tier restore (blocking), over SDPA" not in figs  # no SDPA there
    assert figs["8192 tokens: CPU tier restore (blocking)"].met is False  # 2x < 10x
    floor = figs["32768 tokens: CPU tier restore over its floor"]
    assert floor.ratio == pytest.approx(0.1 / (0.05 + 4e9 / 50e9)) and floor.met is True
    assert figs["8192 tokens: CPU tier restore over its floor"].met is None  # judged at 32k only
