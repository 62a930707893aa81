"""Which implementation runs a kernel call: Triton on CUDA, the torch reference on CPU.

Kept apart from the kernels so the choice (and the debug flag) is made in one place and the
Triton modules are imported only when a Triton launch is actually wanted.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Literal

import torch

from kvtier.errors import KernelInputError

Backend = Literal["auto", "triton", "torch"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")
DEBUG_ENV = "KVTIER_DEBUG_KERNELS"


def debug_enabled(debug: bool | None) -> bool:
    """``debug`` wins when given; otherwise ``KVTIER_DEBUG_KERNELS=1`` turns the bounds scan on."""
    if debug is not None:
        return bool(debug)
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def triton_interpreted() -> bool:
    """True when the Triton kernels were decorated under ``TRITON_INTERPRET=1``.

    Asked of the decorated kernel itself, because the variable only counts at decoration time.
    """
    from kvtier.gpu_pool.kernels.triton_common import INTERPRETED

    return INTERPRETED


def resolve_backend(backend: str, device: torch.device) -> Literal["triton", "torch"]:
    """Turn ``auto`` into a concrete backend and refuse Triton where it cannot run."""
    if backend not in BACKENDS:
        raise KernelInputError(f"backend={backend!r} is not one of {BACKENDS}; pick one of them")
    if backend == "torch":
        return "torch"
    if device.type == "cuda":
        return "triton"
    if backend == "auto":
        return "torch"
    if not triton_interpreted():
        raise KernelInputError(
            f"backend='triton' needs CUDA tensors (got {device.type}); on CPU use backend='torch' "
            "or 'auto', or set TRITON_INTERPRET=1 before kvtier.gpu_pool.kernels is first used "
            "to run the Triton interpreter (tests only, slow)"
        )
    return "triton"


@contextlib.contextmanager
def device_guard(device: torch.device) -> Iterator[None]:
    """Launch on the tensors' GPU even when another one is current."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; a nominal 8 off-GPU (interpreter, heuristics)."""
    if device.type != "cuda":
        return 8
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)
