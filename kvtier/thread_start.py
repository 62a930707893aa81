"""What each of kvtier's background threads does first: take a name the kernel shows, and
spread over its process's cores (:mod:`kvtier.thread_cores`).

Python keeps a thread's name to itself; the kernel's (what ``top -H``, ``ps -L`` and
``/proc/<pid>/task/<tid>/comm`` show) stays the process's. Given the Python name
(``kvtier-vllm-save_0``, cut to the kernel's 15 bytes), kvtier's threads inside vLLM's
worker can be told from vLLM's own: by an operator, and by ``kvtier bench vllm``, which
counts their CPU time apart from vLLM's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
import threading

from kvtier.thread_cores import spread_this_thread

log = logging.getLogger(__name__)

PR_SET_NAME = 15
NAME_BYTES = 15
"""The kernel keeps 16 bytes of a thread's name, the last one its terminating zero."""


@functools.cache
def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def kernel_name(name: str) -> bytes:
    """``name`` as the kernel keeps it: UTF-8, at most :data:`NAME_BYTES` bytes."""
    return name.encode("utf-8", "replace")[:NAME_BYTES]


def name_this_thread(name: str | None = None) -> bool:
    """Give the calling thread's kernel name ``name`` (its Python name by default); False
    where the platform has no such call. Never raises (it runs as pools' initializers)."""
    prctl = _prctl()
    if prctl is None:
        return False
    raw = kernel_name(name or threading.current_thread().name)
    if prctl(PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) != 0:
        log.debug("kvtier: could not name a thread %r (errno %d)", raw, ctypes.get_errno())
        return False
    return True


def thread_started() -> None:
    """A kvtier background thread's first call (a pool's ``initializer``, or the first line
    of a thread's target): its kernel name, then its cores."""
    name_this_thread()
    spread_this_thread()
