"""What reads will hold before they are made: where each key lies and its bytes, from the
tiers' indexes (no chunk is read), so a request is charged against the read budget
(:mod:`kvtier.server.reply_budget`), or refused, before a tier lends it anything."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

from kvtier.connectors.tiers.manager import TierManager


@dataclass(frozen=True)
class PlannedRead:
    """One key as a read will find it."""

    tier: int | None
    """The fastest tier holding it (None: not stored)."""
    size: int | None
    """Its bytes as that tier's index knows them (None: not stored, or unknown there)."""

    @property
    def stored(self) -> bool:
        return self.tier is not None


def plan_each(manager: TierManager, wheres: Sequence[str], codecs: Collection[str] | None
              ) -> list[PlannedRead]:
    """Every key on its own, prefix or not (a batch GET, a GET)."""
    tiers = manager.locate(wheres, codecs)
    sizes = manager.sizes(wheres, tiers)
    return [PlannedRead(t, n) for t, n in zip(tiers, sizes, strict=True)]


def plan_prefix(manager: TierManager, wheres: Sequence[str], codecs: Collection[str] | None
                ) -> list[PlannedRead]:
    """The stored prefix of the keys (a prefetch, a read into a region): one read each."""
    loc = manager.lookup(wheres, codecs)
    sizes = manager.sizes(wheres[: loc.length], loc.tiers)
    return [PlannedRead(t, n) for t, n in zip(loc.tiers, sizes, strict=True)]


def runs(charges: Sequence[int], max_bytes: int, max_keys: int) -> Iterator[range]:
    """Consecutive reads taken together: each run at most ``max_keys`` reads charged at
    most ``max_bytes`` in all (a read charged more goes alone)."""
    start, held = 0, 0
    for i, n in enumerate(charges):
        if i > start and (i - start >= max_keys or held + n > max_bytes):
            yield range(start, i)
            start, held = i, 0
        held += n
    if start < len(charges):
        yield range(start, len(charges))
