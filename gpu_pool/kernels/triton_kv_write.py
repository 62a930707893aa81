"""Triton KV write (reshape-and-cache): new tokens' K and V into their pool slots.

One program per token copies its ``[kv_heads, head_dim]`` K and V tiles; a negative slot
(-1, padding) returns before touching memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def kv_write_kernel(
    key_ptr, value_ptr, kv_ptr, slot_ptr,
    s_k_tok, s_k_head, s_v_tok, s_v_head,
    s_kv_block, s_kv_kv, s_kv_tok, s_kv_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    src_k = key_ptr + tok * s_k_tok + h[:, None] * s_k_head + d[None, :]
    src_v = value_ptr + tok * s_v_tok + h[:, None] * s_v_head + d[None, :]
    dst = kv_ptr + blk * s_kv_block + off * s_kv_tok + h[:, None] * s_kv_head + d[None, :]
    tl.store(dst, tl.load(src_k, mask=mask), mask=mask)
    tl.store(dst + s_kv_kv, tl.load(src_v, mask=mask), mask=mask)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    slot_mapping = slot_mapping.contiguous()
    kv_write_kernel[(num_tokens,)](
        key, value, kv_layer, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_layer.shape[2],
        num_warps=4,
    )
