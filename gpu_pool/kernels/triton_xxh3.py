"""XXH3-64 of many byte ranges of a device buffer: one call, no host sync inside.

Restored chunks are checked on the GPU: their bytes land in a device staging buffer and one
call hashes every layer's range there, bit for bit the ``XXH3_64bits`` (seed 0, default
secret) that the host stored with the chunk (:mod:`kvtier.layer_sums`), and compares the
result with the stored sum, so no byte has to come back to the host to be checked.

XXH3's long mode (more than 240 bytes) is a serial chain: the accumulators gain each full
1 KiB block's contribution, then are scrambled, block after block. Only the scramble is
serial; a block's contribution (over its 16 stripes of 8 u64 lanes, the sum of
``lo32(d ^ k) * hi32(d ^ k)`` plus the lane-swapped data, mod 2**64) depends on its bytes
alone. So a call is two launches on the same stream:

- pass 1 (:func:`_block_sums_kernel`), a program per ``GROUP`` consecutive full blocks of
  all ranges together, writes each block's contribution, 64 bytes, to a scratch table
  ``[total blocks, 8]`` in range order (range i's first row is ``first[i]``, an exclusive
  cumsum of the blocks per range, computed on the device);
- pass 2 (:func:`_xxh3_kernel`), a program per range, runs the chain over those 64-byte
  rows, adds the last partial block and the last stripe from the bytes and merges; ranges
  up to 240 bytes follow XXH3's short and mid-size paths as small tiles.

A range's bytes are read as u64 words where buf's address is 8-aligned (each word joined
from the two aligned words it straddles where it is not on a multiple of 8), byte by byte
where it is not. Secret reads at unaligned offsets are gathers from a host-built table of
the secret's u64 at every byte offset; u64 products wrap, 64x64->128 products are built from
32-bit halves.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from kvtier.errors import KernelInputError

SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
"""XXH3's default 192-byte secret (``XXH3_kSecret``)."""

P32_1: tl.constexpr = tl.constexpr(0x9E3779B1)
P32_2: tl.constexpr = tl.constexpr(0x85EBCA77)
P32_3: tl.constexpr = tl.constexpr(0xC2B2AE3D)
P64_1: tl.constexpr = tl.constexpr(0x9E3779B185EBCA87)
P64_2: tl.constexpr = tl.constexpr(0xC2B2AE3D27D4EB4F)
P64_3: tl.constexpr = tl.constexpr(0x165667B19E3779F9)
P64_4: tl.constexpr = tl.constexpr(0x85EBCA77C2B2AE63)
P64_5: tl.constexpr = tl.constexpr(0x27D4EB2F165667C5)
MX1: tl.constexpr = tl.constexpr(0x165667919E3779F9)
MX2: tl.constexpr = tl.constexpr(0x9FB21C651E98DF25)
LO32: tl.constexpr = tl.constexpr(0xFFFFFFFF)

INIT_ACC = tuple(p.value for p in (P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1))
"""The long mode's eight accumulators before the first stripe (``XXH3_INIT_ACC``)."""


def _secret_word(offset: int) -> int:
    return int.from_bytes(SECRET[offset : offset + 8], "little")


# The keys of the inputs up to 16 bytes: fixed pieces of the secret, folded here.
FLIP_1TO3: tl.constexpr = tl.constexpr((_secret_word(0) ^ _secret_word(4)) & 0xFFFFFFFF)
FLIP_4TO8: tl.constexpr = tl.constexpr(_secret_word(8) ^ _secret_word(16))
FLIP_9TO16_LO: tl.constexpr = tl.constexpr(_secret_word(24) ^ _secret_word(32))
FLIP_9TO16_HI: tl.constexpr = tl.constexpr(_secret_word(40) ^ _secret_word(48))
EMPTY_KEY: tl.constexpr = tl.constexpr(_secret_word(56) ^ _secret_word(64))

