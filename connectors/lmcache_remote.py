"""kvtier as LMCache's remote backend: a ``RemoteConnector`` that keeps LMCache's chunks in
a running ``kvtier serve`` (its chunk data plane), plugged in through LMCache's own
remote-storage plug-in point. Install with ``pip install 'kvtier[lmcache]'``.

LMCache configuration (YAML or ``LMCACHE_*`` variables)::

    remote_url: "kvtier://127.0.0.1:8100"
    remote_serde: "naive"
    remote_storage_plugins: ["kvtier"]
    extra_config:
      remote_storage_plugin.kvtier.module_path: kvtier.connectors.lmcache_remote
      remote_storage_plugin.kvtier.class_name: KVTierAdapter
      kvtier_token: "..."            # when the server asks for a bearer token
      kvtier_fingerprint_salt: "..."  # optional: KV under another salt is never shared
      kvtier_accept_codecs: "none"    # optional: exact KV only (default: what the server's
                                      # tiers write, e.g. tiers.disk_codec: int8)

Each LMCache chunk becomes one kvtier chunk: its bytes are the payload (checksummed per
chunk by kvtier's format, so a corrupted chunk is a miss, never wrong KV), and LMCache's
own metadata (length, shapes, dtypes, memory format) rides in the header's fingerprint
field, so a read allocates exactly what was stored, partial chunks included. LMCache's key
string is hashed (xxh3-128) into a kvtier key. ``batched_contains`` is one prefix lookup.

Codecs (issue 33): a chunk of KV in one of LMCache's K/V-major formats (``KV_2LTD``,
``KV_2TD``) of a float dtype is stored as the KV it is (``[1, 2, layers x tokens, 1,
hidden]``), so a server tier that keeps chunks compressed (``tiers.disk_codec: int8``)
encodes it, and a read decodes it back into LMCache's memory object; the backend takes
only the codecs ``kvtier_accept_codecs`` names (the server's own by default). Any other
format is stored *opaque*: its bytes as they are, never re-encoded by any tier.

The key names the model as kvtier's own fingerprint does (:func:`backend_identity`).
LMCache's key holds the model's name, world size, worker and dtype, not its weights: two
checkpoints served under one name (a fine-tune, a new revision at the same path) would
share KV. So the hash also covers the weights' digest where the model name is a local
checkpoint (computed once, kept beside it: :mod:`kvtier.models.weights_digest`), the KV
shape, and an optional salt; KV stored under another identity is a miss.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
import xxhash
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.protocol import RemoteMetadata
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvtier.chunk_format import (
    DTYPE_NAMES,
    byte_view,
    check_codec,
    decode_layers,
    encode_chunk,
    parse_header,
    validate_chunk,
)
from kvtier.client import AsyncClient, Client, ServiceError
from kvtier.connectors.chunk_store import accept_codecs
from kvtier.errors import ChunkError
from kvtier.io_priority import background_io
from kvtier.models.weights_digest import checkpoint_digest

log = logging.getLogger(__name__)

SCHEME = "kvtier://"
FP_PREFIX = b"lmcache|"


def backend_identity(metadata: Any, extra: dict[str, Any]) -> str:
    """What names the model beyond LMCache's own key: its weights (a local checkpoint's
    digest, else the name LMCache was given), its KV shape, and the optional salt."""
    name = str(getattr(metadata, "model_name", "") or "")
    digest = checkpoint_digest(name) if name and Path(name).is_dir() else None
    weights = f"w{digest}" if digest else f"name{len(name)}:{name}"
    shape = "x".join(str(d) for d in (getattr(metadata, "kv_shape", None) or ()))
    salt = extra.get("kvtier_fingerprint_salt")
    salted = f"salt{len(str(salt))}:{salt}" if salt else "nosalt"
    return f"{weights}|kv{shape}|{salted}"


def kvtier_key(key: Any, identity: str = "") -> str:
    """The kvtier chunk key of an LMCache ``CacheEngineKey`` (any string form) under a
    backend identity (see :func:`backend_identity`)."""
    text = key.to_string() if hasattr(key, "to_string") else str(key)
    return "lmc-" + xxhash.xxh3_128_hexdigest(identity.encode() + b"\0" + text.encode())


def http_url(url: str) -> str:
    if not url.startswith(SCHEME):
        raise ValueError(f"a kvtier remote_url looks like kvtier://host:port, got {url!r}")
    return "http://" + url[len(SCHEME) :].split("/", 1)[0]


def kv_view(data: bytes, meta: RemoteMetadata) -> torch.Tensor | None:
    """LMCache's bytes as kvtier KV ``[1, 2, layers x tokens, 1, hidden]`` where its
    format keeps K apart from V (``[2, layers, tokens, hidden]`` or ``[2, tokens,
    hidden]``) in a float dtype and the bytes are exactly that tensor; else None."""
    shapes, dtypes = list(meta.shapes), list(meta.dtypes)
    if len(shapes) != 1 or len(dtypes) != 1 or dtypes[0] not in DTYPE_NAMES:
        return None
    shape = [int(d) for d in shapes[0]]
    fmt = meta.fmt
    if not ((fmt == MemoryFormat.KV_2LTD and len(shape) == 4)
            or (fmt == MemoryFormat.KV_2TD and len(shape) == 3)) or shape[0] != 2:
        return None
    if math.prod(shape) * dtypes[0].itemsize != len(data) or min(shape) < 1:
        return None
    rows = math.prod(shape[1:-1])
    return torch.frombuffer(bytearray(data), dtype=dtypes[0]).view(1, 2, rows, 1, shape[-1])


def encode(key: str, data: bytes, meta: RemoteMetadata) -> bytes:
    """A kvtier chunk carrying LMCache's bytes; its metadata rides in the fingerprint. KV a
    tier may compress (:func:`kv_view`), else opaque: a nominal fp16 shape only sizes
    LMCache's bytes (whatever their dtype and layout) and no tier re-encodes them."""
    fp = FP_PREFIX + meta.serialize()
    kv = kv_view(data, meta)
    if kv is not None:
        return encode_chunk(key, fp, kv)
    if len(data) % 4:
        raise ChunkError(f"an LMCache chunk of {len(data)} bytes is not a whole number of words")
    nominal = torch.frombuffer(bytearray(data), dtype=torch.float16).view(1, 2, -1, 1, 1)
    return encode_chunk(key, fp, nominal, opaque=True)


