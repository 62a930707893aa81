"""KV allocation strategies the fragmentation analyzer compares.

* contiguous pre-allocation to the maximum length (the pre-PagedAttention serving model);
* contiguous exact-size allocation, first-fit or best-fit, where a growing sequence extends
  in place when the next slot is free and otherwise moves (a copy of its whole KV);
* paged allocation through kvtier's own :class:`BlockPool` at a given block size.

All strategies speak in token slots of one fixed memory.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Protocol

from kvtier.errors import InvalidArgumentError
from kvtier.gpu_pool.block_pool import BlockPool


class Strategy(Protocol):
    name: str
    capacity: int
    reserved: int
    copies: int
    tokens_copied: int

    def can_ever_fit(self, total_len: int, max_len: int) -> bool: ...
    def admit(self, rid: int, length: int, max_len: int) -> bool: ...
    def grow(self, rid: int, new_length: int) -> bool: ...
    def release(self, rid: int) -> None: ...
    def largest_free(self) -> int: ...


class Extents:
    """Free-extent map of a linear address space with coalescing, first- or best-fit."""

    def __init__(self, capacity: int, fit: str = "first"):
        if fit not in ("first", "best"):
            raise ValueError(f"fit must be 'first' or 'best', got {fit!r}")
        self.fit = fit
        self._size: dict[int, int] = {0: capacity}  # start -> size of each free extent
        self._start_of_end: dict[int, int] = {capacity: 0}
        self._starts: list[int] = [0]  # sorted starts, for first-fit

    def _remove(self, start: int) -> int:
        size = self._size.pop(start)
        del self._start_of_end[start + size]
        del self._starts[bisect_left(self._starts, start)]
        return size

    def _add(self, start: int, size: int) -> None:
        if size <= 0:
            return
        self._size[start] = size
        self._start_of_end[start + size] = start
        insort(self._starts, start)

    def alloc(self, size: int) -> int | None:
        if self.fit == "first":
            for s in self._starts:
                if self._size[s] >= size:
                    break
            else:
                return None
        else:
            best = None
            for s, sz in self._size.items():
                if sz >= size and (best is None or sz < self._size[best]):
                    best = s
            if best is None:
                return None
            s = best
        have = self._remove(s)
        self._add(s + size, have - size)
        return s

    def free(self, start: int, size: int) -> None:
        before = self._start_of_end.get(start)
        if before is not None:
            size += start - before
            self._remove(before)
            start = before
        after = start + size
        if after in self._size:
            size += self._remove(after)
        self._add(start, size)

    def try_extend(self, start: int, size: int, extra: int) -> bool:
        nxt = start + size
        have = self._size.get(nxt)
        if have is None or have < extra:
            return False
        self._remove(nxt)
        self._add(nxt + extra, have - extra)
        return True

    def largest(self) -> int:
        return max(self._size.values(), default=0)


class _Contiguous:
    """One contiguous extent per sequence; subclasses decide how big and how it grows."""

    def __init__(self, name: str, capacity: int, fit: str):
        self.name = name
        self.capacity = capacity
        self.reserved = 0
        self.copies = 0
        self.tokens_copied = 0
        self._ext = Extents(capacity, fit)
        self._held: dict[int, tuple[int, int]] = {}  # rid -> (start, size)

    def _reserve(self, rid: int, size: int) -> bool:
        start = self._ext.alloc(size)
        if start is None:
            return False
        self._held[rid] = (start, size)
        self.reserved += size
        return True

    def release(self, rid: int) -> None:
        start, size = self._held.pop(rid)
        self._ext.free(start, size)
        self.reserved -= size

    def largest_free(self) -> int:
        return self._ext.largest()


class ContiguousMaxLen(_Contiguous):
    """Reserve each request's maximum length up front, in one contiguous extent."""

    def __init__(self, capacity: int):
        super().__init__("contiguous-maxlen", capacity, "first")

    def can_ever_fit(self, total_len: int, max_len: int) -> bool:
        return max_len <= self.capacity

    def admit(self, rid: int, length: int, max_len: int) -> bool:
        return self._reserve(rid, max_len)

    def grow(self, rid: int, new_length: int) -> bool:
        return new_length <= self._held[rid][1]


class ContiguousExact(_Contiguous):
    """Reserve exactly the tokens held; growth extends in place or moves (and copies)."""

    def __init__(self, capacity: int, fit: str):
        super().__init__(f"contiguous-exact-{fit}fit", capacity, fit)

    def can_ever_fit(self, total_len: int, max_len: int) -> bool:
        return total_len <= self.capacity

    def admit(self, rid: int, length: int, max_len: int) -> bool:
        return self._reserve(rid, length)

    def grow(self, rid: int, new_length: int) -> bool:
        start, size = self._held[rid]
        extra = new_length - size
        if extra <= 0:
            return True
        if self._ext.try_extend(start, size, extra):
            self._held[rid] = (start, new_length)
            self.reserved += extra
            return True
        new_start = self._ext.alloc(new_length)  # the old copy stays until it is copied
        if new_start is None:
            return False
        self._ext.free(start, size)
        self._held[rid] = (new_start, new_length)
        self.reserved += extra
        self.copies += 1
        self.tokens_copied += size
        return True


class Paged:
    """Fixed-size blocks from kvtier's :class:`BlockPool` (prefix caching off)."""

    def __init__(self, capacity: int, block_size: int):
        self.name = f"paged-{block_size}"
        self.block_size = block_size
        num_blocks = capacity // block_size
        self.capacity = num_blocks * block_size
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching=False)
        self.copies = 0
        self.tokens_copied = 0
        self._held: dict[int, list[int]] = {}

    @property
    def reserved(self) -> int:
        return self.pool.num_used * self.block_size

    def can_ever_fit(self, total_len: int, max_len: int) -> bool:
        return -(-total_len // self.block_size) <= self.pool.num_blocks

    def admit(self, rid: int, length: int, max_len: int) -> bool:
        need = -(-length // self.block_size)
        if need > self.pool.num_free:
            return False
        self._held[rid] = self.pool.allocate(need)
        return True

    def grow(self, rid: int, new_length: int) -> bool:
        blocks = self._held[rid]
        need = -(-new_length // self.block_size) - len(blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        blocks.extend(self.pool.allocate(need))
        return True

    def release(self, rid: int) -> None:
        self.pool.free(self._held.pop(rid))

    def largest_free(self) -> int:
        # Any free block serves any request: free memory is never fragmented externally.
        return self.pool.num_free * self.block_size


PAGED_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
STRATEGY_NAMES = (
    "contiguous-maxlen",
    "contiguous-exact-firstfit",
    "contiguous-exact-bestfit",
    *(f"paged-{b}" for b in PAGED_BLOCK_SIZES),
)


def make_strategy(name: str, capacity: int) -> Strategy:
    """Build a strategy by its name (see STRATEGY_NAMES; ``paged-N`` takes any power of two)."""
    if name == "contiguous-maxlen":
        return ContiguousMaxLen(capacity)
    if name == "contiguous-exact-firstfit":
        return ContiguousExact(capacity, "first")
    if name == "contiguous-exact-bestfit":
        return ContiguousExact(capacity, "best")
    if name.startswith("paged-"):
        try:
            bs = int(name.removeprefix("paged-"))
        except ValueError:
            bs = -1
        if bs > 0 and capacity // bs >= 1:
            return Paged(capacity, bs)
    raise InvalidArgumentError(
        f"unknown strategy {name!r}; choose from {', '.join(STRATEGY_NAMES)} "
        "(paged-N takes a power-of-two block size no larger than the memory)"
    )
