"""The CPU arena's bookkeeping: runs of free units taken best fit and given back
coalesced, and the stretch compaction packs."""

from __future__ import annotations

import random

import pytest

from kvtier.connectors.tiers.arena_compaction import Occupied, cheapest_stretch
from kvtier.connectors.tiers.extent_allocator import Extent, ExtentAllocator, largest_gap
from kvtier.errors import InvalidArgumentError


def _holes(allocator: ExtentAllocator) -> list[tuple[int, int]]:
    return [(r.start, r.units) for r in allocator.free_runs()]


def test_best_fit_takes_the_smallest_run_that_holds_it_lowest_address_first():
    a = ExtentAllocator(20)
    starts = [a.take(n) for n in (3, 2, 4, 2, 5)]
    assert starts == [0, 3, 5, 9, 11] and _holes(a) == [(16, 4)]
    a.give(3)  # a hole of 2 at 3
    a.give(9)  # a hole of 2 at 9
    assert a.take(2) == 3  # the smallest that holds it, the lowest of equals
    assert a.take(4) == 16  # the run at the end is the only one that holds 4
    assert a.take(3) is None and a.largest_run == 2


def test_giving_back_coalesces_with_both_neighbours():
    a = ExtentAllocator(10)
    first, middle, last = a.take(3), a.take(3), a.take(3)
    a.give(first)
    a.give(last)
    assert _holes(a) == [(0, 3), (6, 4)]
    a.give(middle)
    assert _holes(a) == [(0, 10)] and a.free_units == 10 and len(a) == 0


def test_claim_carves_an_exact_extent_and_refuses_one_in_use():
    a = ExtentAllocator(10)
    a.claim(Extent(4, 3))
    assert _holes(a) == [(0, 4), (7, 3)] and a.units_at(4) == 3
    with pytest.raises(InvalidArgumentError):
        a.claim(Extent(5, 1))
    with pytest.raises(InvalidArgumentError):
        a.claim(Extent(2, 3))  # runs into the extent at 4


def test_shrink_frees_the_tail_of_an_extent():
    a = ExtentAllocator(10)
    start = a.take(6)
    a.shrink(start, 2)
    assert a.units_at(start) == 2 and _holes(a) == [(2, 8)]
    with pytest.raises(InvalidArgumentError):
        a.shrink(start, 3)


def test_random_takes_and_gives_keep_every_unit_accounted_for():
    rng = random.Random(3)
    a = ExtentAllocator(500)
    held: list[int] = []
    for _ in range(5000):
        if held and rng.random() < 0.45:
            a.give(held.pop(rng.randrange(len(held))))
        else:
            start = a.take(rng.randint(1, 40))
            if start is not None:
                held.append(start)
        runs, taken = a.free_runs(), a.taken()
        assert sum(r.units for r in runs) == a.free_units
        assert sum(e.units for e in runs + taken) == 500
        spans = sorted(runs + taken, key=lambda e: e.start)
        assert all(x.end == y.start for x, y in zip(spans, spans[1:], strict=False))
        assert all(x.end < y.start for x, y in zip(runs, runs[1:], strict=False))


def test_largest_gap_between_pinned_extents():
    assert largest_gap(10, []) == 10
    assert largest_gap(10, [Extent(1, 1), Extent(5, 1)]) == 4  # 6..9
    assert largest_gap(10, [Extent(0, 4), Extent(2, 5), Extent(9, 1)]) == 2  # overlaps


def test_compaction_packs_the_stretch_that_copies_least_and_never_a_pinned_chunk():
    # | c:2 | free:1 | c:4 | free:1 | pinned:1 | c:1 | free:1 | c:1 | free:1 | (13 units)
    occupied = [Occupied(Extent(0, 2), True), Occupied(Extent(3, 4), True),
                Occupied(Extent(8, 1), False), Occupied(Extent(9, 1), True),
                Occupied(Extent(11, 1), True)]
    stretch = cheapest_stretch(13, occupied, 2)
    assert stretch is not None and (stretch.start, stretch.free, stretch.cost) == (10, 2, 1)
    assert stretch.chunks == (Extent(11, 1),)
    wide = cheapest_stretch(13, occupied, 3)  # only left of the pinned chunk: 2 free units
    assert wide is None
    assert cheapest_stretch(13, occupied[:2], 2) is not None  # nothing pinned: the left part
