"""``kvtier bench gpu-kit``: every CUDA path proved and measured in one run (docs/gpu.md).

``scripts/gpu_check.sh`` installs kvtier on a lent GPU machine and runs this. Each step is a
subprocess with its own time limit, so a hang costs that step, not the lease:

1. the CUDA tests (``pytest -m cuda``, JUnit XML kept);
2. ``kvtier bench host-transfer``: kvtier's pinned slots against the plain pinned copy;
3. ``kvtier bench kernels``: paged decode against a device copy (HBM), prefill against a
   matrix product, gather/scatter against the copy;
4. ``kvtier bench codecs --restore-only``: restores of compressed chunks (fp8, int8, int4)
   from disk (and Redis where a ``redis-server`` exists) into a GPU pool, decoded on the
   device, against uncompressed ones in the same run;
5. ``kvtier bench connector``: the vLLM connector's worker saving vLLM-layout caches on the
   GPU into the CPU tier and loading them back (sync, async; per codec) against the pinned
   copy of the same bytes (64 chunks of 256 tokens, 2 GiB a round);
6. ``kvtier bench block-path``: 4 GiB of chunks leased from a pinned CPU tier and scattered
   into a GPU pool through the block path, and gathered back out, against the pinned copy
   of the same bytes, with the device phases (staging, hash, scatter) each alone; its JSON
   goes to the work folder and into ``gpu-kit.json`` (``block_path``), since the device
   tool returns at most eight files;
7. ``kvtier bench ttft`` on a Llama-3-8B-shaped random-weight model in bf16 at 2k/8k/32k
   tokens of history: restore from the CPU and disk tiers against recompute and a pool hit
   (the checkpoint is written in the background while steps 1-6 run).

Then one JSON (``gpu-kit.json``: the machine with GPU, driver, torch and Triton; every step's
outcome; every figure as a ratio to its reference and its goal; ``judged``: the figures the
GPU work is judged by, each a same-run ratio with its goal and whether it was met) and a
table. ``--dry-run`` runs the same steps on the CPU at toy sizes (the CUDA suite under
``KVTIER_CUDA_TESTS_ON_CPU=1``, the block path's device route in Triton's interpreter): CI
runs it so the kit cannot rot between GPU sessions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TTFT_PRESET = "llama-3.1-8b"
"""Llama-3.1-8B shapes: the 32k history needs its 128k context (Llama 3's is 8k)."""
CUDA_TEST_PATHS = ("tests/cuda", "tests/gpu_pool")
TTFT_HISTORIES = (2048, 8192, 32768)
STEP_NAMES = ("cuda-tests", "host-transfer", "kernels", "codec-restores", "connector",
              "block-path", "ttft")
GOALS = {
    "decode_vs_copy": 0.7,
    "transfer_vs_copy": 0.8,
    "restore_vs_h2d": 0.8,
    "exact_vs_copy": 0.8,
    "ttft_over_floor": 1.25,
    "speedup_8k": 10.0,
    "speedup_32k": 14.0,
    "codec_8bit": 1.8,
    "codec_4bit": 3.0,
}
"""The goals for the GPU figures (benchmarks' goals, never test thresholds); every one is
at least, except ``ttft_over_floor``: at most."""
LONG_HISTORY = 32768
"""The TTFT history the judged restore figures are read at (the largest at least this)."""
CONNECTOR_GPU_CHUNKS = 64
"""Chunks a connector round moves on a GPU: 2 GiB of Llama-3-8B KV, long enough that a
round is not dominated by its start."""


@dataclass(frozen=True)
class Step:
    """One subprocess of the kit: its command, time cap and the JSON it leaves."""

    name: str
    argv: list[str]
    cap_s: float
    result: Path | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Outcome:
    name: str
    rc: int | None
    seconds: float
    timed_out: bool = False
    note: str = ""
    tail: str = ""
    """The end of a failed step's output (the device tool may not return kit.log)."""

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out


@dataclass(frozen=True)
class Figure:
    """One measured figure as a ratio to the reference measured in the same run."""

    group: str
    name: str
    value: str
    reference: str
    ratio: float | None
    goal: str = ""
    met: bool | None = None


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "gpu-kit",
        help="the CUDA tests and GPU benchmarks in one run (what scripts/gpu_check.sh runs)",
        description="Run the CUDA test suite and the GPU benchmarks (host-transfer, kernels, "
        "codec restores, the vLLM connector, the block path's restore profile, TTFT on a "
        "Llama-3.1-8B-shaped model at 2k/8k/32k) within a time budget; write gpu-kit.json "
        "and print every figure as a ratio to its reference, and the judged ones with their "
        "goals. --dry-run: the same on the CPU at toy sizes.",
    )
    p.add_argument("--out", type=Path, default=Path("out/gpu-kit"),
                   help="folder for gpu-kit.json, each benchmark's JSON, the test XML and the log")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, toy sizes, goals not judged (CI runs this)")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="wall-clock budget for all steps (default 9 minutes)")
    p.add_argument("--work", type=Path, default=None,
                   help="scratch folder for the model checkpoint, the disk tier and the "
                   "block path's JSON (default out/gpu-kit-work)")
    p.add_argument("--results-dir", type=Path, default=None,
                   help="also copy the results here, named by GPU (gpu_check.sh: "
                   "benchmarks/results)")
    p.add_argument("--steps", default=None,
                   help="run only these foreground steps, comma-separated (a second run on "
                   f"the same loan): {', '.join(STEP_NAMES)}")
    p.set_defaults(func=run)


