"""Which chunks to slide so that free units split into holes become one run.

When the CPU arena's free units would hold a chunk but no free run does, evicting would
throw KV away for want of contiguity, not of room (and could take another tenant's chunk
while every tenant is within its quota). Instead the tier slides chunks together: it
picks the stretch of the arena that holds enough free units, no chunk it may not move
(leased, being written, on its way down) and the fewest units of chunks to copy, and
packs that stretch's chunks towards its start, so its free units end up in one run at its
end. With nothing pinned, any arena whose free units would hold the chunk has such a
stretch. Pure planning here; the tier moves the bytes under its lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.connectors.tiers.extent_allocator import Extent


@dataclass(frozen=True)
class Occupied:
    """An extent in use and whether its chunk may move."""

    extent: Extent
    movable: bool


@dataclass(frozen=True)
class Stretch:
    """A stretch of the arena to pack: ``chunks`` (in address order) slide towards
    ``start``; its ``free`` units end up as one run after them."""

    start: int
    chunks: tuple[Extent, ...]
    free: int

    @property
    def cost(self) -> int:
        """Units of chunks copied (an upper bound: a chunk already in place stays)."""
        return sum(c.units for c in self.chunks)


def cheapest_stretch(total_units: int, occupied: Sequence[Occupied], units: int) -> Stretch | None:
    """The stretch with at least ``units`` free units and no immovable chunk that copies
    the fewest units (lowest address among equals), or None. ``occupied``: every extent in
    use, in address order, none overlapping; the units between them are free."""
    best: Stretch | None = None
    for section in _sections(total_units, occupied):
        candidate = _cheapest_in(section, units)
        if candidate is not None and (best is None or candidate.cost < best.cost):
            best = candidate
    return best


_Item = tuple[Extent, bool]
"""A piece of a section in address order: the extent, and whether it is free."""


def _sections(total_units: int, occupied: Sequence[Occupied]) -> list[list[_Item]]:
    """The arena cut at its immovable chunks: runs of free units and movable chunks."""
    sections: list[list[_Item]] = [[]]
    cursor = 0
    for o in occupied:
        if o.extent.start > cursor:
            sections[-1].append((Extent(cursor, o.extent.start - cursor), True))
        if o.movable:
            sections[-1].append((o.extent, False))
        else:
            sections.append([])
        cursor = o.extent.end
    if total_units > cursor:
        sections[-1].append((Extent(cursor, total_units - cursor), True))
    return [s for s in sections if s]


def _cheapest_in(items: list[_Item], units: int) -> Stretch | None:
    """Two pointers over one section: the shortest-cost run of items whose free units
    reach ``units``, starting and ending on free items."""
    best: Stretch | None = None
    free = cost = 0
    left = 0
    for right, (extent, is_free) in enumerate(items):
        if is_free:
            free += extent.units
        else:
            cost += extent.units
        while free >= units:
            if is_free and (best is None or cost < best.cost):
                chunks = tuple(e for e, f in items[left : right + 1] if not f)
                best = Stretch(items[left][0].start, chunks, free)
            first, first_free = items[left]
            if first_free and free - first.units < units:
                break
            if first_free:
                free -= first.units
            else:
                cost -= first.units
            left += 1
    return best
