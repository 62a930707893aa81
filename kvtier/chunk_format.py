"""The on-wire and on-disk form of a KV chunk: one self-describing blob.

    b"KVTC" | u32 header length | msgpack header | payload

The payload is the raw tensor ``[layers, 2 (K, V), tokens, kv_heads, head_dim]``, layer-major,
so a layer range is one contiguous byte range. The header carries the format version, the
chunk key, the model fingerprint, dtype, shape, token count, the first layer held (a
layer-range read is itself a valid chunk) and an xxh3 checksum per layer, so a partial read
can still be verified. No pickle and no per-element encoding: the payload is the tensor's
memory. A chunk stored for a tenant of the service also names that tenant (``ns``) inside
the checksummed header (:func:`bind_namespace`), so its bytes are served under that tenant's
keys only, whatever name a file or value is given.

A chunk can also be written *in place* (:func:`encode_into`) into memory that already
exists (a tier's slot): the payload is copied (or gathered) straight to its final place,
its checksums are computed there, and the header is packed last, padded by a ``pad``
entry that readers ignore to a size fixed in advance, so the payload's offset is known
before its checksums are. That offset is a multiple of :data:`PAYLOAD_ALIGN`, so the
payload can be read back as a tensor view (:func:`chunk_view`) with no copy.
"""

from __future__ import annotations

import functools
import re
import struct
import threading
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

import msgpack
import numpy as np
import torch
import xxhash

from kvtier import kv_codecs
from kvtier.errors import ChunkFormatError, ChunkMismatchError, InvalidArgumentError
from kvtier.layer_sums import first_bad_layer, layer_sums

MAGIC = b"KVTC"
FORMAT_VERSION = 2
"""2: the header carries ``hxh``, a checksum of its own fields (1 had none)."""
_PREFIX = struct.Struct("<4sI")
MAX_HEADER_BYTES = 1 << 16
PAYLOAD_ALIGN = 64
"""In-place chunks start their payload at a multiple of this many bytes."""
_U64_MAX = (1 << 64) - 1
NAMESPACE_SEP = "."
"""Joins a namespace and a chunk key into the key a tier stores under (``tenant.key``).
Chunk keys never contain it, so the service files every client's chunks in that client's
namespace, and the engine's own chunks (bare keys) in none a client can write or read."""
STORAGE_KEY_PATTERN = r"(?:[0-9A-Za-z]{1,32}\.)?[0-9A-Za-z_-]{2,200}"
STORAGE_KEY_RE = re.compile(STORAGE_KEY_PATTERN)
"""What a tier stores under: a chunk key, optionally in a namespace (use ``fullmatch``)."""


def namespaced_key(namespace: str, key: str) -> str:
    return f"{namespace}{NAMESPACE_SEP}{key}"


def logical_key(storage_key: str) -> str:
    """The chunk key a blob stored under ``storage_key`` must name in its header."""
    return storage_key.rpartition(NAMESPACE_SEP)[2]


def storage_namespace(storage_key: str) -> str | None:
    """The namespace a blob stored under ``storage_key`` must name in its header (None:
    none, the engine's own chunks)."""
    ns, sep, _ = storage_key.rpartition(NAMESPACE_SEP)
    return ns if sep else None


NAMESPACE_RE = re.compile(r"[0-9A-Za-z]{1,32}")


def check_names(header: ChunkHeader, key: str, any_namespace: bool = False) -> None:
    """``header`` is the chunk to be found under storage key ``key``: the same chunk key
    and (unless ``any_namespace``: a reader that got the chunk from a service, which
    checked it against its own namespace) the same namespace."""
    if header.key != logical_key(key):
        raise ChunkMismatchError(f"chunk stored under {key} holds {header.key}")
    if not any_namespace and header.namespace != storage_namespace(key):
        raise ChunkMismatchError(
            f"chunk {header.key} belongs to namespace {header.namespace!r}, not to "
            f"{storage_namespace(key)!r} (it was stored for another tenant)")
_HEADER_KEYS = frozenset({"v", "key", "fp", "dtype", "shape", "tokens", "l0", "xxh", "hxh",
                          "ns", "codec", "op", "pad", "padd"})