# ------------------------------------------------------------------------------- plan
def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvtier.cli", *args]


def model_step(work: Path, dry_run: bool) -> Step:
    preset, dtype = ("tiny", "float32") if dry_run else (TTFT_PRESET, "bfloat16")
    return Step("model", _cli("make-model", "--preset", preset, "--dtype", dtype, "--out",
                              str(work / "models" / preset)), cap_s=300)


def plan(out: Path, work: Path, dry_run: bool) -> list[Step]:
    """The foreground steps, in order (the model checkpoint is made beside them)."""
    tests_env = {"KVTIER_CUDA_TESTS_ON_CPU": "1"} if dry_run else {}
    # Only the folders that hold CUDA tests are collected: the rest of the suite imports
    # test-only packages (schemathesis, openai) that the GPU machines do not have.
    tests = Step("cuda-tests", [
        sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
        f"--junitxml={out / 'cuda-tests.xml'}", *(str(REPO / p) for p in CUDA_TEST_PATHS),
    ], cap_s=240, result=out / "cuda-tests.xml", env=tests_env)
    device = ["--device", "cpu"] if dry_run else ["--device", "cuda"]
    host = Step("host-transfer", _cli("bench", "host-transfer", *device, "--out",
                                      str(out / "host-transfer.json")),
                cap_s=60, result=out / "host-transfer.json")
    kernels = Step("kernels", _cli("bench", "kernels", *device, *(["--quick"] if dry_run else []),
                                   "--out", str(out / "kernels.json")),
                   cap_s=150, result=out / "kernels.json")
    preset = "tiny" if dry_run else TTFT_PRESET
    histories = "128,256" if dry_run else ",".join(map(str, TTFT_HISTORIES))
    ttft = Step("ttft", _cli(
        "bench", "ttft", "--model", str(work / "models" / preset), "--histories", histories,
        "--repeats", "1" if dry_run else "2", "--shared-prefix", "0",
        "--dtype", "float32" if dry_run else "bfloat16", "--device", "cpu" if dry_run else "cuda",
        "--disk-dir", str(work / "ttft-disk"), "--out", str(out / "ttft.json"),
    ), cap_s=600, result=out / "ttft.json")
    codecs = Step("codec-restores", _cli(
        "bench", "codecs", "--restore-only", "--restore-device", "cpu" if dry_run else "cuda",
        "--restore-shape", "2,2,32" if dry_run else "32,8,128",
        "--restore-chunks", "2" if dry_run else "8", "--restore-rounds", "1" if dry_run else "3",
        "--out", str(out / "codec-restores.json"),
    ), cap_s=150, result=out / "codec-restores.json")
    connector = Step("connector", _cli(
        "bench", "connector", *device,
        *(["--rounds", "1"] if dry_run else ["--chunks", str(CONNECTOR_GPU_CHUNKS)]),
        "--out", str(out / "connector.json"),
    ), cap_s=120, result=out / "connector.json")
    return [tests, host, kernels, codecs, connector, block_path_step(work, dry_run), ttft]