def decode(key: str, blob: bytes, codecs: Collection[str] | None = None
           ) -> tuple[RemoteMetadata, memoryview]:
    """LMCache's metadata and bytes from a verified chunk, a compressed one decoded
    (raises ChunkError; a chunk of a codec not in ``codecs``, where given, is refused)."""
    header = validate_chunk(blob, key, any_namespace=True)  # the service checked its tenant
    if not header.fingerprint.startswith(FP_PREFIX):
        raise ChunkError(f"chunk {key} was not stored by LMCache")
    check_codec(header, codecs)
    meta = RemoteMetadata.deserialize(header.fingerprint[len(FP_PREFIX) :])
    _, offset = parse_header(blob)
    payload = memoryview(blob)[offset:]
    if header.lossy:
        kv = decode_layers(byte_view(payload), header)
        payload = memoryview(kv.reshape(-1).view(torch.uint8).numpy())
        if len(payload) != meta.length:
            raise ChunkError(f"chunk {key}: metadata says {meta.length} bytes, its KV is "
                             f"{len(payload)}")
    if meta.length > len(payload):
        raise ChunkError(f"chunk {key}: metadata says {meta.length} bytes, payload holds fewer")
    return meta, payload[: meta.length]


class KVTierRemoteConnector(RemoteConnector):
    def __init__(self, url: str, loop: asyncio.AbstractEventLoop, local_cpu_backend, config):
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        extra = (config.extra_config if config is not None else None) or {}
        self.base_url = http_url(url)
        self.token = extra.get("kvtier_token")
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.identity = backend_identity(local_cpu_backend.metadata, extra)
        self.accept = accept_codecs({"accept_codecs": extra.get("kvtier_accept_codecs")})
        """The codecs of stored KV this backend takes (None: what the server's tiers write)."""
        self.sync = Client(self.base_url, token=self.token, accept_codecs=self.accept)
        self._async: AsyncClient | None = None

    @property
    def client(self) -> AsyncClient:
        if self._async is None:  # created on LMCache's event loop, where it is used
            self._async = AsyncClient(self.base_url, token=self.token, accept_codecs=self.accept)
        return self._async

    def _key(self, key: Any) -> str:
        return kvtier_key(key, self.identity)

    async def exists(self, key) -> bool:
        return await self.client.has_chunk(self._key(key))

    def exists_sync(self, key) -> bool:
        return self.sync.has_chunk(self._key(key))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys) -> int:
        return self.sync.lookup([self._key(k) for k in keys]).length if keys else 0

    async def get(self, key):
        k = self._key(key)
        blob = await self.client.get_chunk(k)
        if blob is None:
            return None
        try:
            meta, data = decode(k, blob, self.accept)
        except ChunkError as exc:
            log.warning("kvtier: refusing chunk for %s: %s", key, exc)
            return None
        memory_obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
        if memory_obj is None:
            return None
        target = memory_obj.byte_array
        view = target if isinstance(target, memoryview) else memoryview(target)
        view = view.cast("B")
        view[: len(data)] = data
        return self.reshape_partial_chunk(memory_obj, len(data))

    async def put(self, key, memory_obj) -> None:
        data = bytes(memory_obj.byte_array)
        meta = RemoteMetadata(
            len(data),
            memory_obj.get_shapes(),
            memory_obj.get_dtypes(),
            memory_obj.get_memory_format(),
        )
        k = self._key(key)
        try:
            with background_io():  # LMCache stores off the request path
                await self.client.put_chunk(k, encode(k, data, meta))
        except ServiceError as exc:
            if exc.status != 409:
                raise
            # Another writer stored this chunk first (chunks are immutable, one version per
            # key): KV of the same tokens by the same model, kept as it is.
            log.debug("chunk %s stored already by another writer: %s", k, exc)

    async def list(self) -> list[str]:
        return []  # kvtier keys are hashes of LMCache's: they cannot be listed back

    async def close(self) -> None:
        if self._async is not None:
            await self._async.aclose()
        self.sync.close()


class KVTierAdapter(ConnectorAdapter):
    """LMCache's adapter for ``kvtier://host:port`` remote URLs."""

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        return KVTierRemoteConnector(
            context.url, context.loop, context.local_cpu_backend, context.config
        )