"""Every field a header may hold ("pad"/"padd": filler, the only bytes no checksum covers,
meaningless by construction)."""
_CODECS = kv_codecs.CODEC_NAMES
_packer = msgpack.Packer(use_bin_type=True, autoreset=True)
_packer_lock = threading.Lock()


def _packb(obj: object) -> bytes:
    """msgpack with one shared Packer: ``msgpack.packb`` makes a new Packer, and with it a
    256 KiB buffer, on every call (a per-thread one would on every new I/O thread); a
    header is a few hundred bytes, packed in microseconds."""
    with _packer_lock:
        return _packer.pack(obj)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
"""The KV dtypes kvtier stores and computes in, by name: the one table of them (the pool,
the kernels, the engine, make-model and the CLI read it from here)."""
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
DTYPE_BYTES: dict[str, int] = {k: v.itemsize for k, v in DTYPES.items()}


@dataclass(frozen=True)
class ChunkHeader:
    key: str
    fingerprint: bytes
    dtype: str
    shape: tuple[int, ...]
    """``[layers held, 2, tokens, kv_heads, head_dim]``."""
    num_tokens: int
    layer_checksums: tuple[int, ...]
    first_layer: int = 0
    version: int = FORMAT_VERSION
    namespace: str | None = None
    """The tenant the chunk was stored for (None: none, the engine's own chunks)."""
    codec: str = "none"
    """How the payload holds the KV (:mod:`kvtier.kv_codecs`): ``none``, the KV of
    ``dtype`` as it is; else each layer encoded apart (so a layer range is still one byte
    range), the checksums over the encoded bytes. ``dtype`` and ``shape`` are the KV's."""
    opaque: bool = False
    """The payload is a client's bytes in a layout of its own (an LMCache memory object),
    kept under kvtier's checksums; ``dtype`` and ``shape`` only size it. A tier never
    re-encodes such a chunk by its codec: the values are not KV of that shape."""

    @property
    def num_layers(self) -> int:
        return self.shape[0]

    @property
    def lossy(self) -> bool:
        return self.codec != "none"

    @property
    def layer_nbytes(self) -> int:
        if self.lossy:
            return _codec_layer_nbytes(self.codec, tuple(self.shape[1:]), self.dtype)
        per = DTYPES[self.dtype].itemsize
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n * per

    @property
    def payload_nbytes(self) -> int:
        return self.layer_nbytes * self.num_layers

    def identity_checksum(self) -> int:
        """xxh3 of every field a reader relies on (the payload's checksums included), so
        no byte of a served chunk is outside a checksum: a flipped ``fp`` or ``l0`` is
        caught like a flipped payload byte."""
        fields: list = [self.version, self.key, self.fingerprint, self.dtype, list(self.shape),
                        self.num_tokens, self.first_layer, list(self.layer_checksums)]
        if self.namespace is not None:
            fields.append(self.namespace)
        if self.lossy:
            fields.append(self.codec)
        if self.opaque:
            fields.append("opaque")
        return xxhash.xxh3_64_intdigest(_packb(fields))

    def fields(self) -> dict:
        out = {
            "v": self.version,
            "key": self.key,
            "fp": self.fingerprint,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "tokens": self.num_tokens,
            "l0": self.first_layer,
            "xxh": list(self.layer_checksums),
            "hxh": self.identity_checksum(),
        }
        if self.namespace is not None:
            out["ns"] = self.namespace
        if self.lossy:
            out["codec"] = self.codec
        if self.opaque:
            out["op"] = True
        return out

    def pack(self) -> bytes:
        return _packb(self.fields())

    def pack_to(self, size: int) -> bytes:
        """The header packed to exactly ``size`` bytes, padded by a ``pad`` entry (every
        reader ignores unknown entries, so padded chunks read as any other)."""
        fields = self.fields()
        for key in ("pad", "padd"):  # a one-byte-longer key fills the size bin8/bin16 skip
            base = len(_packb({**fields, key: b""}))
            n = size - base
            if n > 255:
                n -= 1  # bin16's length field is one byte longer than bin8's
            if n < 0:
                break
            out = _packb({**fields, key: bytes(n)})
            if len(out) == size:
                return out
        raise ChunkFormatError(f"chunk {self.key}: header does not fit in {size} bytes")


