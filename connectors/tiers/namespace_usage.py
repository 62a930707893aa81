"""What each namespace (a tenant of the service) holds in one tier: its bytes, kept as
chunks come and go, and its chunks from least to most recently used.

Per-tenant byte quotas are enforced with it (:meth:`TierManager.put` asks a tier how much a
tenant holds and has it give up that tenant's coldest chunks), so a tenant that fills its
share pushes out its own KV, never another tenant's. Counting as writes happen keeps the
per-tenant gauges free (no scan). Keys outside any namespace (the engine's own, bare) are
not counted. Not thread-safe on its own: the tier guards it with its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable

from kvtier.chunk_format import NAMESPACE_SEP


def namespace_of(key: Hashable) -> str | None:
    """The namespace a storage key is filed in (``tenant`` of ``tenant.key``), or None."""
    if not isinstance(key, str):
        return None
    ns, sep, _ = key.rpartition(NAMESPACE_SEP)
    return ns if sep else None


class NamespaceUsage:
    """namespace -> bytes held, and its keys in least-recently-used order."""

    def __init__(self) -> None:
        self._bytes: dict[str, int] = {}
        self._keys: dict[str, OrderedDict[str, int]] = {}

    def add(self, key: Hashable, size: int) -> None:
        ns = namespace_of(key)
        if ns is None:
            return
        assert isinstance(key, str)
        keys = self._keys.setdefault(ns, OrderedDict())
        old = keys.pop(key, 0)
        keys[key] = size
        self._bytes[ns] = self._bytes.get(ns, 0) + size - old

    def touch(self, key: Hashable) -> None:
        """An access: the key becomes its namespace's most recently used."""
        ns = namespace_of(key)
        keys = self._keys.get(ns) if ns is not None else None
        if keys is not None and key in keys:
            keys.move_to_end(key)  # type: ignore[arg-type]

    def remove(self, key: Hashable) -> None:
        ns = namespace_of(key)
        keys = self._keys.get(ns) if ns is not None else None
        if keys is None or key not in keys:
            return
        assert ns is not None
        self._bytes[ns] -= keys.pop(key)  # type: ignore[call-overload]
        if not keys:
            del self._keys[ns], self._bytes[ns]

    def held(self, namespace: str, keys: Collection[str] = ()) -> tuple[int, set[str]]:
        """The namespace's bytes, and which of ``keys`` it already holds."""
        have = self._keys.get(namespace, {})
        return self._bytes.get(namespace, 0), {k for k in keys if k in have}

    def coldest(self, namespace: str, need: int, exclude: Collection[str] = ()) -> list[str]:
        """The namespace's least recently used keys (none in ``exclude``) whose sizes add
        up to at least ``need`` bytes, or all it has if they do not."""
        out: list[str] = []
        freed = 0
        for key, size in self._keys.get(namespace, {}).items():
            if freed >= need:
                break
            if key in exclude:
                continue
            out.append(key)
            freed += size
        return out

    def snapshot(self) -> dict[str, int]:
        """namespace -> bytes (a copy: safe to read from another thread without the lock)."""
        return dict(self._bytes)
