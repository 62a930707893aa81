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


try:
    from kvtier import _kv_codec as _codec_native
except ImportError:  # built optionally (see setup.py)
    _codec_native = None

CODEC_AVAILABLE = _codec_native is not None
"""True where the fused check + decode + scatter of compressed chunks was built."""


def scatter_decoded_verified(payload: torch.Tensor, codec_id: int, expected: Sequence[int],
                             offset: int, kv: torch.Tensor, block_ids: Sequence[int],
                             tokens: int, exponents_at: tuple[int, int]) -> tuple[int, int]:
    """Check each layer of a compressed chunk's ``payload`` (uint8, its layers one after
    another, each encoded apart: see :mod:`kvtier.kv_codecs`) against ``expected``, then
    decode its tokens from ``offset`` on straight into ``block_ids`` of ``kv`` (a host pool
    ``[layers, blocks, 2, block_size, H, D]``): one pass over the stored bytes, no scratch.
    ``exponents_at``: where a layer's K and V exponents start within it. Returns (the first
    layer that failed, -1 for its checksum or a decode status) or (-1, 0)."""
    assert _codec_native is not None
    if payload.device.type != "cpu" or kv.device.type != "cpu":
        raise ValueError("host block copies need CPU tensors")
    layers, blocks, two, bs, heads, dim = kv.shape
    if two != 2 or kv.stride(5) != 1 or kv.stride(4) != dim or kv.stride(3) != heads * dim:
        raise ValueError(f"pool layout {tuple(kv.shape)} / {kv.stride()} is not block-contiguous")
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise ValueError("a compressed payload is a contiguous 1-D uint8 tensor")
    if len(expected) != layers or payload.numel() % max(layers, 1):
        raise ValueError(f"{layers} layers, {len(expected)} checksums, {payload.numel()} bytes")
    if not 0 <= offset <= tokens or offset % bs:
        raise ValueError(f"offset {offset}: not a block boundary of a {tokens}-token chunk")
    ids = np.asarray(block_ids, dtype=np.int64)
    if len(ids) != -(-(tokens - offset) // bs):
        raise ValueError(f"{tokens - offset} tokens need {-(-(tokens - offset) // bs)} blocks")
    if len(ids) and (ids.min() < 0 or ids.max() >= blocks):
        raise ValueError(f"block id out of range [0, {blocks})")
    if not layers or not len(ids):
        return -1, 0
    size = kv.element_size()
    s0, s1, s2 = (kv.stride(i) * size for i in range(3))
    t0 = offset + np.arange(len(ids), dtype=np.int64) * bs
    t1 = np.minimum(t0 + bs, tokens)
    pieces = np.empty((layers, 2, len(ids), 4), dtype=np.uint64)
    pieces[..., 0] = np.arange(2, dtype=np.uint64)[None, :, None]
    pieces[..., 1] = t0.astype(np.uint64)[None, None, :]
    pieces[..., 2] = t1.astype(np.uint64)[None, None, :]
    pieces[..., 3] = (kv.data_ptr() + np.arange(layers, dtype=np.int64)[:, None, None] * s0
                      + np.arange(2, dtype=np.int64)[None, :, None] * s2
                      + ids[None, None, :] * s1).astype(np.uint64)
    sums = np.array([int(x) for x in expected], dtype=np.uint64)
    dtype_id = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[kv.dtype]
    step = payload.numel() // layers
    layer, status = _codec_native.verify_decode_scatter(
        codec_id, dtype_id, payload.data_ptr(), layers, step, exponents_at[0], exponents_at[1],
        tokens, heads, dim, sums.ctypes.data, pieces.ctypes.data, 2 * len(ids))
    return int(layer), int(status)


class PieceLayout:
    """A chunk laid out as pieces elsewhere (vLLM's per-layer caches): ``lens`` bytes each,
    ``layers`` runs of equal size, in the chunk's byte order. Checked once; each copy then
    only adds the addresses (the caller keeps them inside live tensors)."""

    def __init__(self, lens: np.ndarray, layers: int) -> None:
        lens = np.ascontiguousarray(lens, dtype=np.uint64)
        if layers < 1 or lens.ndim != 1 or len(lens) % layers:
            raise ValueError(f"{len(lens)} pieces do not make {layers} layers")
        per_layer = lens.reshape(layers, -1).sum(axis=1)
        if len(set(per_layer.tolist())) != 1:
            raise ValueError("every layer must have the same number of bytes")
        self.lens = lens
        self.layers = layers
        self.per_layer = len(lens) // layers
        self.layer_bytes = int(per_layer[0])
        self.nbytes = int(lens.sum())
        self.starts = np.concatenate(([0], np.cumsum(lens[:-1]))).astype(np.uint64)
        """Each piece's offset in the chunk's payload."""
        self.layer_starts = (np.arange(layers, dtype=np.uint64) * np.uint64(self.layer_bytes))

    def _check(self, buf: torch.Tensor, addrs: np.ndarray, layers: int) -> None:
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("piece copies need a contiguous host buffer")
        if buf.numel() * buf.element_size() != layers * self.layer_bytes:
            raise ValueError(f"a {buf.numel() * buf.element_size()}-byte buffer is not "
                             f"{layers} layers of {self.layer_bytes} bytes")
        if addrs.dtype != np.uint64 or len(addrs) != layers * self.per_layer:
            raise ValueError("piece addresses must be uint64, as many as the layers' pieces")


def gather_pieces_hashed(out: torch.Tensor, srcs: np.ndarray, layout: PieceLayout
                         ) -> tuple[int, ...]:
    """Copy the pieces at ``srcs`` into the contiguous ``out`` (the whole chunk's payload),
    returning the xxh3 of each layer: a chunk gathered from tensors laid out otherwise,
    hashed as it is copied. The addresses must lie inside live tensors."""
    layout._check(out, srcs, layout.layers)
    sums = np.zeros(layout.layers, dtype=np.uint64)
    _native.gather_hash(out.data_ptr(), srcs.ctypes.data, layout.lens.ctypes.data, len(srcs),
                        layout.per_layer, sums.ctypes.data)
    return tuple(sums.tolist())


def scatter_pieces_verified(payload: torch.Tensor, expected: Sequence[int], dsts: np.ndarray,
                            layout: PieceLayout, first: int = 0) -> int:
    """Check each layer of ``payload`` (layers ``first``.. of a chunk, contiguous) against
    ``expected`` (its xxh3 per layer), then copy it, in order, to its pieces at ``dsts``
    (those of the same layers). Returns the first of these layers that failed its check
    (nothing of it or after it was copied) or -1. The addresses must lie inside live
    tensors."""
    layers = len(expected)
    layout._check(payload, dsts, layers)
    if not 0 <= first <= layout.layers - layers:
        raise ValueError(f"layers {first}..{first + layers} outside {layout.layers}")
    base = np.uint64(payload.data_ptr())
    n = layers * layout.per_layer
    at = first * layout.per_layer
    srcs = base + (layout.starts[at : at + n] - layout.starts[at])
    segs = base + layout.layer_starts[:layers]
    sums = np.array(expected, dtype=np.uint64)
    return int(_native.verify_scatter(segs.ctypes.data, layout.layer_bytes, layers,
                                      sums.ctypes.data, srcs.ctypes.data, dsts.ctypes.data,
                                      layout.lens[at : at + n].ctypes.data, layout.per_layer))


def scatter_chunks_verified(payloads: Sequence[torch.Tensor], expected: np.ndarray,
                            dsts: np.ndarray, layout: PieceLayout) -> list[tuple[int, int]]:
    """:func:`scatter_pieces_verified` of many whole chunks (``payloads``, each contiguous,
    ``layout.nbytes``; ``expected``: ``[chunks, layers]`` xxh3; ``dsts``: ``[chunks,
    pieces]``) in as few native calls as failures allow: a chunk whose layer fails is not
    copied from that layer on, and the chunks after it go on. Returns each failure as
    (chunk index, layer)."""
    n, layers = len(payloads), layout.layers
    if expected.shape != (n, layers) or dsts.shape != (n, layers * layout.per_layer):
        raise ValueError("one row of checksums and of piece addresses per chunk")
    for p in payloads:
        if p.device.type != "cpu" or not p.is_contiguous() or p.numel() * p.element_size() != layout.nbytes:
            raise ValueError(f"a payload is not a contiguous host buffer of {layout.nbytes} bytes")
    bases = np.array([p.data_ptr() for p in payloads], dtype=np.uint64)
    srcs = np.ascontiguousarray((bases[:, None] + layout.starts[None, :]).reshape(-1))
    segs = np.ascontiguousarray((bases[:, None] + layout.layer_starts[None, :]).reshape(-1))
    sums = np.ascontiguousarray(expected, dtype=np.uint64).reshape(-1)
    dsts = np.ascontiguousarray(dsts, dtype=np.uint64).reshape(-1)
    lens = np.tile(layout.lens, n)
    failures: list[tuple[int, int]] = []
    first, per = 0, layout.per_layer
    while first < n:
        seg, piece = first * layers, first * layers * per
        bad = int(_native.verify_scatter(
            segs[seg:].ctypes.data, layout.layer_bytes, (n - first) * layers, sums[seg:].ctypes.data,
            srcs[piece:].ctypes.data, dsts[piece:].ctypes.data, lens[piece:].ctypes.data, per))
        if bad < 0:
            break
        failures.append((first + bad // layers, bad % layers))
        first += bad // layers + 1
    return failures
