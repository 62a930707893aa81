"""A recency-ordered key index with byte accounting, shared by the CPU and disk tiers.

Both tiers evict least-recently-used chunks and must know how many bytes they hold without
walking their storage; this keeps that bookkeeping in one place. Not thread-safe on its own:
each tier guards it with its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator
from typing import Generic, TypeVar

V = TypeVar("V")


class LRUIndex(Generic[V]):
    """key -> (value, size), oldest first."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, tuple[V, int]] = OrderedDict()
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def leading_present(self, keys: Iterable[str]) -> int:
        """How many leading ``keys`` are indexed (a tier's ``contains_prefix``)."""
        n = 0
        for key in keys:
            if key not in self._entries:
                break
            n += 1
        return n

    def get(self, key: str, touch: bool = True) -> tuple[V, int] | None:
        """The entry, marked most recently used unless ``touch`` is False."""
        entry = self._entries.get(key)
        if entry is not None and touch:
            self._entries.move_to_end(key)
        return entry

    def add(self, key: str, value: V, size: int) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_bytes -= old[1]
        self._entries[key] = (value, size)
        self.used_bytes += size

    def pop(self, key: str) -> tuple[V, int] | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry[1]
        return entry

    def oldest(self, exclude: Container[str] = ()) -> str | None:
        """The least recently used key not in ``exclude`` (None if there is none)."""
        for key in self._entries:
            if key not in exclude:
                return key
        return None

    def keys(self) -> Iterator[str]:
        return iter(list(self._entries))
