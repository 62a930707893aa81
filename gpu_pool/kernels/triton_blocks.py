"""Triton block gather/scatter between the pool and a chunk-layout buffer.

A block's K (or V) in one layer, ``[block_size, kv_heads, head_dim]``, is one dense run in the
pool and one dense run in the chunk ``[layers, 2, tokens, kv_heads, head_dim]``, so both
directions are flat copies. One launch covers every block, layer and K/V: the grid is
``(block, layer * 2 + kv, tile)``. The tail block copies only the tokens that exist.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 2048


@triton.jit
def blocks_copy_kernel(
    kv_ptr, buf_ptr, ids_ptr, num_tokens,
    s_kv_layer, s_kv_block, s_kv_kv,
    s_buf_layer, s_buf_kv,
    TOKEN_ELEMS,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, TO_POOL: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    lk = tl.program_id(1)
    t = tl.program_id(2)
    layer = (lk // 2).to(tl.int64)
    kv = lk % 2
    block = tl.load(ids_ptr + i).to(tl.int64)
    tokens = tl.minimum(num_tokens - i * BLOCK_SIZE, BLOCK_SIZE)
    offs = t * TILE + tl.arange(0, TILE)
    mask = offs < tokens * TOKEN_ELEMS
    pool = kv_ptr + layer * s_kv_layer + block * s_kv_block + kv * s_kv_kv + offs
    chunk = buf_ptr + layer * s_buf_layer + kv * s_buf_kv + i * BLOCK_SIZE * TOKEN_ELEMS + offs
    if TO_POOL:
        tl.store(pool, tl.load(chunk, mask=mask), mask=mask)
    else:
        tl.store(chunk, tl.load(pool, mask=mask), mask=mask)


def copy_blocks(
    kv: torch.Tensor, buffer: torch.Tensor, block_ids: torch.Tensor, num_tokens: int,
    to_pool: bool,
) -> None:
    """Gather (``to_pool=False``) or scatter the first ``num_tokens`` tokens of ``block_ids``."""
    layers, _, _, block_size, kv_heads, head_dim = kv.shape
    n_blocks = -(-num_tokens // block_size)
    if n_blocks == 0 or layers == 0:
        return
    token_elems = kv_heads * head_dim
    grid = (n_blocks, layers * 2, triton.cdiv(block_size * token_elems, TILE))
    blocks_copy_kernel[grid](
        kv, buffer, block_ids.contiguous(), num_tokens,
        kv.stride(0), kv.stride(1), kv.stride(2),
        buffer.stride(0), buffer.stride(1),
        token_elems,
        BLOCK_SIZE=block_size, TILE=TILE, TO_POOL=to_pool,
        num_warps=4,
    )
