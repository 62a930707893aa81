"""Per-layer xxh3 checksums of a chunk's payload: where they are computed and checked.

Every stored chunk carries the xxh3 of each layer's bytes, checked before any byte is used.
The xxhash package holds the GIL while it hashes, so the workers that checksum or check
chunks beside a copy to or from a GPU take turns whatever the cores (two threads hash no
faster than one). The native kernel (``_layer_sums``, built at install where a C compiler
is found) releases it; without it the package computes the same digests.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

try:
    from kvtier import _layer_sums as _native
except ImportError:  # built optionally (see setup.py); the xxhash package serves instead
    _native = None


def layer_sums(payload: memoryview | np.ndarray, layers: int) -> tuple[int, ...]:
    """The xxh3 of each of ``layers`` equal parts of ``payload`` (bytes)."""
    if layers <= 0:
        return ()
    mem = np.frombuffer(payload, dtype=np.uint8)  # no copy; keeps the buffer alive
    step = mem.size // layers
    if _native is None:
        view = memoryview(mem)
        return tuple(xxhash.xxh3_64_intdigest(view[i * step : (i + 1) * step]) for i in range(layers))
    sums = np.empty(layers, dtype=np.uint64)
    _native.hash(mem.ctypes.data, step, layers, sums.ctypes.data)
    return tuple(int(s) for s in sums)


def first_bad_layer(payload: memoryview | np.ndarray, expected: Sequence[int]) -> int:
    """The first of ``len(expected)`` equal parts of ``payload`` whose xxh3 is not the
    expected one, or -1."""
    if not expected:
        return -1
    mem = np.frombuffer(payload, dtype=np.uint8)  # no copy; keeps the buffer alive
    step = mem.size // len(expected)
    if _native is None:
        view = memoryview(mem)
        for i, want in enumerate(expected):
            if xxhash.xxh3_64_intdigest(view[i * step : (i + 1) * step]) != want:
                return i
        return -1
    want = np.asarray(expected, dtype=np.uint64)
    return int(_native.verify(mem.ctypes.data, step, len(expected), want.ctypes.data))
