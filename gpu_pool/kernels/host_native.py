"""Host block copies fused with their per-layer xxh3 checksums, in native code.

A store that gathers a chunk from the pool and then checksums it, or a restore that
checks a chunk and then scatters it, crosses memory two or three times in numpy (the
copy's stores read each destination line first, the hash reads the bytes again). The
kernels in ``native/host_copy.c`` hash each piece while it is in L1 from being loaded and
write with streaming stores: about the memory traffic of a plain copy (docs/performance.md
has the figures). They release the GIL, so two worker threads fill two cores.

The kernel trusts the addresses it is given; every check that keeps them inside their
tensors (device, dtype, layout, shapes, block ids in range) is made here, before the call.
Where the extension was not built (no C compiler at install time), :data:`AVAILABLE` is
False and callers use :mod:`.host_blocks` with a separate checksum pass: same bytes, same
checksums, slower.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

try:
    from kvtier.gpu_pool.kernels import _host_copy as _native
except ImportError:  # built optionally (see setup.py); the numpy path serves instead
    _native = None

AVAILABLE = _native is not None
"""True where the fused kernels were built."""


def _check_host(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError("host block copies need CPU tensors")
    if len({t.dtype for t in tensors}) != 1:
        raise ValueError(f"mixed dtypes {sorted(str(t.dtype) for t in tensors)}")


def _pool_pieces(kv: torch.Tensor, block_ids: Sequence[int], num_tokens: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Addresses and lengths of the pool pieces holding ``num_tokens`` tokens of
    ``block_ids`` in every layer of ``kv`` (``[layers, blocks, 2, block_size, H, D]``), in
    chunk order: layer, then K/V, then block. Raises ValueError where a piece would fall
    outside ``kv``."""
    layers, blocks, two, bs, heads, dim = kv.shape
    if two != 2 or kv.stride(5) != 1 or kv.stride(4) != dim or kv.stride(3) != heads * dim:
        raise ValueError(f"pool layout {tuple(kv.shape)} / {kv.stride()} is not block-contiguous")
    ids = np.asarray(block_ids, dtype=np.int64)
    if len(ids) != -(-num_tokens // bs) or num_tokens < 0:
        raise ValueError(f"{num_tokens} tokens need {-(-num_tokens // bs)} blocks, got {len(ids)}")
    if len(ids) and (ids.min() < 0 or ids.max() >= blocks):
        raise ValueError(f"block id out of range [0, {blocks})")
    size = kv.element_size()
    s0, s1, s2 = (kv.stride(i) * size for i in range(3))
    addr = (kv.data_ptr()
            + np.arange(layers, dtype=np.int64)[:, None, None] * s0
            + np.arange(2, dtype=np.int64)[None, :, None] * s2
            + ids[None, None, :] * s1)
    lens = np.full((layers, 2, len(ids)), bs * heads * dim * size, dtype=np.uint64)
    if len(ids) and num_tokens % bs:
        lens[:, :, -1] = (num_tokens % bs) * heads * dim * size
    return addr.astype(np.uint64).reshape(-1), lens.reshape(-1)


def gather_blocks_hashed(kv: torch.Tensor, block_ids: Sequence[int], num_tokens: int,
                         out: torch.Tensor) -> tuple[int, ...]:
    """:func:`~.host_blocks.gather_blocks_host` into a contiguous ``out`` (``[layers, 2,
    num_tokens, H, D]``), returning the xxh3 of each of its layers' bytes."""
    _check_host(kv, out)
    layers = kv.shape[0]
    want = (layers, 2, num_tokens, kv.shape[4], kv.shape[5])
    if tuple(out.shape) != want or not out.is_contiguous():
        raise ValueError(f"gather into a contiguous {want}, got {tuple(out.shape)}")
    if num_tokens < 1:
        raise ValueError("a chunk holds at least one token")
    srcs, lens = _pool_pieces(kv, block_ids, num_tokens)
    sums = np.zeros(layers, dtype=np.uint64)
    if layers:
        _native.gather_hash(out.data_ptr(), srcs.ctypes.data, lens.ctypes.data, len(srcs),
                            len(srcs) // layers, sums.ctypes.data)
    return tuple(int(s) for s in sums)


def scatter_blocks_verified(payload: torch.Tensor, expected: Sequence[int], offset: int,
                            kv: torch.Tensor, block_ids: Sequence[int]) -> int:
    """Check each layer of ``payload`` (a chunk's contiguous ``[layers, 2, T, H, D]``)
    against ``expected`` (its xxh3 per layer), then scatter its tokens from ``offset`` on
    into ``block_ids`` of ``kv`` (as :func:`~.host_blocks.scatter_blocks_host`). Returns the
    first layer that failed its check (nothing of it or after it was copied) or -1."""
    _check_host(payload, kv)
    layers, two, tokens, heads, dim = payload.shape
    if (two != 2 or not payload.is_contiguous() or kv.shape[0] != layers
            or (kv.shape[4], kv.shape[5]) != (heads, dim)):
        raise ValueError(f"scatter of {tuple(payload.shape)} into a pool of {tuple(kv.shape)}")
    if len(expected) != layers:
        raise ValueError(f"{layers} layers, {len(expected)} checksums")
    if not 0 <= offset <= tokens:
        raise ValueError(f"offset {offset} outside a chunk of {tokens} tokens")
    size = payload.element_size()
    layer_bytes = 2 * tokens * heads * dim * size
    num_tokens = tokens - offset
    dsts, lens = _pool_pieces(kv, block_ids, num_tokens)
    bs = kv.shape[3]
    tok = heads * dim * size
    srcs = (payload.data_ptr()
            + np.arange(layers, dtype=np.int64)[:, None, None] * layer_bytes
            + np.arange(2, dtype=np.int64)[None, :, None] * (tokens * tok)
            + (offset + np.arange(len(block_ids), dtype=np.int64) * bs)[None, None, :] * tok)
    srcs = srcs.astype(np.uint64).reshape(-1)
    segs = (payload.data_ptr() + np.arange(layers, dtype=np.int64) * layer_bytes).astype(np.uint64)
    sums = np.array([int(s) for s in expected], dtype=np.uint64)
    if not layers:
        return -1
    return int(_native.verify_scatter(segs.ctypes.data, layer_bytes, layers, sums.ctypes.data,
                                      srcs.ctypes.data, dsts.ctypes.data, lens.ctypes.data,
                                      len(srcs) // layers))
