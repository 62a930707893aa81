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

from kvtier.gpu_pool.kernels.triton_common import LOG2E, NEG_INIT, attend_tile, dot_options


def tile_config(dtype: torch.dtype, head_dim: int) -> dict[str, int]:
    """Tile sizes and warps, picked so ptxas reports no register spills on sm_80/sm_90
    (checked offline by compiling for those targets; not yet timed on a GPU)."""
    if dtype == torch.float32:
        return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 8}
    return {"BLOCK_M": 64, "BLOCK_N": 64 if head_dim <= 64 else 32, "num_warps": 8}


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
    # Keys before the block's first query position are visible to every row: no causal mask.
    # Then the diagonal tiles, up to the block's last query position.
    full = (prefix + pid_m * BLOCK_M) // BLOCK_N * BLOCK_N
    end = tl.minimum(length, prefix + (pid_m + 1) * BLOCK_M)
    for start_n in range(0, full, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, kv_ptr, table, start_n, end, head_off,
            s_kv_block, s_kv_kv, s_kv_tok, scale_log2e, d, d_mask,
            BLOCK_N, BLOCK_SIZE, False, DOT_PRECISION, DOT_UPCAST,
        )
    for start_n in range(full, end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, kv_ptr, table, start_n, end, head_off,
            s_kv_block, s_kv_kv, s_kv_tok, scale_log2e, d, d_mask,
            BLOCK_N, BLOCK_SIZE, True, DOT_PRECISION, DOT_UPCAST,
        )

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
    cfg = tile_config(q.dtype, head_dim)
    grid = (triton.cdiv(max_seqlen_q, cfg["BLOCK_M"]), num_heads, batch)
    prefill_kernel[grid](
        q, kv_layer, block_tables, context_lens.contiguous(), cu_seqlens_q.contiguous(), out,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // kv_layer.shape[3], HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=kv_layer.shape[2], **cfg, **dot_options(q.dtype), num_stages=2,
    )
    return out