def block_path_step(work: Path, dry_run: bool) -> Step:
    """The block path's restore profile. Its JSON goes to the work folder (the device tool
    returns at most eight files from the output folder, all taken) and into gpu-kit.json.
    The dry run takes the device route in Triton's interpreter, two small chunks."""
    toy = ["--device", "cpu", "--device-copies", "--shape", "2,2,32", "--chunk-tokens", "32",
           "--chunks", "2", "--rounds", "1"]
    args = toy if dry_run else ["--device", "cuda", "--gib", "4"]
    return Step("block-path", _cli("bench", "block-path", *args, "--out",
                                   str(work / "block-path.json")),
                cap_s=120, result=work / "block-path.json",
                env={"TRITON_INTERPRET": "1"} if dry_run else {})


# -------------------------------------------------------------------------------- run
class _Log:
    """One log file for every step (the device machine returns at most a few files)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("")

    def section(self, title: str) -> Any:
        f = self.path.open("a")
        f.write(f"\n===== {title} =====\n")
        f.flush()
        return f


TAIL_CHARS = 3000


def _start(step: Step, log: _Log) -> tuple[subprocess.Popen, Any]:
    f = log.section(f"{step.name}: {' '.join(step.argv)}")
    f.output_from = f.tell()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **step.env}
    proc = subprocess.Popen(step.argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True)
    return proc, f


def _finish(step: Step, proc: subprocess.Popen, f: Any, started: float, limit: float) -> Outcome:
    timed_out = False
    try:
        rc = proc.wait(timeout=max(limit, 1.0))
    except subprocess.TimeoutExpired:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    f.close()
    out = Outcome(step.name, rc, time.monotonic() - started, timed_out)
    if timed_out:
        out.note = f"stopped after {limit:.0f} s (its cap or the kit's budget)"
    elif rc != 0:
        out.note = f"exit {rc}: see the log"
    if not out.ok:
        with open(f.name, "rb") as log:
            log.seek(f.output_from)
            out.tail = log.read().decode(errors="replace")[-TAIL_CHARS:]
    return out


def run_steps(steps: list[Step], background: Step | None, log: _Log, budget_s: float,
              echo: Any = print) -> list[Outcome]:
    """Run ``steps`` in order within ``budget_s``; ``background`` starts first and the last
    step (the one that needs it) waits for it."""
    t0 = time.monotonic()
    outcomes: list[Outcome] = []
    bg = None
    if background is not None:
        bg = (background, *_start(background, log), time.monotonic())
    for i, step in enumerate(steps):
        if bg is not None and i == len(steps) - 1:
            left = budget_s - (time.monotonic() - t0)
            outcomes.append(_finish(bg[0], bg[1], bg[2], bg[3], min(bg[0].cap_s, left)))
            echo(_line(outcomes[-1]))
            bg = None
            if not outcomes[-1].ok:
                outcomes.append(Outcome(step.name, None, 0.0, note="not run: its model failed"))
                echo(_line(outcomes[-1]))
                continue
        left = budget_s - (time.monotonic() - t0)
        if left < 1:
            outcomes.append(Outcome(step.name, None, 0.0, note="not run: budget spent"))
            echo(_line(outcomes[-1]))
            continue
        started = time.monotonic()
        proc, f = _start(step, log)
        outcomes.append(_finish(step, proc, f, started, min(step.cap_s, left)))
        echo(_line(outcomes[-1]))
    return outcomes


def _line(o: Outcome) -> str:
    state = "ok" if o.ok else ("TIMEOUT" if o.timed_out else "FAILED" if o.rc else "SKIPPED")
    return f"[gpu-kit] {o.name:<14} {state:<8} {o.seconds:7.1f} s  {o.note}"


# ---------------------------------------------------------------------------- figures
def _load(path: Path | None) -> dict[str, Any] | None:
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _met(judge: bool, value: float | None, goal: float) -> bool | None:
    return None if not judge or value is None else value >= goal


def _met_at_most(judge: bool, value: float | None, goal: float) -> bool | None:
    return None if not judge or value is None else value <= goal


def cuda_test_figures(xml_path: Path) -> tuple[list[Figure], dict[str, Any]]:
    """Passed / failed / skipped counts from the JUnit XML, and the failing tests' names."""
    if not xml_path.is_file():
        return [Figure("tests", "CUDA tests", "no report", "-", None, "all pass", False)], {}
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites)
              for k in ("tests", "failures", "errors", "skipped")}
    failing = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
               if c.find("failure") is not None or c.find("error") is not None]
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    ok = passed > 0 and counts["failures"] == 0 and counts["errors"] == 0
    summary = {**counts, "passed": passed, "failing": failing}
    value = (f"{passed} passed, {counts['failures'] + counts['errors']} failed, "
             f"{counts['skipped']} skipped")
    return [Figure("tests", "CUDA tests", value, f"{counts['tests']} selected",
                   passed / counts["tests"] if counts["tests"] else None, "all pass", ok)], summary


