"""One Triton launch that copies many pieces between device addresses.

A window of chunks moving between a staging buffer and a cache's blocks is thousands of
half-blocks (every layer's K and V half of every block of every chunk); a copy per piece
pays a launch and its Python each time, several times the bytes' own cost on a GPU. Here
each piece is a row of three tables (source address, destination address, length in
words) and one launch moves them all: what ``cuMemcpyBatchAsync`` offers without a torch
binding, as a kernel. Pieces move as words of the widest size every address and length
allows, never reinterpreted. Grid: ``(pieces, tiles of the longest piece)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 2048
WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@triton.jit
def pieces_kernel(srcs_ptr, dsts_ptr, lens_ptr, word_ptr, TILE: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64)
    n = tl.load(lens_ptr + p)
    offs = t * TILE + tl.arange(0, TILE)
    mask = offs < n
    if t * TILE < n:
        src = tl.load(srcs_ptr + p).to(tl.pointer_type(word_ptr.dtype.element_ty))
        dst = tl.load(dsts_ptr + p).to(tl.pointer_type(word_ptr.dtype.element_ty))
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def copy_pieces(srcs: torch.Tensor, dsts: torch.Tensor, lens: torch.Tensor, word: int,
                longest: int) -> None:
    """Copy ``lens[i]`` words of ``word`` bytes from address ``srcs[i]`` to ``dsts[i]``
    for every ``i`` (int64 tables on the device; ``longest``: the largest of ``lens``).
    The caller keeps every address inside live memory and aligned to ``word``."""
    n = srcs.numel()
    if n == 0 or longest <= 0:
        return
    probe = torch.empty(0, dtype=WORDS[word], device=srcs.device)
    grid = (n, triton.cdiv(longest, TILE))
    pieces_kernel[grid](srcs, dsts, lens, probe, TILE=TILE, num_warps=4)
