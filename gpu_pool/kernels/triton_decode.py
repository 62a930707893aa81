"""Triton paged decode attention, single-pass and split-KV (flash-decoding).

One program handles one (sequence, KV head) and all ``G`` query heads that share it, so each
K/V byte is read once per step: the group is padded to 16 rows for ``tl.dot`` (this kernel
is bound by memory, the padded FLOPs are free). Tokens are visited in tiles of ``BLOCK_N``
positions, each resolved through the block table, with an fp32 online softmax in base 2.
With splits, program ``(b, h, s)`` covers one slice of the context and writes an unnormalised
partial result plus its running max and sum; a second kernel merges the slices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtier.gpu_pool.kernels.triton_common import LOG2E, NEG_INIT, attend_tile, dot_options

TILE_BYTES = 16384
"""K plus V bytes per loop step: large enough to keep loads in flight, small enough that
ptxas keeps the tile in registers without spills (checked offline for sm_80/sm_90)."""


@triton.jit
def decode_kernel(
    q_ptr, kv_ptr, bt_ptr, lens_ptr, out_ptr, m_ptr, l_ptr,
    scale_log2e, num_splits,
    s_q_b, s_q_h,
    s_kv_block, s_kv_kv, s_kv_tok, s_kv_head,
    s_bt_b,
    s_o_b, s_o_h, s_o_s,
    s_ml_b, s_ml_h,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + b).to(tl.int32)
    if SPLIT:
        per = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
        start = split * per
        end = tl.minimum(start + per, length)
    else:
        start = 0
        end = length

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    head = kvh * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + b * s_q_b + head[:, None] * s_q_h + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], NEG_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = bt_ptr + b * s_bt_b
    head_off = kvh * s_kv_head
    for start_n in range(start, end, BLOCK_N):  # no causal mask: g stands in for q_pos
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, g, kv_ptr, table, start_n, end, head_off,
            s_kv_block, s_kv_kv, s_kv_tok, scale_log2e, d, d_mask,
            BLOCK_N, BLOCK_SIZE, False, DOT_PRECISION, DOT_UPCAST,
        )

    o_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        o_ptr = out_ptr + b * s_o_b + head[:, None] * s_o_h + split * s_o_s + d[None, :]
        tl.store(o_ptr, acc, mask=o_mask)
        ml = b * s_ml_b + head * s_ml_h + split
        tl.store(m_ptr + ml, m_i, mask=g_mask)
        tl.store(l_ptr + ml, l_i, mask=g_mask)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        o_ptr = out_ptr + b * s_o_b + head[:, None] * s_o_h + d[None, :]
        tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def reduce_kernel(
    part_ptr, m_ptr, l_ptr, out_ptr, num_splits,
    s_p_b, s_p_h, s_p_s,
    s_ml_b, s_ml_h,
    s_o_b, s_o_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    ml = b * s_ml_b + h * s_ml_h + s
    m = tl.load(m_ptr + ml, mask=s_mask, other=NEG_INIT)
    l_s = tl.load(l_ptr + ml, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)
    total = tl.sum(w * l_s, 0)
    part = tl.load(part_ptr + b * s_p_b + h * s_p_h + s[:, None] * s_p_s + d[None, :],
                   mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    o = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * s_o_b + h * s_o_h + d, o.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def launch_config(dtype: torch.dtype, head_dim: int, group: int, block_size: int
                  ) -> dict[str, object]:
    """Constexprs and launch options of :func:`decode_kernel` (shared with ``aot.py``)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    elem = torch.empty((), dtype=dtype).element_size()
    return {
        "GROUP": group, "BLOCK_G": max(16, triton.next_power_of_2(group)),
        "HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_SIZE": block_size,
        "BLOCK_N": min(64, max(16, TILE_BYTES // (2 * block_d * elem))),
        **dot_options(dtype), "num_warps": 8, "num_stages": 2,
    }


def paged_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int,
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    kv_heads = kv_layer.shape[3]
    if batch == 0:
        return out
    group = num_heads // kv_heads
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    context_lens = context_lens.contiguous()
    common = launch_config(q.dtype, head_dim, group, kv_layer.shape[2])
    block_d = common["BLOCK_D"]
    kv_strides = (kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3))
    if num_splits <= 1:
        decode_kernel[(batch, kv_heads, 1)](
            q, kv_layer, block_tables, context_lens, out, out, out,
            scale * LOG2E, 1,
            q.stride(0), q.stride(1), *kv_strides, block_tables.stride(0),
            out.stride(0), out.stride(1), 0, 0, 0,
            SPLIT=False, **common,
        )
        return out
    part = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32,
                       device=q.device)
    m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    denom = torch.empty_like(m)
    decode_kernel[(batch, kv_heads, num_splits)](
        q, kv_layer, block_tables, context_lens, part, m, denom,
        scale * LOG2E, num_splits,
        q.stride(0), q.stride(1), *kv_strides, block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), m.stride(0), m.stride(1),
        SPLIT=True, **common,
    )
    reduce_kernel[(batch, num_heads)](
        part, m, denom, out, num_splits,
        part.stride(0), part.stride(1), part.stride(2), m.stride(0), m.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
        num_warps=4,
    )
    return out