def kernel_figures(doc: dict[str, Any], judge: bool) -> list[Figure]:
    s = doc["summary"]
    copy = f"D2D copy {doc['copy']['gbps']:.0f} GB/s"
    longest = max(r["context"] for r in doc["decode"])
    best = max((r for r in doc["decode"] if r["context"] == longest), key=lambda r: r["bw_vs_copy"])
    mm = doc.get("matmul", {})
    figs = [
        Figure("kernels", f"paged decode, context {longest}, batch {best['batch']}",
               f"{best['paged_gbps']:.0f} GB/s", copy, best["bw_vs_copy"],
               f">= {GOALS['decode_vs_copy']}", _met(judge, best["bw_vs_copy"], GOALS["decode_vs_copy"])),
    ]
    if s.get("decode_bw_vs_copy_min") is not None:
        figs.append(Figure("kernels", "paged decode, worst of batch >= 32, context >= 4K",
                           "-", copy, s["decode_bw_vs_copy_min"]))
    if s.get("prefill_tflops_vs_matmul_max") is not None:
        top = max(doc["prefill"], key=lambda r: r.get("tflops_vs_matmul", 0))
        figs.append(Figure("kernels", f"paged prefill, best ({top['batch']}x{top['new_tokens']} "
                           f"over {top['prefix']})", f"{top['paged_tflops']:.1f} TFLOP/s",
                           f"{mm.get('dtype')} matmul {mm.get('tflops', 0):.1f} TFLOP/s",
                           top["tflops_vs_matmul"]))
    if s.get("gather_scatter_vs_copy_min") is not None:
        figs.append(Figure("kernels", "block gather/scatter, worst", "-", copy,
                           s["gather_scatter_vs_copy_min"]))
    return figs


