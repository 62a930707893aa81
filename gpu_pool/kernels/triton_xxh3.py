"""XXH3-64 of many byte ranges of a device buffer in one Triton launch.

Restored chunks are checked on the GPU: their bytes land in a device staging buffer and one
launch hashes every layer's range there, bit for bit the ``XXH3_64bits`` (seed 0, default
secret) that the host stored with the chunk (:mod:`kvtier.layer_sums`), and compares the
result with the stored sum, so no byte has to come back to the host to be checked.

One program hashes one range. Ranges up to 240 bytes follow XXH3's short and mid-size paths
as small tiles. Longer ones are read one 1 KiB block (16 stripes of 8 u64 lanes) per loop
step, the next block's load issued before the current one is folded in: as whole u64 words
where the range starts on a multiple of 8, as words joined from the two aligned words they
straddle where it does not, byte by byte only where buf's own address is not 8-aligned.
Secret reads at unaligned offsets are gathers from a host-built table of the secret's u64 at
every byte offset; u64 products wrap, 64x64->128 products are built from 32-bit halves.
"""
from __future__ import annotations

import functools

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
"""Warps per program: a [16, 8] tile of u64 is four words a thread, and the sums over a
block's stripes stay inside the warp (shuffles, no shared-memory barrier)."""


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
BYTES: tl.constexpr = tl.constexpr(0)
WORDS_ALIGNED: tl.constexpr = tl.constexpr(1)
WORDS_SHIFTED: tl.constexpr = tl.constexpr(2)
"""How the long mode reads a block: byte by byte (buf's address is not 8-aligned), whole u64
words (the range starts on a multiple of 8), or each word joined from the two aligned words
it straddles (any other start)."""


@triton.jit
def _swap_pairs(v):
    """``v[l ^ 1]`` of an [8] vector."""
    even, odd = tl.split(tl.reshape(v, [4, 2]))
    return tl.reshape(tl.join(odd, even), [8])


@triton.jit
def _tail_word(buf, size):
    """buf's last ``size % 8`` bytes as a little-endian u64: the part no whole word holds."""
    j = tl.arange(0, 8)
    at = size // 8 * 8 + j
    b = tl.load(buf + at, mask=at < size, other=0).to(tl.uint64)
    return tl.sum(b << (j * 8).to(tl.uint64), axis=0)


@triton.jit
def _long_acc(buf, words, table, start, length, size, MODE: tl.constexpr):
    """The eight accumulators after the full 1 KiB blocks (each then scrambled) and the
    stripes of the last partial block, XXH3_accumulate_512 stripe by stripe.

    A block is a [16 stripes, 8 lanes] u64 tile: ``acc[l]`` gains, over its stripes,
    ``lo32(d ^ k) * hi32(d ^ k)`` of lane l and the data of lane ``l ^ 1``; the sums wrap
    mod 2**64, so the order does not matter. Step b loads block b (as MODE says) and folds
    in block b - 1, so a load is in flight while a block is folded."""
    stripe = tl.arange(0, 16)
    lane = tl.arange(0, 8)
    word = (stripe * 8)[:, None] + lane[None, :]  # u64 index within a block
    key = tl.load(table + (stripe * 8)[:, None] + (lane * 8)[None, :]).to(tl.uint64,
                                                                          bitcast=True)
    scramble_key = tl.load(table + 128 + lane * 8).to(tl.uint64, bitcast=True)
    acc = tl.load(table + INIT_AT + lane).to(tl.uint64, bitcast=True)
    # A stripe counts if it ends before the range's last byte (int64: compared in the loop).
    stripe_end = ((stripe + 1) * 64).to(tl.int64)[:, None]
    blocks = (length - 1) // 1024
    first_word = start // 8 + word
    if MODE == WORDS_SHIFTED:
        shift = ((start % 8) * 8).to(tl.uint64)
        tail = _tail_word(buf, size)
        n_words = size // 8
    data = tl.full([16, 8], 0, tl.uint64)
    for b in range(0, blocks + 1):
        valid = stripe_end + b * 1024 < length
        if MODE == BYTES:
            at = start + b * 1024 + word * 8
            loaded = tl.full([16, 8], 0, tl.uint64)
            for k in tl.static_range(8):
                byte = tl.load(buf + at + k, mask=valid, other=0).to(tl.uint64)
                loaded |= byte << (8 * k)
        else:
            q = first_word + b * 128
            loaded = tl.load(words + q, mask=valid, other=0).to(tl.uint64, bitcast=True)
            if MODE == WORDS_SHIFTED:
                # A valid word's next aligned word is whole, or the tail (q + 1 == n_words).
                nxt = tl.load(words + q + 1, mask=valid & (q + 1 < n_words), other=0)
                nxt = tl.where(q + 1 < n_words, nxt.to(tl.uint64, bitcast=True), tail)
                loaded = (loaded >> shift) | ((nxt << (63 - shift)) << 1)
                loaded = tl.where(valid, loaded, 0)
        if b > 0:
            dk = data ^ key
            prod, total = tl.split(tl.sum(tl.join((dk & LO32) * (dk >> 32), data), axis=0))
            acc += prod + _swap_pairs(total)
            acc = (acc ^ (acc >> 47) ^ scramble_key) * P32_1
        data = loaded
    dk = data ^ key
    prod = tl.where(stripe_end + blocks * 1024 < length, (dk & LO32) * (dk >> 32), 0)
    prod, total = tl.split(tl.sum(tl.join(prod, data), axis=0))
    return acc + prod + _swap_pairs(total)


