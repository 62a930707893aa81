"""Triton paged prefill/extend attention over packed variable-length query chunks.

Program ``(m, h, b)`` takes ``BLOCK_M`` new query tokens of sequence ``b`` for query head
``h`` and streams that sequence's K/V (cached prefix and the new tokens, all already in the
pool) through the block table, ``BLOCK_N`` positions per ``tl.dot``, with a causal mask and
an fp32 online softmax. Key tiles past the last query's position are never loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtier.gpu_pool.kernels.triton_common import LOG2E, NEG_INIT, dot_options, mma

BLOCK_M = 64
BLOCK_N = 64
BLOCK_N_FP32 = 32
"""fp32 tiles are twice the bytes; a narrower key tile keeps shared memory under 100 KB."""


@triton.jit
def prefill_kernel(
    q_ptr, kv_ptr, bt_ptr, lens_ptr, cu_ptr, out_ptr,
    scale_log2e,
    s_q_t, s_q_h,
    s_kv_block, s_kv_kv, s_kv_tok, s_kv_head,
    s_bt_b,
    s_o_t, s_o_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    q_start = tl.load(cu_ptr + b).to(tl.int32)
    q_len = tl.load(cu_ptr + b + 1).to(tl.int32) - q_start
    if pid_m * BLOCK_M >= q_len:
        return
    length = tl.load(lens_ptr + b).to(tl.int32)
    prefix = length - q_len
    kvh = h // GROUP

    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    m_mask = m < q_len
    d_mask = d < HEAD_DIM
    rows = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * s_q_t + h * s_q_h + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix + m

    m_i = tl.full([BLOCK_M], NEG_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = bt_ptr + b * s_bt_b
    head_off = kvh * s_kv_head
    end = tl.minimum(length, prefix + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, end, BLOCK_N):
        pos = start_n + n
        n_mask = pos < end
        page = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        tok = page * s_kv_block + (pos % BLOCK_SIZE) * s_kv_tok + head_off
        k_t = tl.load(kv_ptr + tok[None, :] + d[:, None],
                      mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        v = tl.load(kv_ptr + s_kv_kv + tok[:, None] + d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        s = mma(q, k_t, DOT_PRECISION, DOT_UPCAST) * scale_log2e
        causal = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * s_o_t + h * s_o_h + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    max_seqlen_q: int,
) -> torch.Tensor:
    total, num_heads, head_dim = q.shape
    batch = block_tables.shape[0]
    if total == 0 or batch == 0 or max_seqlen_q == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    wide = q.dtype == torch.float32 and head_dim > 64
    grid = (triton.cdiv(max_seqlen_q, BLOCK_M), num_heads, batch)
    prefill_kernel[grid](
        q, kv_layer, block_tables, context_lens.contiguous(), cu_seqlens_q.contiguous(), out,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // kv_layer.shape[3], HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=kv_layer.shape[2], BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N_FP32 if wide else BLOCK_N,
        **dot_options(q.dtype),
        num_warps=4 if head_dim <= 64 else 8, num_stages=2,
    )
    return out
