"""Triton decode of a compressed chunk straight into the pool's blocks (issue 33).

A restore to a GPU copies the chunk's *stored* bytes to the device (2-3.8x fewer than its
KV) and this kernel decodes them into the paged pool in the same pass that scatters them:
the link carries compressed bytes, HBM does the rest. The payload layout and the arithmetic
are :mod:`kvtier.kv_codecs`'s (each layer encoded apart; a value is ``q * 2**e`` with a
short integer or e4m3 ``q`` and a power-of-two scale), and the results are bit for bit the
torch reference's (tested under the interpreter and on a GPU).

Powers of two are built from their bits (``exp2`` may be approximate), as two factors so
that every exponent a payload can hold stays a normal float: the product is exact wherever
the reference's is; bf16 is rounded from fp32 by hand (the interpreter's cast flushes
subnormals, which bf16 KV may hold). What only a foreign writer could put in a payload (an exponent of
-128, an e4m3 NaN, an int4 nibble of 0, a value past the KV dtype's range) is reported in
a status word (the highest code found, as ``kv_codec.c`` numbers them), read by the host
once the copy is waited for.

Grid: ``(restored tokens / ROWS, layers * 2)``; a program decodes ROWS tokens' K or V rows,
every head, into their block slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BAD_EXPONENT, BAD_VALUE, OUT_OF_RANGE = 2, 3, 4
"""Status codes (kvtier/gpu_pool/kernels/native/kv_codec.c numbers them alike)."""

_CODES = {"fp8": 1, "int8": 2, "int4": 3}
ROW_VALUES = 4096
"""Values a program decodes (several tokens' rows where a row is short): measured on an
H200 (docs/gpu.md)."""


@triton.jit
def _pow2(x):
    """2**x for int32 ``x`` in [-126, 127], exact (from the float's bits)."""
    return ((x + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _stored_values(base, e_base, kv, t, idx, mask, tokens,
                   HD: tl.constexpr, D: tl.constexpr, G: tl.constexpr, GT: tl.constexpr,
                   GD: tl.constexpr, CODEC: tl.constexpr):
    """Each value's integer (or e4m3) part ``q`` and power of two ``shift``, its group's
    exponent ``e``, and where the byte is one no encoder writes."""
    if CODEC == 3:  # int4: two values a byte, even channel in the low nibble
        byte = tl.load(base + (kv * tokens + t) * (HD // 2) + idx // 2, mask=mask, other=0x88)
        byte = byte.to(tl.int32)
        nib = tl.where(idx % 2 == 0, byte & 15, byte >> 4)
        bad_value = (nib == 0) & mask
        q = (nib - 8).to(tl.float32)
        # keys: a scale per channel over GT tokens; values: per token over GD channels
        e_off = tl.where(kv == 0, (t // GT) * HD + idx, t * (HD // GD) + idx // GD)
        e = tl.load(e_base + e_off, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.int32)
        shift = e
    else:
        b = tl.load(base + (kv * tokens + t) * HD + idx, mask=mask, other=0).to(tl.int32)
        if CODEC == 1:  # e4m3: (8 + m) * 2**(f - 10), or m * 2**-9 where f == 0
            f = (b >> 3) & 15
            m = b & 7
            bad_value = ((b & 127) == 127) & mask
            q = tl.where(f == 0, m, m + 8).to(tl.float32)
            q = tl.where(b >= 128, -q, q)
            e = tl.load(e_base + (t * HD + idx) // G, mask=mask, other=0)
            e = e.to(tl.int8, bitcast=True).to(tl.int32)
            shift = e + tl.where(f == 0, -9, f - 10)
        else:  # int8: a scale per token and head
            bad_value = idx < 0
            q = tl.where(b >= 128, b - 256, b).to(tl.float32)
            e = tl.load(e_base + (t * HD + idx) // D, mask=mask, other=0)
            e = e.to(tl.int8, bitcast=True).to(tl.int32)
            shift = e
    return q, shift, e, bad_value


@triton.jit
def _in_dtype(val, mask, out_ty: tl.constexpr, OUT_BF16: tl.constexpr):
    """``val`` (fp32) in the pool's dtype, and where it does not fit (past its range)."""
    if OUT_BF16:  # round to nearest even by hand: exact for subnormals everywhere
        bits = val.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bad_range = ((bits & 0x7F80) == 0x7F80) & mask
        out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = val.to(out_ty)
        wide = out.to(tl.float32)
        bad_range = ((wide != wide) | (tl.abs(wide) == float("inf"))) & mask
    return out, bad_range


@triton.jit
def decode_scatter_kernel(
    payload_ptr, kv_ptr, ids_ptr, status_ptr,
    step, k_at, v_at, tokens, offset,
    s_kv_layer, s_kv_block, s_kv_kv,
    HD: tl.constexpr, D: tl.constexpr, G: tl.constexpr, GT: tl.constexpr,
    GD: tl.constexpr, BLOCK_SIZE: tl.constexpr, CODEC: tl.constexpr, BLOCK: tl.constexpr,
    ROWS: tl.constexpr, OUT_BF16: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    j = rows[:, None]  # the restored tokens, from offset on
    live = j < tokens - offset
    lk = tl.program_id(1)
    layer = (lk // 2).to(tl.int64)
    kv = lk % 2
    t = offset + j  # the tokens in the chunk
    idx = tl.arange(0, BLOCK)[None, :]
    mask = (idx < HD) & live
    base = payload_ptr + layer * step
    e_base = base + tl.where(kv == 0, k_at, v_at)
    q, shift, e, bad_value = _stored_values(base, e_base, kv, t, idx, mask, tokens,
                                            HD, D, G, GT, GD, CODEC)
    bad_exp = (e < -127) & mask
    half = shift >> 1  # floor: both factors stay within [-69, 67]
    out, bad_range = _in_dtype(q * _pow2(half) * _pow2(shift - half), mask,
                               kv_ptr.dtype.element_ty, OUT_BF16)
    block = tl.load(ids_ptr + j // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
    dst = (kv_ptr + layer * s_kv_layer + block * s_kv_block + kv * s_kv_kv
           + (j % BLOCK_SIZE) * HD + idx)
    tl.store(dst, out, mask=mask)
    code = tl.max(tl.max(tl.where(bad_exp, 2, tl.where(bad_value, 3, tl.where(bad_range, 4, 0))),
                         axis=1), axis=0)
    if code > 0:
        tl.atomic_max(status_ptr, code)


def decode_scatter(
    payload: torch.Tensor, codec: str, kv: torch.Tensor, block_ids: torch.Tensor,
    tokens: int, offset: int, exponents_at: tuple[int, int], groups: tuple[int, int, int],
    status: torch.Tensor,
) -> None:
    """Launch the decode + scatter of every layer of ``payload`` (checked by the caller:
    :func:`kvtier.gpu_pool.kernels.api.scatter_decoded`)."""
    layers, _, _, block_size, heads, dim = kv.shape
    n = tokens - offset
    if n <= 0 or layers == 0:
        return
    g, gt, gd = groups
    hd = heads * dim
    block = triton.next_power_of_2(hd)
    rows = max(1, min(triton.next_power_of_2(n), ROW_VALUES // block))  # ~ROW_VALUES a program
    grid = (triton.cdiv(n, rows), layers * 2)
    decode_scatter_kernel[grid](
        payload, kv, block_ids, status,
        payload.numel() // layers, exponents_at[0], exponents_at[1], tokens, offset,
        kv.stride(0), kv.stride(1), kv.stride(2),
        HD=hd, D=dim, G=g, GT=gt, GD=gd, BLOCK_SIZE=block_size, CODEC=_CODES[codec],
        BLOCK=block, ROWS=rows, OUT_BF16=kv.dtype == torch.bfloat16, num_warps=4,
    )
