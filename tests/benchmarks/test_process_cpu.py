"""The bench's CPU split: a process tree's CPU seconds told apart by the kernel's thread
names (kvtier's threads) and command lines (a kvtier sidecar), on real processes that
burn known amounts of CPU time."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvtier.benchmarks.process_cpu import CpuSplit, descendants, sample

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")

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
    before = sample([])
    assert before == CpuSplit()
    proc = _start("0.4", "0.2")
    try:
        got = sample([proc.pid])
    finally:
        proc.communicate("\n", timeout=30)
    assert got is not None
    assert 0.35 <= got.kvtier_threads_s <= 0.6
    assert got.vllm_s >= 0.2  # the main thread's burn, interpreter start-up on top
    assert got.sidecar_s == 0.0


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
        split = got - CpuSplit(vllm_s=0.0, kvtier_threads_s=0.05)
        assert split.kvtier_s == pytest.approx(got.kvtier_s - 0.05)
        assert set(split.as_dict()) == {"vllm_s", "kvtier_threads_s", "sidecar_s", "kvtier_s"}
    finally:
        proc.communicate("\n", timeout=30)
