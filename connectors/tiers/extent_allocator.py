"""Where a chunk of any size goes in the CPU arena: contiguous runs of fixed units.

The arena is cut into units (page multiples, so every chunk starts page-aligned and can
be written to disk with ``O_DIRECT`` as it lies); a chunk takes a contiguous run of as
many units as its bytes need. Free runs are kept both by address (to coalesce a freed
extent with its free neighbours at once) and by size (to find the best fit quickly).

Placement is best fit, lowest address first among equals: a chunk goes into the smallest
free run that holds it, so a hole left by a chunk of one size is refilled by the next
chunk of that size (one model's chunks are all alike: no hole is ever too small for
them), and small chunks (tails) fill small holes instead of splitting big ones. That is
the rule that keeps fragmentation lowest on real allocation traces (Johnstone and Wilson,
"The memory fragmentation problem: solved?", 1998), and the CPU tier evicts, rather than
fails, when no run fits, so a hole only costs memory until its neighbours leave.

Bookkeeping is per run and per extent, never per unit: its size does not depend on the
unit. Not thread-safe on its own: the tier guards it with its lock.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass

from kvtier.errors import InvalidArgumentError


@dataclass(frozen=True)
class Extent:
    """``units`` units from unit ``start`` on."""

    start: int
    units: int

    @property
    def end(self) -> int:
        return self.start + self.units


class ExtentAllocator:
    """Extents of ``total_units`` units: taken best fit, given back coalesced."""

    def __init__(self, total_units: int) -> None:
        if total_units < 0:
            raise InvalidArgumentError(f"an arena of {total_units} units")
        self.total_units = total_units
        self._starts: list[int] = []
        """Starts of the free runs, in address order."""
        self._run_units: dict[int, int] = {}
        """Free run start -> its units."""
        self._by_size: list[tuple[int, int]] = []
        """(units, start) of every free run, ascending: the best fit is a bisection."""
        self._taken: dict[int, int] = {}
        """Extent start -> its units, for every extent handed out and not given back."""
        self.free_units = 0
        if total_units:
            self._add_run(0, total_units)

    # --- queries -------------------------------------------------------------------
    def units_at(self, start: int) -> int:
        """Units of the extent handed out at ``start`` (KeyError if none is)."""
        return self._taken[start]

    def extent_at(self, start: int) -> Extent:
        return Extent(start, self._taken[start])

    @property
    def largest_run(self) -> int:
        """Units of the largest free run (0 when the arena is full)."""
        return self._by_size[-1][0] if self._by_size else 0

    def free_runs(self) -> list[Extent]:
        """Every free run in address order (tests, stats)."""
        return [Extent(s, self._run_units[s]) for s in self._starts]

    def taken(self) -> list[Extent]:
        """Every extent handed out, in address order."""
        return [Extent(s, self._taken[s]) for s in sorted(self._taken)]

    def __len__(self) -> int:
        """Extents handed out."""
        return len(self._taken)

    # --- changes -------------------------------------------------------------------
    def take(self, units: int) -> int | None:
        """The start of a new extent of ``units`` units, from the smallest free run that
        holds it (lowest address among equals); None when no run does."""
        if units < 1:
            raise InvalidArgumentError(f"an extent takes at least one unit, got {units}")
        i = bisect_left(self._by_size, (units, -1))
        if i == len(self._by_size):
            return None
        size, start = self._by_size[i]
        self._remove_run(start)
        if size > units:
            self._add_run(start + units, size - units)
        self._taken[start] = units
        return start

    def give(self, start: int) -> None:
        """Give the extent at ``start`` back, merged with the free runs beside it."""
        units = self._taken.pop(start)
        end = start + units
        if end in self._run_units:  # the run after it
            units += self._remove_run(end)
        i = bisect_left(self._starts, start)
        if i:
            before = self._starts[i - 1]
            if before + self._run_units[before] == start:  # the run before it
                units += self._remove_run(before)
                start = before
        self._add_run(start, units)

    def claim(self, extent: Extent) -> None:
        """Hand out exactly ``extent``, which must lie inside one free run (the tier keeps
        a departing chunk's units out of others' hands until its bytes are handed down)."""
        i = bisect_right(self._starts, extent.start) - 1
        start = self._starts[i] if i >= 0 else -1
        units = self._run_units.get(start, 0)
        if start < 0 or extent.end > start + units:
            raise InvalidArgumentError(f"{extent} is not free")
        self._remove_run(start)
        if extent.start > start:
            self._add_run(start, extent.start - start)
        if start + units > extent.end:
            self._add_run(extent.end, start + units - extent.end)
        self._taken[extent.start] = extent.units

    def shrink(self, start: int, units: int) -> None:
        """Keep only the first ``units`` units of the extent at ``start`` (a fill wrote
        less than it reserved); the rest is free again."""
        had = self._taken[start]
        if not 1 <= units <= had:
            raise InvalidArgumentError(f"cannot shrink an extent of {had} units to {units}")
        if units == had:
            return
        self._taken[start] = units
        self._taken[start + units] = had - units
        self.give(start + units)

    # --- runs ----------------------------------------------------------------------
    def _add_run(self, start: int, units: int) -> None:
        insort(self._starts, start)
        self._run_units[start] = units
        insort(self._by_size, (units, start))
        self.free_units += units

    def _remove_run(self, start: int) -> int:
        units = self._run_units.pop(start)
        del self._starts[bisect_left(self._starts, start)]
        del self._by_size[bisect_left(self._by_size, (units, start))]
        self.free_units -= units
        return units


def largest_gap(total_units: int, pinned: list[Extent]) -> int:
    """Units of the longest stretch of ``[0, total_units)`` that no ``pinned`` extent
    covers (extents may overlap): the largest run that evicting every other chunk could
    make."""
    best, cursor = 0, 0
    for extent in sorted(pinned, key=lambda e: e.start):
        best = max(best, extent.start - cursor)
        cursor = max(cursor, extent.end)
    return max(best, total_units - cursor)