def host_figures(doc: dict[str, Any], judge: bool) -> list[Figure]:
    figs = []
    pinned = all(r["slots_pinned"] for r in doc["rows"])
    for way, label in (("h2d", "H2D"), ("d2h", "D2H"), ("both", "both ways at once")):
        worst = min(doc["rows"], key=lambda r: r[f"{way}_kvtier_vs_copy"])
        ratio = worst[f"{way}_kvtier_vs_copy"]
        figs.append(Figure(
            "host-transfer", f"kvtier slots {label}, worst size ({worst['bytes'] >> 20} MiB)"
            + ("" if pinned or not judge else ", SLOTS NOT PINNED"),
            f"{worst[f'{way}_kvtier_GBps']:.1f} GB/s",
            f"pinned copy_ {worst[f'{way}_copy_GBps']:.1f} GB/s", ratio,
            f">= {GOALS['transfer_vs_copy']}", _met(judge, ratio, GOALS["transfer_vs_copy"])))
    return figs


TTFT_CASES = (("pool_hit", "pool hit (floor)"), ("cpu", "CPU tier restore (blocking)"),
              ("cpu_stream", "CPU tier restore (streamed)"),
              ("disk_stream", "disk tier restore (page cache warm)"),
              ("disk_cold_stream", "disk tier restore (cold)"))
"""The TTFT cases shown, in order; the judged restore is the blocking CPU one (the path a
CUDA pool's restore takes)."""


def restore_floor_s(row: dict[str, Any]) -> float:
    """The least a blocking CPU-tier restore's TTFT can be: a pool hit plus the pinned
    copy of the restored bytes at the copy's speed measured in the same run."""
    return row["pool_hit_s"] + row["restored_bytes"]["cpu"] / (row["copy_GBps"] * 1e9)


def ttft_figures(doc: dict[str, Any], judge: bool) -> list[Figure]:
    figs = []
    for r in doc["rows"]:
        h = r["history_tokens"]
        rec = r["recompute_s"]
        sdpa = r.get("sdpa_recompute_s")
        goal = GOALS["speedup_32k"] if h >= LONG_HISTORY else GOALS["speedup_8k"] if h >= 8192 else None
        for case, label in TTFT_CASES:
            if f"{case}_s" not in r:
                continue
            speedup = rec / r[f"{case}_s"]
            g = goal if case == "cpu" else None
            figs.append(Figure(
                "ttft", f"{h} tokens: {label}", f"{r[f'{case}_s'] * 1e3:.1f} ms",
                f"engine recompute {rec * 1e3:.1f} ms", speedup, f">= {g:g}x" if g else "",
                _met(judge, speedup, g) if g else None))
            if case == "cpu" and sdpa is not None:
                figs.append(Figure(
                    "ttft", f"{h} tokens: {label}, over SDPA", f"{r['cpu_s'] * 1e3:.1f} ms",
                    f"SDPA prefill recompute {sdpa * 1e3:.1f} ms", sdpa / r["cpu_s"]))
        if "cpu_s" in r and "cpu" in r.get("restored_bytes", {}):
            floor = restore_floor_s(r)
            over = r["cpu_s"] / floor
            judged = h >= LONG_HISTORY
            figs.append(Figure(
                "ttft", f"{h} tokens: CPU tier restore over its floor", f"{r['cpu_s'] * 1e3:.1f} ms",
                f"pool hit + {r.get('copy_kind', 'copy')} of its bytes {floor * 1e3:.1f} ms", over,
                f"<= {GOALS['ttft_over_floor']:g}" if judged else "",
                _met_at_most(judge, over, GOALS["ttft_over_floor"]) if judged else None))
        gbps = r.get("cpu_GBps")
        if gbps:
            ratio = gbps / r["copy_GBps"]
            figs.append(Figure(
                "ttft", f"{h} tokens: CPU restore bandwidth (blocking)", f"{gbps:.1f} GB/s",
                f"{r.get('copy_kind', 'copy')} {r['copy_GBps']:.1f} GB/s", ratio,
                f">= {GOALS['restore_vs_h2d']}", _met(judge, ratio, GOALS["restore_vs_h2d"])))
    return figs