SECRET_WORDS = len(SECRET) - 7
"""Entries of the table's first part: the secret's u64 at byte offsets 0..184."""
INIT_AT: tl.constexpr = tl.constexpr(SECRET_WORDS)
"""Where :data:`INIT_ACC` starts in the table."""

NUM_WARPS = 1
"""Warps per pass-2 program: its largest tile, the last partial block's [16, 8] u64, is four
words a thread, and the sums over stripes stay inside the warp (shuffles, no barrier)."""

GROUP: tl.constexpr = tl.constexpr(16)
"""Full blocks per pass-1 program: 16 KiB read in one [16, 16, 8] tile load, all in flight
at once. 32 MiB of 1 MiB ranges is 2044 programs; at 64 registers a thread an H100's or
H200's SM holds four of them (64 KiB in flight)."""
GROUP_WARPS = 8
"""Warps per pass-1 program: eight u64 of the tile a thread."""
ROWS: tl.constexpr = tl.constexpr(16)
"""Scratch rows a pass-2 step loads before it folds them one by one into the chain, so one
memory round-trip serves 16 scrambles instead of one."""
BLOCK: tl.constexpr = tl.constexpr(1024)
"""Bytes of a long-mode block: 16 stripes of 64 bytes."""


def _table() -> torch.Tensor:
    """int64 [193]: the secret's little-endian u64 at each byte offset 0..184, then the
    long mode's initial accumulators (bits of the uint64 values)."""
    words = [_secret_word(o) for o in range(SECRET_WORDS)]
    bits = [w - (1 << 64) if w >= 1 << 63 else w for w in (*words, *INIT_ACC)]
    return torch.tensor(bits, dtype=torch.int64)


@functools.cache
def _table_on(device: torch.device) -> torch.Tensor:
    """The table, copied to ``device`` once."""
    return _table().to(device)


# ------------------------------------------------------------------------------- arithmetic
@triton.jit
def _fold64(a, b):
    """Low 64 bits XOR high 64 bits of the 128-bit product ``a * b`` (uint64)."""
    a_lo = a & LO32
    a_hi = a >> 32
    b_lo = b & LO32
    b_hi = b >> 32
    lo_lo = a_lo * b_lo
    hi_lo = a_hi * b_lo
    lo_hi = a_lo * b_hi
    hi_hi = a_hi * b_hi
    cross = (lo_lo >> 32) + (hi_lo & LO32) + lo_hi
    upper = (hi_lo >> 32) + (cross >> 32) + hi_hi
    lower = (cross << 32) | (lo_lo & LO32)
    return lower ^ upper


@triton.jit
def _avalanche(h):
    """``XXH3_avalanche``."""
    h = h ^ (h >> 37)
    h = h * MX1
    return h ^ (h >> 32)


@triton.jit
def _avalanche64(h):
    """``XXH64_avalanche``."""
    h = h ^ (h >> 33)
    h = h * P64_2
    h = h ^ (h >> 29)
    h = h * P64_3
    return h ^ (h >> 32)


@triton.jit
def _rrmxmx(h, n):
    """``XXH3_rrmxmx`` of ``h`` for an input of ``n`` bytes."""
    h = h ^ (((h << 49) | (h >> 15)) ^ ((h << 24) | (h >> 40)))
    h = h * MX2
    h = h ^ ((h >> 35) + n)
    h = h * MX2
    return h ^ (h >> 28)


@triton.jit
def _bswap64(x):
    """``XXH_swap64``: the bytes of a u64 in reverse order."""
    x = ((x & 0x00FF00FF00FF00FF) << 8) | ((x >> 8) & 0x00FF00FF00FF00FF)
    x = ((x & 0x0000FFFF0000FFFF) << 16) | ((x >> 16) & 0x0000FFFF0000FFFF)
    return (x << 32) | (x >> 32)


