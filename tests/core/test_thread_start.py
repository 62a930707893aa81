"""kvtier's background threads carry their names into the kernel (``/proc/<pid>/task/*/comm``,
``top -H``), so that they can be told from a serving engine's own threads."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvtier.connectors.vllm_saves import SaveQueue
from kvtier.thread_start import NAME_BYTES, kernel_name, name_this_thread, thread_started


def _kernel_name_of_this_thread() -> str:
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()


def test_a_pool_initializer_gives_the_kernel_the_threads_python_name() -> None:
    with ThreadPoolExecutor(1, thread_name_prefix="kvtier-test", initializer=thread_started) as pool:
        python_name, kernel = pool.submit(
            lambda: (threading.current_thread().name, _kernel_name_of_this_thread())).result(10)
    assert python_name == "kvtier-test_0"
    assert kernel == "kvtier-test_0"


def test_a_long_name_is_cut_to_the_kernels_fifteen_bytes() -> None:
    got: list[str] = []

    def run() -> None:
        assert name_this_thread("kvtier-a-very-long-thread-name")
        got.append(_kernel_name_of_this_thread())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert got == ["kvtier-a-very-l"]
    assert len(kernel_name("é" * 20)) == NAME_BYTES  # bytes, not characters


def test_the_connectors_save_thread_is_named_in_the_kernel() -> None:
    saves = SaveQueue(background=True)
    seen: list[str] = []
    done = threading.Event()

    def job() -> None:
        seen.append(_kernel_name_of_this_thread())
        done.set()

    saves.submit(["r"], job)
    assert done.wait(30)
    saves.close()
    assert seen[0].startswith("kvtier-vllm-sav")
    assert _kernel_name_of_this_thread() != seen[0]  # the caller's own name is untouched