def block_path_figures(doc: dict[str, Any], judge: bool) -> list[Figure]:
    """The block path's restore (judged) and save over the pinned copies of the same bytes,
    and each device phase's speed over the H2D copy (below 1: that phase alone is slower
    than the bytes' crossing)."""
    size = f"{doc['chunks']} chunks, {doc['total_bytes'] / 2**20:.0f} MiB"
    pinned = "pinned " if doc.get("host_pinned") else "host "
    h2d = f"{pinned}H2D copy_ {doc['h2d_GBps']:.1f} GB/s"
    ratio = doc["restore_vs_h2d"]
    figs = [
        Figure("block-path", f"restore ({size}): lease, check on the device, scatter",
               f"{doc['restore_GBps']:.1f} GB/s", h2d, ratio, f">= {GOALS['restore_vs_h2d']}",
               _met(judge, ratio, GOALS["restore_vs_h2d"])),
        Figure("block-path", f"save ({size}): gather and hash on the device, one copy a chunk",
               f"{doc['save_GBps']:.1f} GB/s", f"{pinned}D2H copy_ {doc['d2h_GBps']:.1f} GB/s",
               doc["save_vs_d2h"]),
    ]
    for phase, label in (("staging", "H2D staging alone"), ("hash", "hash launches alone"),
                         ("scatter", "one window's scatter launch alone")):
        gbps = doc.get(f"{phase}_GBps")
        if gbps:
            figs.append(Figure("block-path", label, f"{gbps:.1f} GB/s", h2d, gbps / doc["h2d_GBps"]))
    return figs


def codec_figures(doc: dict[str, Any], judge: bool) -> list[Figure]:
    """KV per second restored from compressed chunks over uncompressed ones (goals: 1.8x
    for fp8 and int8, 3x for int4)."""
    figs = []
    for r in doc["restore"]:
        goal = GOALS["codec_4bit"] if r["codec"] == "int4" else GOALS["codec_8bit"]
        figs.append(Figure(
            "codec-restores", f"{r['tier']} {r['codec']} restore to {r.get('pool_device', 'cpu')}",
            f"{r['kv_GBps']:.2f} GB/s of KV", f"uncompressed {r['none_kv_GBps']:.2f} GB/s",
            r["speedup"], f">= {goal:g}x", _met(judge, r["speedup"], goal)))
    return figs


def connector_figures(doc: dict[str, Any], judge: bool) -> list[Figure]:
    """The vLLM connector's saves and loads of GPU caches over the pinned copy of the same
    bytes (the exact ones are judged in ``judged``)."""
    figs = []
    for r in doc["rows"]:
        for case, label, ref in (("save", "save (background)", "d2h"), ("load", "load (sync)", "h2d"),
                                 ("async_load", "load (async)", "h2d")):
            figs.append(Figure(
                "connector", f"{r['codec']} {label}", f"{r[f'{case}_GBps']:.2f} GB/s of KV",
                f"pinned {ref.upper()} copy_ {doc[f'{ref}_GBps']:.1f} GB/s",
                r[f"{case}_vs_{ref}"]))
    return figs


FIGURES = (("host-transfer", host_figures), ("kernels", kernel_figures),
           ("codec-restores", codec_figures), ("connector", connector_figures),
           ("block-path", block_path_figures), ("ttft", ttft_figures))
IN_WORK = ("block-path",)
"""Results kept in the work folder, not the output folder (which the device tool returns
only eight files of)."""


def load_results(out: Path, work: Path | None = None) -> dict[str, dict[str, Any] | None]:
    """Each benchmark step's JSON (None where it left none)."""
    return {name: _load((work or out) / f"{name}.json" if name in IN_WORK else out / f"{name}.json")
            for name, _ in FIGURES}


def figures(out: Path, judge: bool, work: Path | None = None
            ) -> tuple[list[Figure], dict[str, Any]]:
    figs, tests = cuda_test_figures(out / "cuda-tests.xml")
    docs = load_results(out, work)
    for name, fn in FIGURES:
        doc = docs[name]
        if doc is None:
            figs.append(Figure(name, "(no result)", "-", "-", None, "", False if judge else None))
            continue
        figs.extend(fn(doc, judge))
    return figs, tests


