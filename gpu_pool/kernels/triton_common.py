"""Pieces shared by the Triton attention kernels: constants, the matmul helper and the
online-softmax step over one tile of paged keys."""

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


@triton.jit
def attend_tile(
    acc, m_i, l_i, q, q_pos,
    kv_ptr, table, start_n, end, head_off,
    s_kv_block, s_kv_kv, s_kv_tok, scale_log2e,
    d, d_mask,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """One tile of ``BLOCK_N`` key positions from ``start_n``: resolve each position's block
    through ``table``, load K (transposed) and V, and fold them into the online softmax
    (base 2, fp32). Positions ``>= end`` are masked; with ``CAUSAL``, so is every key past a
    row's ``q_pos``. Returns the updated ``(acc, m_i, l_i)``."""
    pos = start_n + tl.arange(0, BLOCK_N)
    n_mask = pos < end
    page = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    tok = page * s_kv_block + (pos % BLOCK_SIZE) * s_kv_tok + head_off
    k_t = tl.load(kv_ptr + tok[None, :] + d[:, None],
                  mask=n_mask[None, :] & d_mask[:, None], other=0.0)
    v = tl.load(kv_ptr + s_kv_kv + tok[:, None] + d[None, :],
                mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    s = mma(q, k_t, DOT_PRECISION, DOT_UPCAST) * scale_log2e
    if CAUSAL:
        s = tl.where((pos[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
    else:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
    return acc, m_new, l_i


INTERPRETED: bool = type(mma).__name__ == "InterpretedFunction"
"""Decorated under ``TRITON_INTERPRET=1`` (the variable counts only at decoration time)."""


def dot_options(dtype: torch.dtype) -> dict[str, object]:
    """Constexprs of :func:`mma` for KV of ``dtype``: exact fp32 (no TF32) and the bf16 fix."""
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "DOT_UPCAST": INTERPRETED and dtype == torch.bfloat16,
    }