# ------------------------------------------------------------------------------------ loads
@triton.jit
def _le_pair(buf, first, second, N: tl.constexpr):
    """The little-endian N-byte integers (uint64) at bytes ``first`` and ``second``."""
    j = tl.arange(0, N)
    at = tl.where(tl.arange(0, 2) == 0, first, second)
    b = tl.load(buf + at[:, None] + j[None, :]).to(tl.uint64)
    return tl.split(tl.sum(b << (j * 8).to(tl.uint64)[None, :], axis=1))


@triton.jit
def _mix16(buf, table, at, sec, mask):
    """``XXH3_mix16B`` (seed 0) of the 16 bytes at each byte offset ``at`` [N] with the
    secret at byte ``sec`` [N]; 0 where not ``mask``."""
    j = tl.arange(0, 8)
    half = tl.arange(0, 2) * 8
    b = tl.load(buf + at[:, None, None] + half[None, :, None] + j[None, None, :],
                mask=mask[:, None, None], other=0)
    lo, hi = tl.split(tl.sum(b.to(tl.uint64) << (j * 8).to(tl.uint64)[None, None, :], axis=2))
    key = tl.load(table + sec[:, None] + half[None, :]).to(tl.uint64, bitcast=True)
    k_lo, k_hi = tl.split(key)
    return tl.where(mask, _fold64(lo ^ k_lo, hi ^ k_hi), 0)


# ------------------------------------------------------------------------ short and mid-size
@triton.jit
def _hash_0to16(buf, start, length):
    """XXH3_len_0to16_64b."""
    n = length.to(tl.uint64)
    if length > 8:
        lo, hi = _le_pair(buf, start, start + length - 8, 8)
        lo ^= FLIP_9TO16_LO
        hi ^= FLIP_9TO16_HI
        h = _avalanche(n + _bswap64(lo) + hi + _fold64(lo, hi))
    elif length >= 4:
        first, last = _le_pair(buf, start, start + length - 4, 4)
        h = _rrmxmx((last + (first << 32)) ^ FLIP_4TO8, n)
    elif length > 0:
        c1 = tl.load(buf + start).to(tl.uint64)
        c2 = tl.load(buf + start + (length >> 1)).to(tl.uint64)
        c3 = tl.load(buf + start + length - 1).to(tl.uint64)
        combined = (c1 << 16) | (c2 << 24) | c3 | (n << 8)
        h = _avalanche64(combined ^ FLIP_1TO3)
    else:
        h = _avalanche64(n ^ EMPTY_KEY)  # n is 0; a tensor keeps the branches alike
    return h


@triton.jit
def _hash_17to128(buf, table, start, length):
    """XXH3_len_17to128_64b: pair i mixes 16 bytes from the front (secret 32i) and 16 from
    the back (secret 32i + 16) while 32i < length."""
    k = tl.arange(0, 8).to(tl.int64)
    i = k >> 1
    at = tl.where((k & 1) == 1, length - 16 * (i + 1), 16 * i)
    f = _mix16(buf, table, start + at, 16 * k, 32 * i < length)
    return _avalanche(length.to(tl.uint64) * P64_1 + tl.sum(f, axis=0))


