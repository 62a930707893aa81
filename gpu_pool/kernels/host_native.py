"""Host block copies fused with their per-layer xxh3 checksums, in native code.

A store that gathers a chunk from the pool and then checksums it, or a restore that
checks a chunk and then scatters it, crosses memory two or three times in numpy (the
copy's stores read each destination line first, the hash reads the bytes again). The
kernels in ``native/host_copy.c`` hash each piece while it is in L1 from being loaded and
write with streaming stores: about the memory traffic of a plain copy (docs/performance.md
has the figures). They release the GIL, so two worker threads fill two cores.

The kernels trust the addresses they are given: these wrappers take tables of addresses,
which the block path (:mod:`kvtier.transfer.block_path`, the only caller) computes from
tensors it checked (layouts, block ids in range, lengths). Where the extension was not
built (no C compiler at install time), :data:`AVAILABLE` is False and the block path
copies in Python with a separate checksum pass: same bytes, same checksums, slower.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    from kvtier.gpu_pool.kernels import _host_copy as _native
except ImportError:  # built optionally (see setup.py); the numpy path serves instead
    _native = None

AVAILABLE = _native is not None
"""True where the fused kernels were built."""


try:
    from kvtier import _kv_codec as _codec_native
except ImportError:  # built optionally (see setup.py)
    _codec_native = None

CODEC_AVAILABLE = _codec_native is not None
"""True where the fused check + decode + scatter of compressed chunks was built."""


def verify_scatter(segs: np.ndarray, layer_bytes: int, expected: np.ndarray, srcs: np.ndarray,
                   dsts: np.ndarray, lens: np.ndarray, per: int) -> int:
    """For each segment (``layer_bytes`` at ``segs[s]``) in order: compare its xxh3 with
    ``expected[s]``, then copy its ``per`` pieces (``srcs``, ``dsts``, ``lens`` from
    ``s * per``). Returns the first segment that failed (nothing of it or after it was
    copied) or -1. Every array is contiguous uint64; every address must lie inside live
    memory (the caller's checks)."""
    n = len(segs)
    if len(expected) != n or len(srcs) != n * per or len(dsts) != n * per or len(lens) != n * per:
        raise ValueError(f"{n} segments of {per} pieces: tables of the wrong length")
    if n == 0:
        return -1
    return int(_native.verify_scatter(segs.ctypes.data, layer_bytes, n, expected.ctypes.data,
                                      srcs.ctypes.data, dsts.ctypes.data, lens.ctypes.data, per))


def gather_hash(out_address: int, srcs: np.ndarray, lens: np.ndarray, per: int) -> np.ndarray:
    """Copy the pieces (``srcs``, ``lens``: contiguous uint64) one after another to
    ``out_address``; the xxh3 of each run of ``per`` pieces (uint64)."""
    if per < 1 or len(srcs) % per or len(lens) != len(srcs):
        raise ValueError(f"{len(srcs)} pieces are not runs of {per}")
    sums = np.zeros(len(srcs) // per, dtype=np.uint64)
    if len(srcs):
        _native.gather_hash(out_address, srcs.ctypes.data, lens.ctypes.data, len(srcs), per,
                            sums.ctypes.data)
    return sums


def verify_decode_pieces(codec_id: int, dtype: torch.dtype, payload_address: int, layers: int,
                         step: int, exponents_at: tuple[int, int], shape: tuple[int, int, int],
                         expected: np.ndarray, pieces: np.ndarray) -> tuple[int, int]:
    """For each of ``layers`` encoded layers of ``step`` bytes at ``payload_address``: check
    its xxh3 against ``expected``, then decode its pieces (``pieces``: ``[layers, per, 4]``
    uint64 rows of K/V half, first token, end token, destination address) into place.
    ``shape``: the chunk's tokens, heads and head_dim. Returns (the first layer that
    failed, -1 for its checksum or a decode status) or (-1, 0)."""
    assert _codec_native is not None
    if pieces.dtype != np.uint64 or pieces.ndim != 3 or pieces.shape[0] != layers or pieces.shape[2] != 4:
        raise ValueError("pieces must be [layers, per, 4] uint64")
    if len(expected) != layers:
        raise ValueError(f"{layers} layers, {len(expected)} checksums")
    if layers == 0 or pieces.shape[1] == 0:
        return -1, 0
    dtype_id = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[dtype]
    tokens, heads, dim = shape
    pieces = np.ascontiguousarray(pieces)
    layer, status = _codec_native.verify_decode_scatter(
        codec_id, dtype_id, payload_address, layers, step, exponents_at[0], exponents_at[1],
        tokens, heads, dim, expected.ctypes.data, pieces.ctypes.data, pieces.shape[1])
    return int(layer), int(status)