@triton.jit
def _hash_long(buf, words, table, start, length, size, WORDS: tl.constexpr):
    """XXH3_hashLong_64b (default secret): the blocks, the last stripe at ``length - 64``
    (secret 121, read from bytes), then the merge (secret 11, ``length * PRIME64_1``)."""
    if WORDS:
        if start % 8 == 0:
            acc = _long_acc(buf, words, table, start, length, size, WORDS_ALIGNED)
        else:
            acc = _long_acc(buf, words, table, start, length, size, WORDS_SHIFTED)
    else:
        acc = _long_acc(buf, words, table, start, length, size, BYTES)
    lane = tl.arange(0, 8)
    j = tl.arange(0, 8)
    raw = tl.load(buf + (start + length - 64 + lane * 8)[:, None] + j[None, :]).to(tl.uint64)
    data = tl.sum(raw << (j * 8).to(tl.uint64)[None, :], axis=1)
    dk = data ^ tl.load(table + 121 + lane * 8).to(tl.uint64, bitcast=True)
    acc += (dk & LO32) * (dk >> 32) + _swap_pairs(data)
    mixed = acc ^ tl.load(table + 11 + lane * 8).to(tl.uint64, bitcast=True)
    even, odd = tl.split(tl.reshape(mixed, [4, 2]))
    return _avalanche(length.to(tl.uint64) * P64_1 + tl.sum(_fold64(even, odd), axis=0))


# ------------------------------------------------------------------------------------ kernel
@triton.jit
def _xxh3_kernel(buf, words, table, starts, lengths, expected, out, size,
                 WORDS: tl.constexpr, CHECK: tl.constexpr):
    """Program i: XXH3-64 of ``buf[starts[i] : starts[i] + lengths[i]]`` into ``out[i]``
    (int64 bits), or with CHECK, ``out[i] = 1`` (int32) where it is not ``expected[i]``."""
    i = tl.program_id(0)
    start = tl.load(starts + i)
    length = tl.load(lengths + i)
    if length <= 16:
        h = _hash_0to16(buf, start, length)
    elif length <= 128:
        h = _hash_17to128(buf, table, start, length)
    elif length <= 240:
        h = _hash_129to240(buf, table, start, length)
    else:
        h = _hash_long(buf, words, table, start, length, size, WORDS)
    if CHECK:
        tl.store(out + i, (h != tl.load(expected + i).to(tl.uint64, bitcast=True)).to(tl.int32))
    else:
        tl.store(out + i, h.to(tl.int64, bitcast=True))


# ------------------------------------------------------------------------------ Python entry
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


def _validate(buf, starts, lengths) -> None:
    """Device, dtype, shape and bounds of the inputs; the bounds cost one small read back."""
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
    _check_index("lengths", lengths, buf, starts.numel())
    if starts.numel() == 0:
        return
    size = buf.numel()
    low_start, low_length, over = torch.stack([
        starts.min(), lengths.min(), (lengths - (size - starts)).max()]).tolist()
    if low_start < 0 or low_length < 0:
        raise KernelInputError(
            f"starts and lengths must be >= 0 (smallest start {low_start}, smallest length "
            f"{low_length})")
    if over > 0:
        i = int(torch.argmax(lengths - (size - starts)))
        raise KernelInputError(
            f"range {i} ({int(starts[i])} + {int(lengths[i])} bytes) ends past buf "
            f"({size} bytes)")


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


def _launch(buf, starts, lengths, expected, out) -> None:
    """One program per range. Where buf's address is 8-aligned, long ranges read it as u64
    words (``words``: the whole words of buf); elsewhere byte by byte."""
    if buf.numel() == 0:  # only empty ranges: no byte is read, but the pointer must be valid
        buf = torch.zeros(8, dtype=torch.uint8, device=buf.device)
    aligned = buf.data_ptr() % 8 == 0 and buf.numel() >= 8
    words = buf[: buf.numel() // 8 * 8].view(torch.int64) if aligned else buf
    _xxh3_kernel[(starts.numel(),)](
        buf, words, _table_on(buf.device), starts, lengths,
        out if expected is None else expected, out, buf.numel(),
        WORDS=aligned, CHECK=expected is not None, num_warps=NUM_WARPS,
    )


def xxh3_ranges(buf: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """XXH3-64 (seed 0) of ``buf[starts[i] : starts[i] + lengths[i]]`` for each i, one launch.

    ``buf``: contiguous 1-D uint8 on the device (CPU under the interpreter); ``starts``,
    ``lengths``: int64 [n] on the same device. Returns int64 [n] (``out`` when given): the
    bits of each uint64 digest (``.view(torch.uint64)`` gives the digests). Raises
    :class:`~kvtier.errors.KernelInputError` (a ValueError) on bad inputs.
    """
    _validate(buf, starts, lengths)
    n = starts.numel()
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=buf.device)
    else:
        _check_out("out", out, torch.int64, buf, n)
    if n:
        _launch(buf, starts, lengths, None, out)
    return out


def check_ranges(buf: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                 expected: torch.Tensor, bad: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [n] (``bad`` when given): 1 where the XXH3-64 of range i is not ``expected[i]``
    (int64 bits of the stored uint64 sum), else 0. Hash and compare are one launch; nothing
    is read back after it (the input checks of :func:`xxh3_ranges` read back three numbers
    before it)."""
    _validate(buf, starts, lengths)
    n = starts.numel()
    _check_out("expected", expected, torch.int64, buf, n)
    if bad is None:
        bad = torch.empty(n, dtype=torch.int32, device=buf.device)
    else:
        _check_out("bad", bad, torch.int32, buf, n)
    if n:
        _launch(buf, starts, lengths, expected, bad)
    return bad
