"""Triton copies of whole blocks between caches of one tensor per layer (vLLM's) and a chunk.

vLLM keeps each layer's KV cache in its own tensor; a chunk holds ``[layers, 2, blocks,
half]`` (per layer the K halves of its blocks, then their V halves). Copying layer by layer
costs a few launches and their Python per layer (about 1 ms a chunk of a 32-layer model on
an H200, more than the chunk's PCIe copy); here the layers' addresses sit in a table and one
launch moves every half-block of every layer. Blocks move as integers of the cache's element
size, never reinterpreted. Grid: ``(layers * 2 * blocks moved, tiles of a half-block)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096


@triton.jit
def layer_blocks_kernel(
    table_ptr, chunk_ptr, ids_ptr, rows_ptr, moved, chunk_blocks, block_stride, v_offset, half,
    TILE: tl.constexpr, TO_CACHE: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64)
    jj = p % moved
    lk = p // moved
    layer = lk // 2
    kv = lk % 2
    base = tl.load(table_ptr + layer).to(tl.pointer_type(chunk_ptr.dtype.element_ty))
    block = tl.load(ids_ptr + jj).to(tl.int64)
    row = tl.load(rows_ptr + jj).to(tl.int64)
    offs = t * TILE + tl.arange(0, TILE)
    mask = offs < half
    cache = base + block * block_stride + kv * v_offset + offs
    chunk = chunk_ptr + (lk * chunk_blocks + row) * half + offs
    if TO_CACHE:
        tl.store(cache, tl.load(chunk, mask=mask), mask=mask)
    else:
        tl.store(chunk, tl.load(cache, mask=mask), mask=mask)


def copy_layer_blocks(table: torch.Tensor, chunk: torch.Tensor, ids: torch.Tensor,
                      rows: torch.Tensor, block_stride: int, v_offset: int, to_cache: bool) -> None:
    """Between block ``ids[i]`` of every layer (``table``: each layer's address, int64 on
    the device; a block's K half at ``block * block_stride``, its V half ``v_offset`` further,
    in elements) and block ``rows[i]`` of ``chunk`` (contiguous ``[layers, 2, blocks, half]``
    of integers of the caches' element size): into the caches where ``to_cache``, else out."""
    layers, _, chunk_blocks, half = chunk.shape
    moved = ids.numel()
    if moved == 0 or layers == 0:
        return
    grid = (layers * 2 * moved, triton.cdiv(half, TILE))
    layer_blocks_kernel[grid](table, chunk, ids, rows, moved, chunk_blocks, block_stride,
                              v_offset, half, TILE=TILE, TO_CACHE=to_cache, num_warps=4)