@functools.lru_cache(maxsize=256)
def _codec_layer_nbytes(codec: str, layer_shape: tuple[int, ...], dtype: str) -> int:
    """Encoded bytes of one layer of KV (``[2, tokens, heads, head_dim]``)."""
    try:
        return kv_codecs.layout(kv_codecs.Codec.parse(codec), (1, *layer_shape),
                                DTYPES[dtype]).nbytes
    except InvalidArgumentError as exc:
        raise ChunkFormatError(f"chunk of codec {codec!r}: {exc}") from None


def encode_layers(kv: torch.Tensor, codec: kv_codecs.Codec) -> torch.Tensor:
    """The payload of a ``codec`` chunk holding ``kv`` (``[layers, 2, tokens, heads,
    head_dim]``): each layer encoded apart, one after the other (uint8, on ``kv``'s
    device)."""
    if kv.device.type != "cpu":  # all layers in one pass of torch ops (few launches)
        return kv_codecs.encode_each_layer(kv, codec)
    return torch.cat([kv_codecs.encode(kv[i : i + 1], codec) for i in range(kv.shape[0])])


def decode_layers(payload: torch.Tensor, header: ChunkHeader, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """The KV ``[layers, 2, tokens, heads, head_dim]`` of ``header``'s dtype that the
    payload of a lossy chunk (every layer ``header`` names, encoded) holds: into ``out``
    (contiguous, of that shape and dtype) or a new tensor. Bytes no encoder writes are a
    :class:`ChunkFormatError`."""
    codec = kv_codecs.Codec.parse(header.codec)
    dtype, step = DTYPES[header.dtype], header.layer_nbytes
    if payload.numel() != step * header.num_layers:
        raise ChunkFormatError(f"chunk {header.key}: {payload.numel()} payload bytes for "
                               f"{header.num_layers} {header.codec} layers of {step}")
    if out is None:
        out = torch.empty(header.shape, dtype=dtype)
    elif tuple(out.shape) != tuple(header.shape) or out.dtype != dtype:
        raise ChunkFormatError(f"chunk {header.key}: decode into {tuple(out.shape)} "
                               f"{out.dtype}, not {header.shape} {header.dtype}")
    kv_codecs.decode_layers_into(payload, codec, out)
    return out


def _layer_checksums(payload: memoryview, num_layers: int) -> tuple[int, ...]:
    return layer_sums(payload, num_layers)


def encode_chunk(key: str, fingerprint: bytes, kv: torch.Tensor,
                 codec: kv_codecs.Codec = kv_codecs.Codec.NONE, opaque: bool = False) -> bytes:
    """Serialise ``kv`` (``[layers, 2, tokens, kv_heads, head_dim]``, any device), its
    payload encoded by ``codec`` (on ``kv``'s device). ``key`` may be a storage key (``tenant.key``): the chunk
    then names that namespace too. ``opaque``: ``kv`` only carries a client's bytes
    (:attr:`ChunkHeader.opaque`)."""
    if opaque and codec is not kv_codecs.Codec.NONE:
        raise ChunkFormatError("an opaque chunk's bytes are stored as they are (no codec)")
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ChunkFormatError(
            f"a chunk tensor must be [layers, 2, tokens, kv_heads, head_dim], got {tuple(kv.shape)}"
        )
    if kv.dtype not in DTYPE_NAMES:
        raise ChunkFormatError(f"unsupported chunk dtype {kv.dtype}; use {sorted(DTYPES)}")
    if codec is kv_codecs.Codec.NONE:
        data = kv.detach().to("cpu").contiguous().view(torch.uint8)
    else:  # encoded where the KV is (on a GPU: only the encoded bytes cross)
        data = encode_layers(kv.detach().contiguous(), codec).to("cpu")
    payload = memoryview(data.numpy()).cast("B")
    header = ChunkHeader(
        key=logical_key(key),
        namespace=storage_namespace(key),
        fingerprint=bytes(fingerprint),
        dtype=DTYPE_NAMES[kv.dtype],
        shape=tuple(kv.shape),
        num_tokens=int(kv.shape[2]),
        layer_checksums=_layer_checksums(payload, kv.shape[0]),
        codec=codec.value,
        opaque=opaque,
    )
    packed = header.pack()
    return b"".join((_PREFIX.pack(MAGIC, len(packed)), packed, payload))


with warnings.catch_warnings():
    # torch warns (once per process) that a tensor over a read-only buffer must not be
    # written; kvtier only ever reads such tensors (the source of a copy).
    warnings.simplefilter("ignore", UserWarning)
    torch.from_numpy(np.frombuffer(b"\0", dtype=np.uint8))


def byte_view(blob: bytes | bytearray | memoryview) -> torch.Tensor:
    """A uint8 tensor over ``blob``'s memory (no copy); read-only buffers are only read."""
    return torch.from_numpy(np.frombuffer(blob, dtype=np.uint8))


MAX_KEY_CHARS = 200
"""The longest chunk key (``[0-9A-Za-z_-]{2,200}``)."""
MAX_FINGERPRINT_BYTES = 1024
"""The longest model fingerprint a slot is sized for (kvtier's are 32 bytes; the LMCache
backend's carry LMCache's metadata)."""


@functools.lru_cache(maxsize=64)
def _max_head_bytes(num_layers: int) -> int:
    worst = ChunkHeader("k" * MAX_KEY_CHARS, bytes(MAX_FINGERPRINT_BYTES), "bfloat16",
                        (num_layers, 2, 1 << 30, 1 << 16, 1 << 16), 1 << 30,
                        (_U64_MAX,) * num_layers, first_layer=1 << 30, namespace="n" * 32,
                        codec="int4")
    longest = len(_packb({**worst.fields(), "hxh": _U64_MAX, "padd": bytes(256)}))
    return -(-(_PREFIX.size + longest) // PAYLOAD_ALIGN) * PAYLOAD_ALIGN + PAYLOAD_ALIGN


def max_chunk_bytes(num_layers: int, payload_nbytes: int) -> int:
    """The most bytes a chunk of ``num_layers`` layers and ``payload_nbytes`` of KV takes,
    header included, however it is encoded (:func:`encode_chunk`, :func:`encode_into`,
    bound to a tenant): what a tier's slot or a staging buffer for it must hold."""
    return _max_head_bytes(num_layers) + payload_nbytes


def kv_payload_bytes(num_layers: int, tokens: int, kv_heads: int, head_dim: int,
                     elem_bytes: int) -> int:
    """Bytes of a chunk's KV: ``[layers, 2, tokens, kv_heads, head_dim]`` elements."""
    return 2 * num_layers * tokens * kv_heads * head_dim * elem_bytes


def chunk_layout(
    key: str, fingerprint: bytes, dtype: torch.dtype, shape: tuple[int, ...]
) -> tuple[int, int]:
    """(payload offset, total bytes) of a chunk :func:`encode_into` writes: what a slot
    must hold, and where the payload goes, before the payload is known."""
    if len(shape) != 5 or shape[1] != 2:
        raise ChunkFormatError(f"a chunk is [layers, 2, tokens, kv_heads, head_dim], got {shape}")
    if dtype not in DTYPE_NAMES:
        raise ChunkFormatError(f"unsupported chunk dtype {dtype}; use {sorted(DTYPES)}")
    return _layout(len(logical_key(key)), storage_namespace(key), bytes(fingerprint), dtype,
                   tuple(shape))


@functools.lru_cache(maxsize=1024)
def _layout(key_chars: int, namespace: str | None, fingerprint: bytes, dtype: torch.dtype,
            shape: tuple[int, ...]) -> tuple[int, int]:
    """:func:`chunk_layout` of every key of ``key_chars`` characters (a packed string's
    size depends on its length only): the largest header its chunks can have, packed once
    per shape, not once per chunk."""
    worst = ChunkHeader("k" * key_chars, fingerprint, DTYPE_NAMES[dtype], shape, shape[2],
                        (_U64_MAX,) * shape[0], namespace=namespace)
    longest = len(_packb({**worst.fields(), "hxh": _U64_MAX, "padd": bytes(256)}))
    offset = -(-(_PREFIX.size + longest - 256 + 3) // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
    payload = dtype.itemsize * shape[0] * 2 * shape[2] * shape[3] * shape[4]
    return offset, offset + payload


def encode_into(
    dest: torch.Tensor,
    key: str,
    fingerprint: bytes,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    fill: Callable[..., None],
    group_bytes: int | None = None,
) -> int:
    """Write a chunk into ``dest`` (a contiguous CPU uint8 tensor at least
    :func:`chunk_layout`'s total long, e.g. a tier's slot): ``fill(payload)`` writes the
    KV into its final place (``payload`` is a ``shape``/``dtype`` view of ``dest``: a
    gather from the pool, or a copy), then the checksums are computed there and the header
    written in front. Nothing chunk-sized is allocated. Returns the chunk's length.

    With ``group_bytes``, the payload is filled a group of layers of about that many
    bytes at a time, ``fill(part, start, end)`` for layers ``[start, end)``, and each
    group is checksummed right after, while it is still in the CPU's cache: the payload
    crosses memory once, not twice.

    A ``fill`` that checksums the bytes as it writes them (a fused native copy) returns
    the xxh3 of each layer it wrote as a tuple; after any other (None, the tensor it
    filled) the checksums are computed here."""
    offset, total = chunk_layout(key, fingerprint, dtype, shape)
    if dest.dtype != torch.uint8 or dest.dim() != 1 or not dest.is_contiguous():
        raise ChunkFormatError("encode_into needs a contiguous 1-D uint8 tensor")
    if dest.numel() < total:
        raise ChunkFormatError(f"chunk {key} needs {total} bytes, the buffer has {dest.numel()}")
    if dest.device.type != "cpu":
        raise ChunkFormatError("encode_into writes host memory; gather into a pinned slot")
    region = dest[offset:total]
    kv = region.view(dtype).view(shape)
    payload = memoryview(region.numpy()).cast("B")
    layers = shape[0]
    if group_bytes is None:
        got = fill(kv)
        sums = got if isinstance(got, tuple) else _layer_checksums(payload, layers)
    else:
        step = len(payload) // layers if layers else 0
        per = max(1, group_bytes // step) if step else layers
        sums = ()
        for a in range(0, layers, per):
            b = min(a + per, layers)
            got = fill(kv[a:b], a, b)
            sums += got if isinstance(got, tuple) else _layer_checksums(
                payload[a * step : b * step], b - a)
    if len(sums) != layers:
        raise ChunkFormatError(f"chunk {key}: {len(sums)} checksums for {layers} layers")
    header = ChunkHeader(
        key=logical_key(key),
        namespace=storage_namespace(key),
        fingerprint=bytes(fingerprint),
        dtype=DTYPE_NAMES[dtype],
        shape=tuple(shape),
        num_tokens=int(shape[2]),
        layer_checksums=sums,
    )
    return write_header(dest, header, offset)


def chunk_view(
    buf: torch.Tensor,
    key: str | None = None,
    fingerprint: bytes | None = None,
    layers: tuple[int, int] | None = None,
    verify: bool = True,
    as_kv: bool = True,
    any_namespace: bool = False,
    codecs: Collection[str] | None = None,
) -> tuple[ChunkHeader, torch.Tensor]:
    """Verify the chunk in ``buf`` (a 1-D uint8 CPU tensor holding exactly one chunk) and
    return its KV, or only the model's layers ``[start, end)`` of it (only their checksums
    are read; a chunk that holds a layer range, from its ``first_layer`` on, is indexed by
    model layer too, so a tier may hand out the whole chunk or just the range asked for),
    as a *view* of ``buf`` (no copy) where the payload is aligned for its dtype, as
    :func:`encode_into` writes it; a copy otherwise. The view is only as stable as ``buf``:
    hold the tier's lease on it while reading. ``verify=False`` skips the checksums, for a
    chunk its reader verified already (key, model and length are still checked).
    ``as_kv=False``: only check; the payload is returned as the bytes it is (uint8, a view
    even where it is unaligned: for a reader that sends the chunk on as it is). A chunk
    whose codec is not in ``codecs`` (where given) is a :class:`ChunkMismatchError`: a
    reader that wants exact KV is never given lossy KV."""
    mem = memoryview(buf.numpy()).cast("B")
    header, offset = parse_header(mem)
    if len(mem) - offset != header.payload_nbytes:
        raise ChunkFormatError(
            f"chunk {header.key}: payload is {len(mem) - offset} bytes, header says "
            f"{header.payload_nbytes} (truncated or padded)"
        )
    f = header.first_layer
    start, end = (0, header.num_layers) if layers is None else (layers[0] - f, layers[1] - f)
    span_start, span_len = layer_span(header, (start, end))
    if verify:
        check_layers(buf, header, start, end)
    if key is not None:
        check_names(header, key, any_namespace)
    if fingerprint is not None and header.fingerprint != fingerprint:
        raise ChunkMismatchError(f"chunk {header.key} was computed by another model")
    check_codec(header, codecs)
    dtype = DTYPES[header.dtype]
    payload = buf[offset + span_start : offset + span_start + span_len]
    if not as_kv:
        return range_header(header, (start, end)), payload
    if header.lossy:  # decoded into a new tensor
        header = range_header(header, (start, end))
        return header, decode_layers(payload, header)
    if (payload.storage_offset()) % dtype.itemsize:
        payload = payload.clone()  # an older chunk with an unaligned payload
    header = range_header(header, (start, end))
    return header, payload.view(dtype).view(header.shape)


def check_codec(header: ChunkHeader, codecs: Collection[str] | None) -> None:
    """A :class:`ChunkMismatchError` where ``header``'s codec is not one of ``codecs``
    (None: any)."""
    if codecs is not None and header.codec not in codecs:
        raise ChunkMismatchError(
            f"chunk {header.key} holds {header.codec} KV; this reader takes "
            f"{', '.join(sorted(codecs))} only")


def check_layers(buf: torch.Tensor, header: ChunkHeader, start: int, end: int) -> None:
    """Verify the checksums of layers ``[start, end)`` (indices into ``header``'s layers)
    of the chunk in ``buf`` (what :func:`chunk_view` with ``verify=False`` read the header
    of): a reader that checks each group of layers right before it copies them reads the
    bytes once, from cache, where a whole-chunk check first reads them twice."""
    mem = memoryview(buf.numpy()).cast("B")
    offset = len(mem) - header.payload_nbytes
    step = header.layer_nbytes
    part = mem[offset + start * step : offset + end * step]
    if first_bad_layer(part, header.layer_checksums[start:end]) >= 0:
        raise ChunkFormatError(f"chunk {header.key}: checksum mismatch (corrupted bytes)")


def parse_header(buf: bytes | bytearray | memoryview) -> tuple[ChunkHeader, int]:
    """The header and the payload's offset; raises :class:`ChunkFormatError` if malformed.
    Needs only the first ``8 + header length`` bytes."""
    view = memoryview(buf)
    if len(view) < _PREFIX.size:
        raise ChunkFormatError(f"chunk of {len(view)} bytes is shorter than its fixed prefix")
    magic, hlen = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise ChunkFormatError(f"not a kvtier chunk (magic {bytes(magic)!r})")
    if hlen > MAX_HEADER_BYTES or len(view) < _PREFIX.size + hlen:
        raise ChunkFormatError(f"chunk header length {hlen} is invalid or truncated")
    try:
        raw = msgpack.unpackb(view[_PREFIX.size : _PREFIX.size + hlen], raw=False)
        header = ChunkHeader(
            key=str(raw["key"]),
            fingerprint=bytes(raw["fp"]),
            dtype=str(raw["dtype"]),
            shape=tuple(int(x) for x in raw["shape"]),
            num_tokens=int(raw["tokens"]),
            layer_checksums=tuple(int(x) for x in raw["xxh"]),
            first_layer=int(raw["l0"]),
            version=int(raw["v"]),
            namespace=None if raw.get("ns") is None else str(raw["ns"]),
            codec=str(raw.get("codec", "none")),
            opaque=raw.get("op", False) is True,
        )
        hxh = int(raw["hxh"]) if header.version == FORMAT_VERSION else None
        if header.namespace is not None and not NAMESPACE_RE.fullmatch(header.namespace):
            raise ValueError(f"namespace {header.namespace[:40]!r} is not a tenant name")
        unknown = set(raw) - _HEADER_KEYS
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}")
    except (ValueError, KeyError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
        raise ChunkFormatError(f"chunk header is not valid: {exc}") from None
    if header.version != FORMAT_VERSION:
        raise ChunkFormatError(f"chunk format version {header.version} is not {FORMAT_VERSION}")
    if hxh != header.identity_checksum():
        raise ChunkFormatError(
            f"chunk {header.key[:16]}: header checksum mismatch (corrupted header)"
        )
    if header.dtype not in DTYPES:
        raise ChunkFormatError(f"chunk dtype {header.dtype!r} is not one of {sorted(DTYPES)}")
    if header.codec not in _CODECS or (header.codec == "none" and "codec" in raw):
        raise ChunkFormatError(f"chunk codec {header.codec[:16]!r} is not one of {sorted(_CODECS)}")
    if ("op" in raw and not header.opaque) or (header.opaque and header.lossy):
        raise ChunkFormatError("chunk header is inconsistent: an opaque chunk is stored as it is")
    if (
        len(header.shape) != 5
        or header.shape[1] != 2
        or min(header.shape) < 1
        or header.shape[2] != header.num_tokens
        or len(header.layer_checksums) != header.shape[0]
        or header.first_layer < 0
    ):
        raise ChunkFormatError(f"chunk header is inconsistent: shape {header.shape}")
    return header, _PREFIX.size + hlen


def validate_chunk(
    buf: bytes | bytearray | memoryview,
    key: str | None = None,
    fingerprint: bytes | None = None,
    any_namespace: bool = False,
) -> ChunkHeader:
    """Full check: header, exact length, every layer's checksum, and (if given) key and model.
    ``key`` is a storage key: the chunk must name its namespace too, unless ``any_namespace``
    (a client reading through the service, which checked that)."""
    header, offset = parse_header(buf)
    payload = memoryview(buf)[offset:]
    if len(payload) != header.payload_nbytes:
        raise ChunkFormatError(
            f"chunk {header.key}: payload is {len(payload)} bytes, header says "
            f"{header.payload_nbytes} (truncated or padded)"
        )
    if _layer_checksums(payload, header.num_layers) != header.layer_checksums:
        raise ChunkFormatError(f"chunk {header.key}: checksum mismatch (corrupted bytes)")
    if key is not None:
        check_names(header, key, any_namespace)
    if fingerprint is not None and header.fingerprint != fingerprint:
        raise ChunkMismatchError(f"chunk {header.key} was computed by another model")
    return header


def decode_chunk(
    buf: bytes | bytearray | memoryview,
    key: str | None = None,
    fingerprint: bytes | None = None,
    any_namespace: bool = False,
) -> tuple[ChunkHeader, torch.Tensor]:
    """Verify and return the tensor (a CPU tensor over a copy of the payload, or the
    decoded KV of a lossy chunk)."""
    header = validate_chunk(buf, key, fingerprint, any_namespace)
    offset = len(buf) - header.payload_nbytes
    if header.lossy:
        return header, decode_layers(byte_view(memoryview(buf)[offset:]), header)
    data = bytearray(memoryview(buf)[offset:])
    t = torch.frombuffer(data, dtype=DTYPES[header.dtype]) if data else torch.empty(0)
    return header, t.view(header.shape)


def layer_span(header: ChunkHeader, layers: tuple[int, int]) -> tuple[int, int]:
    """(offset in payload, length) of layers ``[start, end)`` of the chunk's own layers."""
    start, end = layers
    if not 0 <= start < end <= header.num_layers:
        raise ChunkFormatError(
            f"layer range [{start}, {end}) is outside the chunk's {header.num_layers} layers"
        )
    return start * header.layer_nbytes, (end - start) * header.layer_nbytes


def range_header(header: ChunkHeader, layers: tuple[int, int]) -> ChunkHeader:
    """The header of the chunk holding only layers ``[start, end)`` of ``header``'s chunk
    (checksums carried over, so the range is still verified against the writer's)."""
    start, end = layers
    layer_span(header, layers)
    if (start, end) == (0, header.num_layers):
        return header
    return replace(
        header,
        shape=(end - start, *header.shape[1:]),
        layer_checksums=header.layer_checksums[start:end],
        first_layer=header.first_layer + start,
    )


def header_room(header: ChunkHeader) -> int:
    """The smallest payload offset :func:`write_header` can write ``header`` in front of."""
    return _PREFIX.size + len(_packb({**header.fields(), "pad": b""}))


def write_header(dest: torch.Tensor, header: ChunkHeader, payload_offset: int) -> int:
    """Write the prefix and ``header`` (padded) into ``dest[:payload_offset]`` (a uint8
    CPU tensor whose payload is, or will be, at ``payload_offset``); returns the chunk's
    length. Lets a reader land a payload first, where it wants it, and frame it after."""
    packed = header.pack_to(payload_offset - _PREFIX.size)
    head = memoryview(dest[:payload_offset].numpy()).cast("B")
    _PREFIX.pack_into(head, 0, MAGIC, len(packed))
    head[_PREFIX.size : payload_offset] = packed
    return payload_offset + header.payload_nbytes


def slice_chunk(
    header: ChunkHeader, layers: tuple[int, int], payload_part: bytes | memoryview
) -> bytes:
    """A valid chunk holding only layers ``[start, end)``, from their payload bytes (e.g. a
    range read of a stored chunk). Checksums are carried over, not recomputed, so a corrupted
    range is still caught by :func:`validate_chunk`."""
    _, length = layer_span(header, layers)
    if len(payload_part) != length:
        raise ChunkFormatError(f"layer range payload is {len(payload_part)} bytes, expected {length}")
    packed = range_header(header, layers).pack()
    return b"".join((_PREFIX.pack(MAGIC, len(packed)), packed, payload_part))


BIND_SLACK = 4096
"""Bytes in front of a chunk that :func:`bind_namespace` may need (a header grows by the
namespace, rounded to keep the payload's alignment)."""


def bind_namespace(buf: memoryview, start: int, length: int, namespace: str,
                   floor: int = 0) -> tuple[int, int]:
    """Rewrite the header of the chunk at ``buf[start:start + length]`` to name
    ``namespace`` (the tenant it is stored for), in place: the payload does not move; the
    prefix and the new header (padded so the payload keeps its offset modulo
    :data:`PAYLOAD_ALIGN`) are written in front of it, never below ``floor``. Returns the
    rebound chunk's (start, length). No checksum over the payload is recomputed: the
    layer checksums stay, the header checksum covers the namespace. A
    :class:`ChunkFormatError` where the room in front is too small."""
    if not NAMESPACE_RE.fullmatch(namespace):
        raise ChunkFormatError(f"namespace {namespace[:40]!r} is not a tenant name")
    view = buf[start : start + length]
    header, offset = parse_header(view)
    if header.namespace == namespace:
        return start, length
    bound = replace(header, namespace=namespace)
    need = header_room(bound)
    new_offset = offset
    while True:
        if new_offset >= need:
            try:
                packed = bound.pack_to(new_offset - _PREFIX.size)
                break
            except ChunkFormatError:
                pass
        new_offset += PAYLOAD_ALIGN
    new_start = start + offset - new_offset
    if new_start < floor:
        raise ChunkFormatError(f"chunk {header.key}: no room in front of it to name its "
                               f"namespace ({new_offset - offset} bytes needed)")
    _PREFIX.pack_into(buf, new_start, MAGIC, len(packed))
    buf[new_start + _PREFIX.size : start + offset] = packed
    return new_start, length + new_offset - offset


def with_namespace(blob: bytes | bytearray | memoryview, namespace: str) -> bytes:
    """A copy of the chunk ``blob`` naming ``namespace``: what the service stores, and
    serves back, for a chunk a tenant uploaded (see :func:`bind_namespace`)."""
    framed = memoryview(bytearray(BIND_SLACK + len(blob)))
    framed[BIND_SLACK:] = blob
    start, length = bind_namespace(framed, BIND_SLACK, len(blob), namespace)
    return bytes(framed[start : start + length])