@triton.jit
def _hash_129to240(buf, table, start, length):
    """XXH3_len_129to240_64b as one [16] tile: rounds 0-7 (secret 16k) feed ``acc``;
    rounds 8 to length/16 - 1 (secret 16(k-8) + 3) and the last 16 bytes (k = 15,
    secret 119) feed ``acc_end``."""
    k = tl.arange(0, 16).to(tl.int64)
    last = k == 15
    at = tl.where(last, length - 16, 16 * k)
    sec = tl.where(last, 119, tl.where(k < 8, 16 * k, 16 * (k - 8) + 3))
    f = _mix16(buf, table, start + at, sec, last | (k < length // 16))
    acc, acc_end = tl.split(tl.sum(tl.reshape(f, [2, 8]), axis=1))
    return _avalanche(_avalanche(length.to(tl.uint64) * P64_1 + acc) + acc_end)


# --------------------------------------------------------------------------------- long mode
@triton.jit
def _inside(start, length, size):
    """The range cut to buf. Valid inputs pass unchanged; device values that disagree with
    the caller's host copies (``host_ranges``, checked instead of them) cannot make a
    program read outside buf."""
    start = tl.minimum(tl.maximum(start, 0), size)
    return start, tl.minimum(tl.maximum(length, 0), size - start)


@triton.jit
def _swap_pairs(v):
    """``v[l ^ 1]`` of an [8] vector."""
    even, odd = tl.split(tl.reshape(v, [4, 2]))
    return tl.reshape(tl.join(odd, even), [8])


@triton.jit
def _swap_pair_rows(v, N: tl.constexpr):
    """``v[:, l ^ 1]`` of an [N, 8] tile."""
    even, odd = tl.split(tl.reshape(v, [N, 4, 2]))
    return tl.reshape(tl.join(odd, even), [N, 8])


@triton.jit
def _tail(buf, size, WORDS: tl.constexpr):
    """Where words are read, buf's last ``size % 8`` bytes as a little-endian u64: the part
    no whole word holds (read once per program); else 0, unused."""
    if WORDS:
        j = tl.arange(0, 8)
        at = size // 8 * 8 + j
        b = tl.load(buf + at, mask=at < size, other=0).to(tl.uint64)
        tail = tl.sum(b << (j * 8).to(tl.uint64), axis=0)
    else:
        tail = tl.zeros([], tl.uint64)
    return tail


@triton.jit
def _load_u64(buf, words, at, valid, size, tail, WORDS: tl.constexpr):
    """The little-endian u64 at each byte offset ``at`` where ``valid``, 0 elsewhere.

    WORDS (buf 8-aligned; ``words``: its whole u64 words): an offset that is not a multiple
    of 8 joins the two aligned words it straddles (the second is ``tail``, buf's last
    bytes, where no whole word holds them); its second load is masked off where the offset
    is aligned. Otherwise byte by byte (``tail`` unused)."""
    if WORDS:
        q = at >> 3
        shift = ((at & 7) * 8).to(tl.uint64)
        low = tl.load(words + q, mask=valid, other=0).to(tl.uint64, bitcast=True)
        whole = q + 1 < size // 8
        high = tl.load(words + q + 1, mask=valid & whole & (shift != 0), other=0)
        high = tl.where(whole, high.to(tl.uint64, bitcast=True), tail)
        value = (low >> shift) | ((high << (63 - shift)) << 1)
    else:
        value = tl.zeros(at.shape, tl.uint64)
        for k in tl.static_range(8):
            byte = tl.load(buf + at + k, mask=valid, other=0).to(tl.uint64)
            value |= byte << (8 * k)
    return tl.where(valid, value, 0)


@triton.jit
def _block_sums_kernel(buf, words, table, starts, lengths, first, sums, n, steps, rows, size,
                       WORDS: tl.constexpr):
    """Pass 1. Program p: rows ``p * GROUP ..`` (up to ``rows``) of ``sums`` (int64 [., 8]),
    all ranges' full blocks in range order, row ``first[i] + b`` range i's block b: over its
    16 stripes, ``lo32(d ^ k) * hi32(d ^ k)`` of lane l plus the data of lane ``l ^ 1``
    (wrapping u64).

    A range's full blocks are those followed by more of its bytes: ``(length - 1) // 1024``
    (none up to 1 KiB). A row finds its range by a binary search of ``first`` (``steps``
    rounds: ranges without blocks share their ``first`` with the next one)."""
    j = tl.program_id(0).to(tl.int64) * GROUP + tl.arange(0, GROUP)
    lo = tl.zeros([GROUP], tl.int64)
    hi = lo + n
    for _ in range(steps):  # invariant: first[lo] <= j < first[hi]
        mid = (lo + hi) >> 1
        below = tl.load(first + mid) <= j
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    start, length = _inside(tl.load(starts + lo), tl.load(lengths + lo), size)
    b = j - tl.load(first + lo)
    live = (j < rows) & ((b + 1) * BLOCK < length)
    stripe = tl.arange(0, 16)
    lane = tl.arange(0, 8)
    offset = (stripe * 64)[:, None] + (lane * 8)[None, :]  # a word's byte within a block
    at = (start + b * BLOCK)[:, None, None] + offset[None, :, :]
    data = _load_u64(buf, words, at, tl.broadcast_to(live[:, None, None], [GROUP, 16, 8]),
                     size, _tail(buf, size, WORDS), WORDS)
    key = tl.load(table + (stripe * 8)[:, None] + (lane * 8)[None, :]).to(tl.uint64,
                                                                          bitcast=True)
    dk = data ^ key[None, :, :]
    prod, total = tl.split(tl.sum(tl.join((dk & LO32) * (dk >> 32), data), axis=1))
    block_sum = prod + _swap_pair_rows(total, GROUP)
    tl.store(sums + j[:, None] * 8 + lane[None, :], block_sum.to(tl.int64, bitcast=True),
             mask=live[:, None])


@triton.jit
def _chain(acc, sums, row, live, lane, scramble_key, N: tl.constexpr, MASKED: tl.constexpr):
    """``XXH3_accumulate`` then ``XXH3_scrambleAcc`` of N full blocks (MASKED: the first
    ``live`` of them) from their pass-1 rows, the first at ``row``. The N loads depend on
    nothing the chain computes, so they are all in flight before the first scramble."""
    for k in tl.static_range(N):
        block_sum = tl.load(sums + (row + k) * 8 + lane).to(tl.uint64, bitcast=True)
        stepped = acc + block_sum
        stepped = (stepped ^ (stepped >> 47) ^ scramble_key) * P32_1
        acc = tl.where(k < live, stepped, acc) if MASKED else stepped
    return acc


@triton.jit
def _hash_long(buf, words, table, first, sums, i, start, length, size, rows,
               WORDS: tl.constexpr):
    """XXH3_hashLong_64b (default secret) of range i: the chain over its full blocks' rows,
    ROWS loads ahead of their scrambles; the last partial block's stripes and the last
    stripe at ``length - 64`` (secret 121) from the bytes; the merge (secret 11,
    ``length * PRIME64_1``). What follows the chain only adds, so it is loaded and summed
    first: its loads are in flight while the chain runs."""
    stripe = tl.arange(0, 16)
    lane = tl.arange(0, 8)
    blocks = (length - 1) // BLOCK
    valid = tl.broadcast_to(((stripe + 1) * 64)[:, None] + blocks * BLOCK < length, [16, 8])
    at = start + blocks * BLOCK + (stripe * 64)[:, None] + (lane * 8)[None, :]
    tail = _tail(buf, size, WORDS)
    data = _load_u64(buf, words, at, valid, size, tail, WORDS)
    dk = data ^ tl.load(table + (stripe * 8)[:, None] + (lane * 8)[None, :]).to(tl.uint64,
                                                                                bitcast=True)
    prod = tl.where(valid, (dk & LO32) * (dk >> 32), 0)
    prod, total = tl.split(tl.sum(tl.join(prod, data), axis=0))
    last = _load_u64(buf, words, start + length - 64 + lane * 8, lane < 8, size, tail, WORDS)
    dk = last ^ tl.load(table + 121 + lane * 8).to(tl.uint64, bitcast=True)
    after = prod + (dk & LO32) * (dk >> 32) + _swap_pairs(total + last)

    acc = tl.load(table + INIT_AT + lane).to(tl.uint64, bitcast=True)
    scramble_key = tl.load(table + 128 + lane * 8).to(tl.uint64, bitcast=True)
    # Kept inside the table (rows + ROWS: the last masked round reads past its range's
    # rows), whatever the device's plan says where it disagrees with the host's.
    row = tl.minimum(tl.maximum(tl.load(first + i), 0), rows)
    blocks = tl.minimum(blocks, rows - row)
    whole = blocks // ROWS * ROWS
    for b in range(0, whole, ROWS):
        acc = _chain(acc, sums, row + b, ROWS, lane, scramble_key, ROWS, False)
    if (blocks > whole) & (blocks > ROWS):  # the rest of a long range: one more round-trip
        acc = _chain(acc, sums, row + whole, blocks - whole, lane, scramble_key, ROWS, True)
    else:  # a short range's few blocks, one by one
        for b in range(whole, blocks):
            acc = _chain(acc, sums, row + b, 1, lane, scramble_key, 1, False)
    acc += after
    mixed = acc ^ tl.load(table + 11 + lane * 8).to(tl.uint64, bitcast=True)
    even, odd = tl.split(tl.reshape(mixed, [4, 2]))
    return _avalanche(length.to(tl.uint64) * P64_1 + tl.sum(_fold64(even, odd), axis=0))


# ------------------------------------------------------------------------------------ kernel
@triton.jit
def _xxh3_kernel(buf, words, table, starts, lengths, first, sums, expected, out, size, rows,
                 WORDS: tl.constexpr, CHECK: tl.constexpr):
    """Pass 2. Program i: XXH3-64 of ``buf[starts[i] : starts[i] + lengths[i]]`` into
    ``out[i]`` (int64 bits), or with CHECK, ``out[i] = 1`` (int32) where it is not
    ``expected[i]``; long ranges read their full blocks' rows of ``sums`` (pass 1)."""
    i = tl.program_id(0)
    start, length = _inside(tl.load(starts + i), tl.load(lengths + i), size)
    if length <= 16:
        h = _hash_0to16(buf, start, length)
    elif length <= 128:
        h = _hash_17to128(buf, table, start, length)
    elif length <= 240:
        h = _hash_129to240(buf, table, start, length)
    else:
        h = _hash_long(buf, words, table, first, sums, i, start, length, size, rows, WORDS)
    if CHECK:
        tl.store(out + i, (h != tl.load(expected + i).to(tl.uint64, bitcast=True)).to(tl.int32))
    else:
        tl.store(out + i, h.to(tl.int64, bitcast=True))


# ------------------------------------------------------------------------------ Python entry
HostRanges = tuple[np.ndarray, np.ndarray]
"""The caller's host copies of ``starts`` and ``lengths`` (int64 numpy arrays)."""


def _interpreted() -> bool:
    return type(_xxh3_kernel).__name__ == "InterpretedFunction"


def _check_index(name: str, t: object, buf: torch.Tensor, n: int | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int64 or t.dim() != 1:
        raise KernelInputError(
            f"{name} must be a 1-D int64 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    if t.device != buf.device:
        raise KernelInputError(f"{name} is on {t.device} but buf is on {buf.device}")
    if not t.is_contiguous():
        raise KernelInputError(f"{name} must be contiguous")
    if n is not None and t.numel() != n:
        raise KernelInputError(f"{name} has {t.numel()} entries but starts has {n}")


def _check_host(host_ranges: object, n: int) -> HostRanges:
    """The host copies' types and shapes: n int64 entries each."""
    if not isinstance(host_ranges, tuple | list) or len(host_ranges) != 2:
        raise KernelInputError("host_ranges must be a (starts, lengths) pair of numpy arrays")
    for name, a in zip(("starts", "lengths"), host_ranges, strict=True):
        if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.shape != (n,):
            got = (f"{a.dtype} of shape {a.shape}" if isinstance(a, np.ndarray)
                   else type(a).__name__)
            raise KernelInputError(
                f"host_ranges' {name} must be a 1-D int64 numpy array of {n} entries "
                f"(as many as starts), got {got}")
    return host_ranges[0], host_ranges[1]


def _check_bounds(low_start: int, low_length: int, over: int, size: int, worst) -> None:
    """Raise unless every range lies in buf; ``worst()``: (index, start, length) of the range
    that ends furthest past it, for the message."""
    if low_start < 0 or low_length < 0:
        raise KernelInputError(
            f"starts and lengths must be >= 0 (smallest start {low_start}, smallest length "
            f"{low_length})")
    if over > 0:
        i, start, length = worst()
        raise KernelInputError(
            f"range {i} ({start} + {length} bytes) ends past buf ({size} bytes)")


def _worst(starts: torch.Tensor, lengths: torch.Tensor, over: torch.Tensor
           ) -> tuple[int, int, int]:
    """(index, start, length) of the device range that ends furthest past buf."""
    i = int(torch.argmax(over))
    return i, int(starts[i]), int(lengths[i])


def _plan(lengths: torch.Tensor) -> torch.Tensor:
    """int64 [n + 1] on lengths' device: the first pass-1 row of each range's full blocks,
    then their total; a cumsum queued on the device, nothing read back."""
    first = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    blocks = (lengths - 1).clamp_(min=0).div_(BLOCK.value, rounding_mode="floor")
    torch.cumsum(blocks, 0, out=first[1:])
    return first


def _validate(buf, starts, lengths, host_ranges) -> tuple[torch.Tensor, int]:
    """Device, dtype, shape and bounds of the inputs; the plan (:func:`_plan`) and its total
    rows. The bounds and the total come from ``host_ranges`` where given, else from one small
    read-back (on CUDA it waits for whatever the stream queued before it)."""
    if not isinstance(buf, torch.Tensor):
        raise KernelInputError(f"buf must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise KernelInputError(
            f"buf must be a 1-D uint8 tensor, got {buf.dtype} of shape {tuple(buf.shape)}")
    if not buf.is_contiguous():
        raise KernelInputError("buf must be contiguous")
    if buf.device.type != "cuda" and not _interpreted():
        raise KernelInputError(
            f"buf is on {buf.device}: the kernel needs CUDA tensors (or TRITON_INTERPRET=1 "
            "set before the Triton kernels are imported, for the CPU interpreter)")
    _check_index("starts", starts, buf, None)
    n = starts.numel()
    _check_index("lengths", lengths, buf, n)
    if host_ranges is not None:
        rows = _host_rows(host_ranges, n, buf.numel())
        return _plan(lengths), rows
    first = _plan(lengths)
    return first, _device_rows(starts, lengths, first, buf.numel())


def _host_rows(host_ranges: object, n: int, size: int) -> int:
    """The bounds checked on the caller's host copies; the total full blocks, from them."""
    starts, lengths = _check_host(host_ranges, n)
    if n:
        over = lengths - (size - starts)
        i = int(np.argmax(over))
        _check_bounds(int(starts.min()), int(lengths.min()), int(over[i]), size,
                      lambda: (i, int(starts[i]), int(lengths[i])))
    return int((np.maximum(lengths - 1, 0) // BLOCK.value).sum())


def _device_rows(starts: torch.Tensor, lengths: torch.Tensor, first: torch.Tensor,
                 size: int) -> int:
    """The bounds checked on the device tensors and the plan's total full blocks: one
    read-back of four numbers."""
    if starts.numel() == 0:
        return 0
    over = lengths - (size - starts)
    low_start, low_length, most, rows = torch.stack(
        [starts.min(), lengths.min(), over.max(), first[-1]]).tolist()
    _check_bounds(low_start, low_length, most, size, lambda: _worst(starts, lengths, over))
    return rows


def _check_out(name: str, t: object, dtype: torch.dtype, buf: torch.Tensor, n: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.shape != (n,):
        raise KernelInputError(
            f"{name} must be {dtype} of shape ({n},), got {t.dtype} of shape {tuple(t.shape)}")
    if t.device != buf.device:
        raise KernelInputError(f"{name} is on {t.device} but buf is on {buf.device}")
    if not t.is_contiguous():
        raise KernelInputError(f"{name} must be contiguous")


def _operands(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """buf (8 zero bytes where it is empty: no byte is read, but the pointer must be valid),
    its whole u64 words where its address is 8-aligned (else buf again), and whether it is."""
    if buf.numel() == 0:
        buf = torch.zeros(8, dtype=torch.uint8, device=buf.device)
    aligned = buf.data_ptr() % 8 == 0 and buf.numel() >= 8
    return buf, (buf[: buf.numel() // 8 * 8].view(torch.int64) if aligned else buf), aligned


def _block_sums(buf, starts, lengths, first, rows: int) -> torch.Tensor:
    """Pass 1: int64 [rows + ROWS, 8], row ``first[i] + b`` the contribution of range i's
    full block b (the last ROWS rows are never written: pass 2's last round of a long range
    may load them, masked off). No launch without full blocks (every range within 1 KiB)."""
    buf, words, aligned = _operands(buf)
    sums = torch.empty((rows + ROWS.value, 8), dtype=torch.int64, device=buf.device)
    if rows:
        n = starts.numel()
        _block_sums_kernel[(triton.cdiv(rows, GROUP.value),)](
            buf, words, _table_on(buf.device), starts, lengths, first, sums, n,
            max(n - 1, 0).bit_length(), rows, buf.numel(), WORDS=aligned,
            num_warps=GROUP_WARPS,
        )
    return sums


def _launch(buf, starts, lengths, first, rows, expected, out) -> None:
    """Pass 1 then pass 2, queued back to back (the scratch table lives in torch's caching
    allocator until both ran: it is freed after pass 2 is queued, on the same stream)."""
    sums = _block_sums(buf, starts, lengths, first, rows)
    buf, words, aligned = _operands(buf)
    _xxh3_kernel[(starts.numel(),)](
        buf, words, _table_on(buf.device), starts, lengths, first, sums,
        out if expected is None else expected, out, buf.numel(), rows,
        WORDS=aligned, CHECK=expected is not None, num_warps=NUM_WARPS,
    )


def xxh3_ranges(buf: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                out: torch.Tensor | None = None, *,
                host_ranges: HostRanges | None = None) -> torch.Tensor:
    """XXH3-64 (seed 0) of ``buf[starts[i] : starts[i] + lengths[i]]`` for each i.

    ``buf``: contiguous 1-D uint8 on the device (CPU under the interpreter); ``starts``,
    ``lengths``: int64 [n] on the same device. ``host_ranges``: the same starts and lengths
    as int64 numpy arrays the caller built; the bounds are then checked on them and the
    passes planned from them, with nothing read back from the device (on CUDA a read-back
    waits for the copies queued before it). They must equal the device tensors: a device
    range that disagrees is hashed cut to buf, never read past it. Returns int64 [n]
    (``out`` when given): the bits of each uint64 digest (``.view(torch.uint64)`` gives the
    digests). Raises :class:`~kvtier.errors.KernelInputError` (a ValueError) on bad inputs.
    """
    first, rows = _validate(buf, starts, lengths, host_ranges)
    n = starts.numel()
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=buf.device)
    else:
        _check_out("out", out, torch.int64, buf, n)
    if n:
        _launch(buf, starts, lengths, first, rows, None, out)
    return out


def check_ranges(buf: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                 expected: torch.Tensor, bad: torch.Tensor | None = None, *,
                 host_ranges: HostRanges | None = None) -> torch.Tensor:
    """int32 [n] (``bad`` when given): 1 where the XXH3-64 of range i is not ``expected[i]``
    (int64 bits of the stored uint64 sum), else 0. Hash and compare are queued together;
    nothing is read back after them, nor before them where ``host_ranges`` is given (see
    :func:`xxh3_ranges`; without it the input checks read back four numbers)."""
    first, rows = _validate(buf, starts, lengths, host_ranges)
    n = starts.numel()
    _check_out("expected", expected, torch.int64, buf, n)
    if bad is None:
        bad = torch.empty(n, dtype=torch.int32, device=buf.device)
    else:
        _check_out("bad", bad, torch.int32, buf, n)
    if n:
        _launch(buf, starts, lengths, first, rows, expected, bad)
    return bad
