"""Codecs for KV at rest: what a chunk's payload holds in the lower tiers (issue 33).

The GPU pool keeps its dtype; a tier may store a chunk's KV quantized, to move and hold
fewer bytes. Every codec here shares one scale per small group of values, and every scale
is a power of two (stored as its exponent, one signed byte, like the E8M0 scales of the OCP
microscaling formats). That choice buys two properties the data path relies on:

- **No compounding.** A decoded value is ``q * 2**e`` with a short integer (or fp8) ``q``,
  exact in bf16, fp16 and fp32; encoding decoded KV again finds the same groups' maxima,
  the same exponents (or one lower, with the same values) and the same ``q``: a second
  round trip changes no value (tested).
- **Cheap, exact decode**: a multiply by a power of two, fusable into the scatter of a
  restore on any device.

The codecs (``bytes_per_value`` for a 2-byte source: the ratio is 2 / it):

- ``fp8``: e4m3 values, one exponent per 32 values of a head's vector (1.03 B/value).
- ``int8``: symmetric int8, one exponent per token and KV head (1 + 1/head_dim B/value).
- ``int4``: symmetric int4 (-7..7), two per byte; keys grouped per channel over 32 tokens
  and values per token over 32 channels, as KIVI does (keys have outlier channels, values
  do not): 0.53 B/value.

This module is the torch reference (any device); the payload layout is fixed here: the
packed values, then the exponents (int8), each in the KV's ``[layers, 2, tokens, heads,
head_dim]`` order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch

from kvtier.errors import ChunkFormatError, InvalidArgumentError

try:
    from kvtier import _kv_codec as _native
except ImportError:  # built optionally (see setup.py); the torch reference serves instead
    _native = None

NATIVE = _native is not None
"""Whether host tensors are encoded and decoded by the native kernels (bit for bit the
torch reference's results, at memory speed)."""

GROUP = 32
"""Values sharing one exponent (along head_dim, or along tokens for int4 keys)."""

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
ENCODABLE = _FLOATS
"""Cache dtypes a lossy codec encodes (an fp8 cache is stored as it is)."""
_EXP_MIN, _EXP_MAX = -127, 127
_QUANTUM = {torch.float32: -149, torch.bfloat16: -133, torch.float16: -24}
"""log2 of each KV dtype's smallest subnormal: no decoded value may be finer."""
_FP8_QUANTUM = -9
"""log2 of e4m3's smallest subnormal."""


class Codec(str, Enum):
    NONE = "none"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"

    @classmethod
    def parse(cls, name: str) -> Codec:
        try:
            return cls(name)
        except ValueError:
            raise InvalidArgumentError(
                f"unknown KV codec {name!r}; choose one of: {', '.join(c.value for c in cls)}"
            ) from None


CODEC_NAMES: frozenset[str] = frozenset(c.value for c in Codec)
"""Every codec's name (``none`` included): what a chunk header or a reader may name."""

ERROR_BOUND: dict[Codec, float] = {
    Codec.NONE: 0.0,
    Codec.FP8: 2.0**-4,  # 3 mantissa bits: half an ulp of the value, at most of the group's max
    Codec.INT8: 1 / 127,  # half a step; the step is at most the group's max / 63.5
    Codec.INT4: 1 / 7,  # half a step; the step is at most the group's max / 3.5
}
"""The largest error of a decoded value relative to the largest magnitude of its group: what
a quality budget (``policy.max_kv_error``) is compared with (tested against the codecs).
A group whose largest values lie within a step of the KV dtype's largest finite value may
err by twice as much there: those round toward zero rather than decode to infinity."""


@dataclass(frozen=True)
class Layout:
    """Where a codec's payload keeps what, for one KV shape."""

    codec: Codec
    shape: tuple[int, int, int, int, int]
    values_nbytes: int
    exponents: int

    @property
    def nbytes(self) -> int:
        return self.values_nbytes + self.exponents

    def bytes_per_value(self) -> float:
        return self.nbytes / math.prod(self.shape)


def _group(n: int) -> int:
    """The group length along a dimension of ``n``: GROUP where it divides ``n``, else the
    whole dimension (a tiny head, a short tail chunk)."""
    return GROUP if n % GROUP == 0 else n


def groups(codec: Codec, tokens: int, dim: int) -> tuple[int, int, int]:
    """How ``codec`` groups a layer of ``tokens`` x ``head_dim`` ``dim``: values sharing an
    fp8 exponent along a head's vector, int4 keys' tokens per exponent, int4 values'
    channels per exponent (what a decoder on another device needs besides the layout)."""
    del codec  # every codec groups alike; its layout decides which groups it uses
    return _group(dim), _group(tokens), _group(dim)


def layout(codec: Codec, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> Layout:
    """The payload layout of KV of ``shape`` ``[layers, 2, tokens, heads, head_dim]``
    (``dtype``: the KV's own, which ``none`` stores as it is)."""
    if len(shape) != 5 or shape[1] != 2 or min(shape) <= 0:
        raise InvalidArgumentError(
            f"KV of shape {tuple(shape)}: expected [layers, 2, tokens, heads, head_dim]")
    shape5 = (int(shape[0]), 2, int(shape[2]), int(shape[3]), int(shape[4]))
    n = math.prod(shape5)
    layers, _, tokens, heads, dim = shape5
    if codec is Codec.NONE:
        size = (dtype or torch.float32).itemsize
        return Layout(codec, shape5, n * size, 0)
    if codec is Codec.FP8:
        return Layout(codec, shape5, n, n // _group(dim))
    if codec is Codec.INT8:
        return Layout(codec, shape5, n, layers * 2 * tokens * heads)
    if dim % 2:
        raise InvalidArgumentError(f"int4 packs two values a byte: head_dim {dim} is odd")
    half = layers * tokens * heads * dim
    return Layout(codec, shape5, n // 2, half // _group(tokens) + half // _group(dim))


def _exponents(amax: torch.Tensor, qmax: float, floor: int) -> torch.Tensor:
    """The smallest ``e`` with ``amax / 2**e <= qmax`` per group (int32), no lower than
    ``floor`` (so that every decoded value is a multiple of the KV dtype's smallest step,
    hence exact in it) nor than one signed byte holds; ``floor`` for an all-zero group."""
    mant, exp = torch.frexp(amax / qmax)  # amax/qmax = mant * 2**exp, mant in [0.5, 1)
    e = exp - (mant == 0.5).to(exp.dtype)  # an exact power of two: its own exponent
    e = torch.where(amax > 0, e, torch.full_like(e, floor))
    return e.clamp(max(floor, _EXP_MIN), _EXP_MAX)


def _floor(dtype: torch.dtype, codec: Codec) -> int:
    return _QUANTUM[dtype] - (_FP8_QUANTUM if codec is Codec.FP8 else 0)


def _check_kv(kv: torch.Tensor) -> None:
    if kv.dtype not in _FLOATS:
        raise InvalidArgumentError(f"KV of dtype {kv.dtype}: a codec takes float32, bf16 or fp16")
    if not torch.isfinite(kv).all():
        raise InvalidArgumentError("KV holds a NaN or an infinity: it cannot be encoded")


def encode(kv: torch.Tensor, codec: Codec) -> torch.Tensor:
    """``kv`` ``[layers, 2, tokens, heads, head_dim]`` as a uint8 payload of
    ``layout(codec, kv.shape, kv.dtype).nbytes`` bytes, on ``kv``'s device."""
    lay = layout(codec, tuple(kv.shape), kv.dtype)
    if kv.dtype not in _FLOATS:
        raise InvalidArgumentError(f"KV of dtype {kv.dtype}: a codec takes float32, bf16 or fp16")
    if NATIVE and kv.device.type == "cpu" and codec is not Codec.NONE:
        return _native_encode(kv.contiguous(), codec, lay)
    return reference_encode(kv, codec)


def reference_encode(kv: torch.Tensor, codec: Codec) -> torch.Tensor:
    """:func:`encode` in torch ops (any device): the reference the native kernels match."""
    lay = layout(codec, tuple(kv.shape), kv.dtype)
    _check_kv(kv)
    if codec is Codec.NONE:
        return kv.contiguous().view(-1).view(torch.uint8).clone()
    values, exps = _encode_parts(kv, codec, lay)
    out = torch.cat([values.reshape(-1), *(e.reshape(-1) for e in exps)])
    assert out.numel() == lay.nbytes
    return out


def encode_each_layer(kv: torch.Tensor, codec: Codec) -> torch.Tensor:
    """Each layer of ``kv`` encoded apart, one payload after another (a chunk's), in one
    pass over all layers in torch ops: what ``torch.cat`` of :func:`encode` of each layer
    gives, with a few launches instead of a few per layer (on a GPU)."""
    lay = layout(codec, tuple(kv.shape), kv.dtype)
    _check_kv(kv)
    if codec is Codec.NONE:
        return kv.contiguous().view(-1).view(torch.uint8).clone()
    values, exps = _encode_parts(kv, codec, lay)
    layers = kv.shape[0]
    out = torch.cat([values.reshape(layers, -1), *(e.reshape(layers, -1) for e in exps)], dim=1)
    return out.reshape(-1)


def _encode_parts(kv: torch.Tensor, codec: Codec, lay: Layout
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The encoded values and the exponent parts, each with the layers first (groups never
    cross a layer, so a layer's payload is its values then its part of each exponent part)."""
    x = kv.float()
    floor = _floor(kv.dtype, codec)
    if codec is Codec.INT4:
        values, exps = _encode_int4(x, floor, torch.finfo(kv.dtype).max)
    else:
        qmax = 448.0 if codec is Codec.FP8 else 127.0
        g = _group(lay.shape[4]) if codec is Codec.FP8 else lay.shape[4]
        groups = x.reshape(*x.shape[:4], -1, g)
        e = _exponents(groups.abs().amax(-1, keepdim=True), qmax, floor)
        scaled = torch.ldexp(groups, -e.float())
        limit = torch.ldexp(torch.full_like(scaled[..., :1], torch.finfo(kv.dtype).max), -e.float())
        if codec is Codec.FP8:
            values = scaled.clamp(-qmax, qmax).to(torch.float8_e4m3fn)
            over = values.float().abs() > limit  # rounded past the dtype's largest value
            values = values.view(torch.uint8) - over.to(torch.uint8)  # the next value down
        else:
            values = _round_within(scaled, qmax, limit).to(torch.int8).view(torch.uint8)
        exps = [e.to(torch.int8).view(torch.uint8)]
    return values, exps


def _round_within(scaled: torch.Tensor, qmax: float, limit: torch.Tensor) -> torch.Tensor:
    """To the nearest integer in [-qmax, qmax], toward zero where the nearest would decode
    past the KV dtype's largest finite value (``limit``, in units of the scale)."""
    q = scaled.round().clamp(-qmax, qmax)
    return torch.where(q.abs() > limit, scaled.trunc(), q)


def _encode_int4(x: torch.Tensor, floor: int, fmax: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    layers, _, tokens, heads, dim = x.shape
    gt, gd = _group(tokens), _group(dim)
    # keys: per channel over gt tokens -> groups [L, T/gt, gt, H, D] reduced over gt
    k = x[:, 0].reshape(layers, tokens // gt, gt, heads, dim)
    ek = _exponents(k.abs().amax(2, keepdim=True), 7.0, floor)
    lk = torch.ldexp(torch.full_like(ek, fmax, dtype=torch.float32), -ek.float())
    qk = _round_within(torch.ldexp(k, -ek.float()), 7.0, lk).reshape(layers, tokens, heads, dim)
    # values: per token over gd channels
    v = x[:, 1].reshape(layers, tokens, heads, dim // gd, gd)
    ev = _exponents(v.abs().amax(-1, keepdim=True), 7.0, floor)
    lv = torch.ldexp(torch.full_like(ev, fmax, dtype=torch.float32), -ev.float())
    qv = _round_within(torch.ldexp(v, -ev.float()), 7.0, lv).reshape(layers, tokens, heads, dim)
    q = (torch.stack([qk, qv], 1).to(torch.int16) + 8).to(torch.uint8)  # 1..15
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return packed, [e.to(torch.int8).view(torch.uint8) for e in (ek, ev)]


def decode(payload: torch.Tensor, codec: Codec, shape: tuple[int, ...], dtype: torch.dtype
           ) -> torch.Tensor:
    """The KV ``payload`` encodes, ``[layers, 2, tokens, heads, head_dim]`` of ``dtype``, on
    the payload's device. A payload of the wrong size, or an exponent no encoder writes, is
    a :class:`ChunkFormatError` (a chunk that is not what its header says)."""
    if dtype not in _FLOATS:
        raise InvalidArgumentError(f"decode into {dtype}: a codec gives float32, bf16 or fp16")
    lay = layout(codec, shape, dtype)
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != lay.nbytes:
        raise ChunkFormatError(
            f"{codec.value} payload of {payload.numel()} {payload.dtype} values for KV of shape "
            f"{lay.shape}: expected {lay.nbytes} bytes")
    if NATIVE and payload.device.type == "cpu" and codec is not Codec.NONE:
        out = torch.empty(lay.shape, dtype=dtype)
        _native_decode(payload.contiguous(), codec, lay, out)
        return out
    return reference_decode(payload, codec, shape, dtype)


def decode_into(payload: torch.Tensor, codec: Codec, out: torch.Tensor) -> None:
    """:func:`decode` into ``out`` (``[layers, 2, tokens, heads, head_dim]`` of the KV's
    dtype, contiguous, on the payload's device): memory that already exists, such as a
    reused scratch buffer, so a restore does not fault in fresh pages per chunk."""
    if not out.is_contiguous() or out.dim() != 5:
        raise InvalidArgumentError("decode_into needs a contiguous [layers, 2, tokens, heads, "
                                   "head_dim] tensor")
    lay = layout(codec, tuple(out.shape), out.dtype)
    if NATIVE and payload.device.type == "cpu" and out.device.type == "cpu" and codec is not Codec.NONE:
        _check_payload(payload, lay)
        _native_decode(payload.contiguous(), codec, lay, out)
        return
    out.copy_(decode(payload, codec, tuple(out.shape), out.dtype))


def decode_layers_into(payload: torch.Tensor, codec: Codec, out: torch.Tensor) -> None:
    """Decode a payload of ``out.shape[0]`` layers each encoded apart (a chunk's, one
    after another: what :func:`encode` of each layer alone gives) into ``out``
    (contiguous ``[layers, 2, tokens, heads, head_dim]``). One native call on the host."""
    layers = out.shape[0]
    one = layout(codec, (1, *out.shape[1:]), out.dtype)
    _check_payload(payload, Layout(codec, one.shape, one.values_nbytes * layers,
                                   one.exponents * layers))
    if not (NATIVE and payload.device.type == "cpu" and out.device.type == "cpu"
            and codec is not Codec.NONE and out.is_contiguous()):
        for i in range(layers):
            decode_into(payload[i * one.nbytes : (i + 1) * one.nbytes], codec, out[i : i + 1])
        return
    assert _native is not None
    payload = payload.contiguous()
    _, two, tokens, heads, dim = one.shape
    k_at, v_at = _exponent_at(one, 0)
    status = _native.decode_layers(_CODEC_CODES[codec], _DTYPE_CODES[out.dtype],
                                   payload.data_ptr(), layers, one.nbytes, k_at, v_at,
                                   tokens, heads, dim, out.data_ptr(),
                                   out[0].numel() * out.element_size())
    if status:
        raise ChunkFormatError(f"{codec.value} {_NATIVE_ERRORS[status]}")


def _check_payload(payload: torch.Tensor, lay: Layout) -> None:
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != lay.nbytes:
        raise ChunkFormatError(
            f"{lay.codec.value} payload of {payload.numel()} {payload.dtype} values for KV of "
            f"shape {lay.shape}: expected {lay.nbytes} bytes")


def reference_decode(payload: torch.Tensor, codec: Codec, shape: tuple[int, ...],
                     dtype: torch.dtype) -> torch.Tensor:
    """:func:`decode` in torch ops (any device): the reference the native kernels match."""
    lay = layout(codec, shape, dtype)
    if codec is Codec.NONE:
        return payload.view(dtype).reshape(lay.shape).clone()
    values, exps = payload[: lay.values_nbytes], payload[lay.values_nbytes :].view(torch.int8)
    if exps.numel() and int(exps.min()) < _EXP_MIN:
        raise ChunkFormatError(f"{codec.value} payload holds an exponent no encoder writes")
    layers, _, tokens, heads, dim = lay.shape
    e = exps.float()
    if codec is Codec.INT4:
        out = _decode_int4(values, e, lay.shape)
    else:
        g = _group(dim) if codec is Codec.FP8 else dim
        if codec is Codec.FP8:
            q = values.view(torch.float8_e4m3fn).float()
        else:
            q = values.view(torch.int8).float()
        q = q.reshape(layers, 2, tokens, heads, dim // g, g)
        out = torch.ldexp(q, e.reshape(layers, 2, tokens, heads, dim // g, 1))
    if not torch.isfinite(out).all():
        raise ChunkFormatError(f"{codec.value} payload decodes to a NaN or an infinity")
    out = out.reshape(lay.shape).to(dtype)
    if not torch.isfinite(out).all():
        raise ChunkFormatError(f"{codec.value} payload decodes to a value past its dtype's range")
    return out


_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_CODEC_CODES = {Codec.FP8: 1, Codec.INT8: 2, Codec.INT4: 3}
_NATIVE_ERRORS = {
    1: "KV holds a NaN or an infinity: it cannot be encoded",
    2: "payload holds an exponent no encoder writes",
    3: "payload holds a value no encoder writes",
    4: "payload decodes to a value past its dtype's range",
    5: "out of memory",
}


def native_error(status: int) -> str:
    """What a native kernel's nonzero status means."""
    return _NATIVE_ERRORS.get(status, f"native status {status}")


def native_id(codec: Codec) -> int:
    """The codec's number in the native kernels (lossy codecs only)."""
    return _CODEC_CODES[codec]


def layer_exponents_at(codec: Codec, layer_shape: tuple[int, ...], dtype: torch.dtype
                       ) -> tuple[int, int]:
    """Where one layer encoded alone (``layer_shape`` ``[2, tokens, heads, head_dim]``)
    keeps its K and V exponents, from the layer's first byte."""
    return _exponent_at(layout(codec, (1, *layer_shape), dtype), 0)


def _per_layer(lay: Layout) -> tuple[int, int, int]:
    """Bytes of one layer's values, of its keys' exponents and of its values' exponents:
    the payload holds every layer's values, then (int4) every layer's key exponents and
    every layer's value exponents, or (fp8, int8) each layer's K then V exponents."""
    layers, _, tokens, heads, dim = lay.shape
    values = lay.values_nbytes // layers
    if lay.codec is Codec.INT4:
        k = tokens // _group(tokens) * heads * dim
        return values, k, tokens * heads * (dim // _group(dim))
    half = lay.exponents // layers // 2
    return values, half, half


def _exponent_at(lay: Layout, layer: int) -> tuple[int, int]:
    """Offsets (from the payload's start) of ``layer``'s K and V exponents."""
    layers = lay.shape[0]
    _, k, v = _per_layer(lay)
    base = lay.values_nbytes
    if lay.codec is Codec.INT4:
        return base + layer * k, base + layers * k + layer * v
    return base + layer * (k + v), base + layer * (k + v) + k


def _native_encode(kv: torch.Tensor, codec: Codec, lay: Layout) -> torch.Tensor:
    assert _native is not None
    out = torch.empty(lay.nbytes, dtype=torch.uint8)
    layers, _, tokens, heads, dim = lay.shape
    values, _, _ = _per_layer(lay)
    step = kv[0].numel() * kv.element_size()
    base = out.data_ptr()
    for i in range(layers):
        ek, ev = _exponent_at(lay, i)
        status = _native.encode(_CODEC_CODES[codec], _DTYPE_CODES[kv.dtype],
                                kv.data_ptr() + i * step, tokens, heads, dim,
                                base + i * values, base + ek, base + ev)
        if status:
            raise InvalidArgumentError(_NATIVE_ERRORS[status])
    return out


def _native_decode(payload: torch.Tensor, codec: Codec, lay: Layout, out: torch.Tensor) -> None:
    assert _native is not None
    dtype = out.dtype
    layers, _, tokens, heads, dim = lay.shape
    values, _, _ = _per_layer(lay)
    step = out[0].numel() * out.element_size()
    base = payload.data_ptr()
    for i in range(layers):
        ek, ev = _exponent_at(lay, i)
        status = _native.decode(_CODEC_CODES[codec], _DTYPE_CODES[dtype], base + i * values,
                                base + ek, base + ev, tokens, heads, dim,
                                out.data_ptr() + i * step)
        if status:
            raise ChunkFormatError(f"{codec.value} {_NATIVE_ERRORS[status]}")


def _decode_int4(values: torch.Tensor, e: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    layers, _, tokens, heads, dim = shape
    gt, gd = _group(tokens), _group(dim)
    packed = values.reshape(layers, 2, tokens, heads, dim // 2)
    q = torch.stack([packed & 0xF, packed >> 4], -1).reshape(layers, 2, tokens, heads, dim)
    q = q.to(torch.int16) - 8
    if int(q.min()) < -7:
        raise ChunkFormatError("int4 payload holds a value no encoder writes")
    q = q.float()
    nk = layers * (tokens // gt) * heads * dim
    ek = e[:nk].reshape(layers, tokens // gt, 1, heads, dim)
    ev = e[nk:].reshape(layers, tokens, heads, dim // gd, 1)
    k = torch.ldexp(q[:, 0].reshape(layers, tokens // gt, gt, heads, dim), ek)
    v = torch.ldexp(q[:, 1].reshape(layers, tokens, heads, dim // gd, gd), ev)
    return torch.stack([k.reshape(layers, tokens, heads, dim),
                        v.reshape(layers, tokens, heads, dim)], 1)
