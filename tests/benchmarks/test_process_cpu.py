"""The bench's CPU split: a process tree's CPU seconds told apart by the kernel's thread
names (kvtier's threads) and command lines (a kvtier sidecar), on real processes that
burn known amounts of CPU time."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvtier.benchmarks.process_cpu import CpuSplit, descendants, sample, thread_group

BURN = textwrap.dedent("""
    import sys, threading, time
    from kvtier.thread_start import name_this_thread

    def burn(seconds):  # CPU time, not wall time: the same on a busy host
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    burnt, stop = threading.Event(), threading.Event()

    def named():  # alive until the end: a thread that ended is folded into its process
        name_this_thread("kvtier-burn")
        burn(float(sys.argv[1]))
        burnt.set()
        stop.wait()

    threading.Thread(target=named, daemon=True).start()
    burnt.wait()
    burn(float(sys.argv[2]))
    if len(sys.argv) > 3 and sys.argv[3] == "child":
        subprocess = __import__("subprocess")
        child = subprocess.Popen([sys.executable, "-c", sys.argv[4], "kvtier.cli", "serve"])
        print("ready", flush=True)
        sys.stdin.readline()
        child.kill(); child.wait()
    else:
        print("ready", flush=True)
        sys.stdin.readline()
""")

SIDECAR_LIKE = textwrap.dedent("""
    import time
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    time.sleep(600)
""")


def _start(*args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", BURN, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_kvtier_threads_are_counted_apart_from_the_process_they_run_in() -> None:
    assert sample([]) == CpuSplit()
    proc = _start("0.4", "0.2")
    try:
        got = sample([proc.pid])
    finally:
        proc.communicate("\n", timeout=30)
    assert got is not None
    assert 0.35 <= got.kvtier_threads_s <= 0.6
    assert got.vllm_s >= 0.2  # the main thread's burn, interpreter start-up on top
    assert got.sidecar_s == 0.0
    assert 0.35 <= got.threads["kvtier_threads/python/kvtier-burn"] <= 0.6
    assert got.threads["vllm/python/python (main)"] >= 0.2


def test_a_sidecar_below_the_root_counts_as_the_sidecar_whole() -> None:
    proc = _start("0.1", "0.1", "child", SIDECAR_LIKE)
    try:
        tree = descendants([proc.pid])
        assert len(tree) == 2 and proc.pid in tree
        got = None
        for _ in range(200):  # the child burns its 0.3 s after it starts
            got = sample([proc.pid])
            if got is not None and got.sidecar_s >= 0.3:
                break
            subprocess.run(["sleep", "0.05"])
        assert got is not None
        assert got.sidecar_s >= 0.3
        assert got.kvtier_threads_s >= 0.09
        later = got + CpuSplit({"kvtier_threads/python/kvtier-burn": 0.05})
        assert (later - got).kvtier_s == pytest.approx(0.05)
        report = got.as_dict()
        assert set(report) == {"vllm_s", "kvtier_threads_s", "sidecar_s", "kvtier_s", "threads"}
        assert report["sidecar_s"] == pytest.approx(got.sidecar_s, abs=1e-3)
    finally:
        proc.communicate("\n", timeout=30)


def test_a_pools_thread_number_is_dropped_from_its_group() -> None:
    assert thread_group("kvtier-store_3") == "kvtier-store"
    assert thread_group("kvtier-chunk-re") == "kvtier-chunk-re"
    assert thread_group("python3") == "python"
    assert thread_group("7") == "7"


@pytest.mark.parametrize("program", [["-m", "kvtier.cli", "serve"], ["-m", "kvtier.cli.main", "serve"],
                                     ["/opt/venv/bin/kvtier", "serve", "--port", "1"]])
def test_a_sidecar_is_known_by_how_it_was_started(program: list[str]) -> None:
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    proc, other = subprocess.Popen([*sleep, *program]), subprocess.Popen([*sleep, "serve"])
    try:
        got, not_ours = sample([proc.pid]), sample([other.pid])
        assert got is not None and not_ours is not None
        assert got.threads and all(k.startswith("sidecar/") for k in got.threads)
        assert not_ours.threads and all(k.startswith("vllm/") for k in not_ours.threads)
    finally:
        for p in (proc, other):
            p.kill()
            p.wait()
