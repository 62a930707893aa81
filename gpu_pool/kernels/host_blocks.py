"""Block gather/scatter on host memory with plain ``numpy`` copies, for worker threads.

The torch reference (:mod:`.reference`) runs each copy on a team of intra-op threads;
called from two worker threads at once (two chunks encoded or restored side by side, see
:mod:`kvtier.connectors.tiers.chunk_workers`) the teams oversubscribe the cores and spin
against each other, and the engine's own forward is slowed long after. A numpy copy runs
on its calling thread and releases the GIL, so two workers fill two cores and nothing
else. Same layouts and results as the reference, bit for bit (bytes are copied as
same-sized integers: numpy has no bfloat16).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a host tensor's bytes, elements as integers of their size."""
    if t.device.type != "cpu":
        raise ValueError("host block copies need CPU tensors")
    return t.view(_INT[t.element_size()]).numpy()


def gather_blocks_host(kv: torch.Tensor, block_ids: Sequence[int], num_tokens: int,
                       out: torch.Tensor) -> torch.Tensor:
    """The first ``num_tokens`` tokens of ``block_ids`` from ``kv`` (``[layers, blocks, 2,
    block_size, H, D]``, any layer range of the pool) into ``out`` (``[layers, 2, >=
    num_tokens, H, D]``), one copy per block."""
    if out.dtype != kv.dtype:
        raise ValueError(f"gather into {out.dtype} from a {kv.dtype} pool")
    src, dst = _np(kv), _np(out)
    bs = kv.shape[3]
    full, rest = divmod(num_tokens, bs)
    for j, block in enumerate(block_ids[:full]):
        np.copyto(dst[:, :, j * bs : (j + 1) * bs], src[:, block])
    if rest:
        np.copyto(dst[:, :, full * bs : num_tokens], src[:, block_ids[full], :, :rest])
    return out


def scatter_blocks_host(buffer: torch.Tensor, kv: torch.Tensor, block_ids: Sequence[int],
                        num_tokens: int) -> None:
    """Inverse of :func:`gather_blocks_host`: the first ``num_tokens`` tokens of
    ``buffer`` into ``block_ids`` of ``kv`` (slots past them in a tail block are kept)."""
    if buffer.dtype != kv.dtype:
        raise ValueError(f"scatter of {buffer.dtype} into a {kv.dtype} pool")
    src, dst = _np(buffer), _np(kv)
    bs = kv.shape[3]
    full, rest = divmod(num_tokens, bs)
    for j, block in enumerate(block_ids[:full]):
        np.copyto(dst[:, block], src[:, :, j * bs : (j + 1) * bs])
    if rest:
        np.copyto(dst[:, block_ids[full], :, :rest], src[:, :, full * bs : num_tokens])


def copy_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for host tensors of one dtype and shape, on the calling thread."""
    if dst.dtype != src.dtype or dst.shape != src.shape:
        raise ValueError(f"copy of {src.dtype}{tuple(src.shape)} into {dst.dtype}{tuple(dst.shape)}")
    np.copyto(_np(dst), _np(src))
