"""The CUDA suite (``pytest -m cuda``): kvtier's device paths checked on a real GPU.

Every test here takes the ``device`` fixture: CUDA when a GPU is present. Without one the
suite is skipped (with the reason), except under ``KVTIER_CUDA_TESTS_ON_CPU=1``, which the
GPU kit's dry run (``scripts/gpu_check.sh --dry-run``, run by CI) sets so that the same test
code runs on the CPU at small sizes and cannot rot between GPU sessions. ``Sizes`` scales
each test: realistic shapes on a GPU, a few blocks under the Triton interpreter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

CPU_ENV = "KVTIER_CUDA_TESTS_ON_CPU"
SKIP_REASON = (
    "needs a CUDA GPU: run `bash scripts/gpu_check.sh` on one (docs/gpu.md); "
    "`scripts/gpu_check.sh --dry-run` runs this suite on the CPU"
)


@dataclass(frozen=True)
class Sizes:
    """Shapes for one device: realistic on a GPU, small under the Triton interpreter."""

    num_heads: int
    kv_heads: int
    head_dim: int
    long_context: int
    tokens: int
    """Tokens of history in the pool/tier tests (a few chunks plus a tail)."""
    chunk_tokens: int


GPU_SIZES = Sizes(num_heads=32, kv_heads=8, head_dim=128, long_context=8192, tokens=1000,
                  chunk_tokens=256)
CPU_SIZES = Sizes(num_heads=4, kv_heads=2, head_dim=32, long_context=300, tokens=200,
                  chunk_tokens=64)


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(scope="session")
def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get(CPU_ENV) == "1":
        return torch.device("cpu")
    pytest.skip(SKIP_REASON)


@pytest.fixture(scope="session")
def sizes(device: torch.device) -> Sizes:
    return GPU_SIZES if device.type == "cuda" else CPU_SIZES


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
