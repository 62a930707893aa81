"""Where an engine connector keeps its chunks: kvtier's tiers in-process, or a running
``kvtier serve`` over HTTP. Both answer the same three calls (prefix lookup, batch get,
batch put), so the vLLM connector and the LMCache backend work with either.

An in-process store is shared by every connector instance of one process that names the
same configuration (vLLM builds a scheduler-side and a worker-side connector; with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` both live in one process and must see one cache).
Across processes, use ``kvtier serve`` (``url``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kvtier.connectors.tiers.blobs import get_blobs, put_blobs
from kvtier.errors import ConfigError


class ChunkStore(Protocol):
    def lookup(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are stored."""

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Verified chunk blobs in key order (None: missing or refused)."""

    def put(self, chunks: Mapping[str, bytes]) -> dict[str, str]:
        """Store chunks; returns the keys that failed, with why."""

    def close(self) -> None: ...


class LocalChunkStore:
    """kvtier's tier stack (CPU arena, disk, Redis as configured) in this process."""

    def __init__(self, manager) -> None:
        self.manager = manager

    def lookup(self, keys: Sequence[str]) -> int:
        return self.manager.lookup(keys).length

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return get_blobs(self.manager, keys)

    def put(self, chunks: Mapping[str, bytes]) -> dict[str, str]:
        return dict(put_blobs(self.manager, chunks).failed)

    def close(self) -> None:  # shared: closed when the process exits
        pass


class RemoteChunkStore:
    """A running ``kvtier serve`` (sidecar or engine mode) through its chunk data plane."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0) -> None:
        from kvtier.client import Client

        self.client = Client(url, token=token, timeout=timeout)

    def lookup(self, keys: Sequence[str]) -> int:
        return self.client.lookup(keys).length if keys else 0

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        return self.client.get_chunks(keys) if keys else []

    def put(self, chunks: Mapping[str, bytes]) -> dict[str, str]:
        """Keys no tier stored, with why. A ``conflict`` is not among them: another writer
        stored that key first (one version per key), so its KV is there to load."""
        failed = self.client.put_chunks(chunks)["failed"] if chunks else {}
        return {k: why for k, why in failed.items() if not why.startswith("conflict:")}

    def close(self) -> None:
        self.client.close()


_LOCAL: dict[str, LocalChunkStore] = {}
_LOCAL_LOCK = threading.Lock()


def open_store(options: Mapping[str, Any], slot_bytes: int) -> ChunkStore:
    """A store from a connector's options.

    ``url`` (and ``token``): a running ``kvtier serve``. Otherwise in-process tiers from
    ``config`` (a YAML path) and/or ``tiers`` (a mapping of :class:`TiersConfig` fields);
    ``slot_bytes`` sizes the CPU arena's slots to the engine's chunks.
    """
    if options.get("url"):
        return RemoteChunkStore(str(options["url"]), options.get("token"))
    from kvtier.config import load_config
    from kvtier.connectors.tiers.factory import build_tiers

    overrides = {"tiers": dict(options.get("tiers") or {})}
    cache_key = json.dumps([options.get("config"), overrides, slot_bytes], sort_keys=True)
    with _LOCAL_LOCK:
        store = _LOCAL.get(cache_key)
        if store is None:
            cfg = load_config(options.get("config"), overrides=overrides)
            manager = build_tiers(cfg.tiers, slot_bytes, fingerprint=None)
            if manager is None:
                raise ConfigError("the connector's tiers are all disabled; enable one or set url")
            store = _LOCAL[cache_key] = LocalChunkStore(manager)
        return store
