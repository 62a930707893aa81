"""Pieces shared by the Triton attention kernels: constants and the one matmul helper."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Finite start for the running max, so a fully masked tile never computes exp2(-inf - -inf).
NEG_INIT: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def mma(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot`` with an fp32 accumulator.

    ``UPCAST`` feeds the operands as fp32: the Triton interpreter multiplies bfloat16 as raw
    uint16 bits (3.9), so under ``TRITON_INTERPRET=1`` bf16 tiles are widened first. The
    widening is exact, so results match the GPU's bf16 x bf16 -> fp32 dot.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


INTERPRETED: bool = type(mma).__name__ == "InterpretedFunction"
"""Decorated under ``TRITON_INTERPRET=1`` (the variable counts only at decoration time)."""


def dot_options(dtype: torch.dtype) -> dict[str, object]:
    """Constexprs of :func:`mma` for KV of ``dtype``: exact fp32 (no TF32) and the bf16 fix."""
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "DOT_UPCAST": INTERPRETED and dtype == torch.bfloat16,
    }