def _judged(step: str, ratio: str, value: float | None, goal: float, judge: bool,
            at_most: bool = False) -> dict[str, Any]:
    """One judged figure: not judged in a dry run (None); on a GPU, a missing value (its
    step failed) is a goal not met."""
    met = (_met_at_most if at_most else _met)(judge, value, goal)
    return {"step": step, "ratio": ratio, "value": value,
            "goal": f"{'<=' if at_most else '>='} {goal:g}",
            "met": False if judge and value is None else met}


def _exact_connector(doc: dict[str, Any] | None) -> dict[str, Any]:
    """The connector's uncompressed row ({} where there is none)."""
    rows = [] if doc is None else [r for r in doc.get("rows", []) if r.get("codec") == "none"]
    return rows[0] if rows else {}


def _long_ttft(doc: dict[str, Any] | None) -> dict[str, Any]:
    """The ttft row of the largest history of at least :data:`LONG_HISTORY` tokens ({})."""
    rows = [] if doc is None else [r for r in doc.get("rows", [])
                                   if r.get("history_tokens", 0) >= LONG_HISTORY]
    return max(rows, key=lambda r: r["history_tokens"]) if rows else {}


def judged_figures(docs: dict[str, dict[str, Any] | None], judge: bool) -> dict[str, Any]:
    """The figures the GPU work is judged by, each a ratio to a reference measured in the
    same run, with its goal and whether it was met."""
    exact = _exact_connector(docs.get("connector"))
    row = _long_ttft(docs.get("ttft"))
    cpu_s = row.get("cpu_s")
    over = cpu_s / restore_floor_s(row) if cpu_s and "cpu" in row.get("restored_bytes", {}) else None
    sdpa = row.get("sdpa_recompute_s")
    ttft = _judged("ttft", "cpu_s / (pool_hit_s + restored_bytes['cpu'] / (copy_GBps * 1e9)) "
                   f"at the largest history >= {LONG_HISTORY}", over, GOALS["ttft_over_floor"],
                   judge, at_most=True)
    ttft |= {"history_tokens": row.get("history_tokens"),
             "speedup_vs_engine_32k": row["recompute_s"] / cpu_s if cpu_s and "recompute_s" in row else None,
             "speedup_vs_sdpa_32k": sdpa / cpu_s if cpu_s and sdpa is not None else None}
    return {
        "restore_vs_h2d": _judged(
            "block-path", "h2d_s / restore_s: pinned H2D copy_ of the same bytes over the block "
            "path's restore", (docs.get("block-path") or {}).get("restore_vs_h2d"),
            GOALS["restore_vs_h2d"], judge),
        "exact_save_vs_copy": _judged(
            "connector", "save_vs_d2h of codec none: pinned D2H copy_ of the same bytes over "
            "the connector's save", exact.get("save_vs_d2h"), GOALS["exact_vs_copy"], judge),
        "exact_load_vs_copy": _judged(
            "connector", "load_vs_h2d of codec none: pinned H2D copy_ of the same bytes over "
            "the connector's load", exact.get("load_vs_h2d"), GOALS["exact_vs_copy"], judge),
        "ttft_over_floor_32k": ttft,
    }


def print_table(figs: list[Figure], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if Console().is_terminal else Console(width=160)
    t = Table(title=title, title_justify="left")
    for col in ("group", "figure", "value", "reference (same run)", "ratio", "goal", "met"):
        t.add_column(col, justify="right" if col in ("ratio",) else "left")
    for f in figs:
        t.add_row(f.group, f.name, f.value, f.reference,
                  "-" if f.ratio is None else f"{f.ratio:.2f}", f.goal,
                  "-" if f.met is None else ("yes" if f.met else "NO"))
    console.print(t)


def print_judged(judged: dict[str, Any]) -> None:
    """One line a judged figure: its value, goal and whether it was met."""
    for name, j in judged.items():
        value = "-" if j["value"] is None else f"{j['value']:.3f}"
        met = "-" if j["met"] is None else ("yes" if j["met"] else "NO")
        print(f"[gpu-kit] judged {name:<22} {value:>8}  goal {j['goal']:<7} met {met}")


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def gpu_machine() -> dict[str, Any]:
    """GPU name, memory, SMs, driver and CUDA runtime (beside the host facts)."""
    import torch

    from kvtier.benchmarks.machine import machine_info

    info = machine_info()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu_memory_bytes=props.total_memory, gpu_sms=props.multi_processor_count)
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=20)
            info["gpu_driver"] = smi.stdout.strip().splitlines()[0] if smi.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            info["gpu_driver"] = None
    return info


def _fresh_steps(chosen: tuple[str, ...], out: Path, work: Path, dry_run: bool) -> list[Step]:
    """The chosen steps, their old results and scratch removed (a rerun on one machine)."""
    steps = [s for s in plan(out, work, dry_run) if s.name in chosen]
    for step in steps:
        if step.result is not None:
            step.result.unlink(missing_ok=True)
    (work / "models").mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "ttft-disk", ignore_errors=True)
    return steps


def _copy_results(results_dir: Path, slug: str, out: Path, work: Path) -> None:
    """The run's result files into ``results_dir``, named by the GPU."""
    results_dir.mkdir(parents=True, exist_ok=True)
    for name in ("gpu-kit", "host-transfer", "kernels", "ttft", "block-path"):
        src = (work if name in IN_WORK else out) / f"{name}.json"
        if src.is_file():
            shutil.copy2(src, results_dir / f"{name}-{slug}.json")


def run(args: argparse.Namespace) -> int:
    from kvtier.benchmarks.results import write_result

    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = (args.work or Path("out/gpu-kit-work")).resolve()
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu-kit: no CUDA device here; run with --dry-run on a CPU", file=sys.stderr)
            return 2
    chosen = STEP_NAMES if args.steps is None else tuple(args.steps.split(","))
    unknown = set(chosen) - set(STEP_NAMES)
    if unknown:
        print(f"gpu-kit: unknown steps {sorted(unknown)}; choose from {STEP_NAMES}",
              file=sys.stderr)
        return 2
    steps = _fresh_steps(chosen, out, work, args.dry_run)
    log = _Log(out / "kit.log")
    background = model_step(work, args.dry_run) if "ttft" in chosen else None
    if background is not None and (Path(background.argv[-1]) / "config.json").is_file():
        background = None  # made by an earlier run on this machine
    t0 = time.monotonic()
    outcomes = run_steps(steps, background, log, args.budget_s)
    judge = not args.dry_run
    figs, tests = figures(out, judge, work)
    docs = load_results(out, work)
    machine = gpu_machine()
    title = (f"gpu-kit on {machine.get('gpu') or 'CPU (dry run: toy sizes, goals not judged)'}"
             f"; {time.monotonic() - t0:.0f} s")
    print_table(figs, title)
    judged = judged_figures(docs, judge)
    print_judged(judged)
    payload = {
        "machine": machine,
        "dry_run": bool(args.dry_run),
        "budget_s": args.budget_s,
        "seconds": time.monotonic() - t0,
        "goals": GOALS,
        "steps": [asdict(o) | {"ok": o.ok} for o in outcomes],
        "tests": tests,
        "figures": [asdict(f) for f in figs],
        "judged": judged,
        "block_path": docs["block-path"],
    }
    path = write_result(out / "gpu-kit.json", "gpu-kit", payload)
    print(f"wrote {path}")
    if args.results_dir is not None and not args.dry_run:
        _copy_results(args.results_dir, _slug(machine.get("gpu") or "gpu"), out, work)
    ok = all(o.ok for o in outcomes) and all(f.met is not False for f in figs if f.group == "tests")
    return 0 if ok else 1
