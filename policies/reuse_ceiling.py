"""The reuse ceiling: the best hit rate a workload allows, beside the hit rate achieved.

Of the blocks (chunks) a workload asks for over a window, a cache of unbounded size could
serve every one it has seen before: those requested earlier, and those it produced itself
(a reply's blocks, which the next turn's prompt begins with). The rest, first sightings,
no cache can serve. So the ceiling is ``(N - U) / N`` with ``N`` the blocks requested and
``U`` the requested blocks never seen before; ``U = |P u R| - |R|`` where ``P`` are the
distinct requested blocks and ``R`` the distinct produced ones. Distinct counts come from
HyperLogLog sketches (Apache DataSketches; a few KiB whatever the traffic, about 1.6 %
relative error at the default size), over a sliding window of the last ``window`` to
``2 * window`` requested blocks (two tumbling halves, united), so the figure follows the
workload as it changes. An operator reads how far the cache is from what the workload
allows: achieved hits near the ceiling mean more capacity would buy little.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import datasketches

LG_K = 12
"""log2 of each sketch's registers: 4,096, about 1.6 % relative standard error."""


def _item(key: Hashable) -> str | int:
    if isinstance(key, (bytes, bytearray)):
        return bytes(key).hex()
    return key if isinstance(key, (str, int)) else repr(key)


@dataclass
class _Half:
    """One tumbling half of the window: blocks requested and served, and the two sketches."""

    requested: int = 0
    served: int = 0
    asked: datasketches.hll_sketch = field(default_factory=lambda: datasketches.hll_sketch(LG_K))
    made: datasketches.hll_sketch = field(default_factory=lambda: datasketches.hll_sketch(LG_K))


class ReuseCeiling:
    """Counts requested and produced blocks; :meth:`ratio` is the ceiling over the window."""

    def __init__(self, window: int = 1 << 20) -> None:
        if window < 1:
            raise ValueError(f"window must be at least one block, not {window}")
        self.window = window
        self._old = _Half()
        self._new = _Half()
        self.requested_total = 0

    def requested(self, keys: Iterable[Hashable], served: int = 0) -> None:
        """Blocks a request asks for (a prompt's, first to last), of which the cache served
        ``served`` (its achieved hits)."""
        self._new.served += served
        for key in keys:
            self._new.asked.update(_item(key))
            self._new.requested += 1
            self.requested_total += 1
            if self._new.requested >= self.window:
                self._old, self._new = self._new, _Half()

    def produced(self, keys: Iterable[Hashable]) -> None:
        """Blocks the server computed that later requests may ask for (a reply's)."""
        for key in keys:
            self._new.made.update(_item(key))

    def achieved(self) -> float:
        """The share of the window's requested blocks the cache did serve."""
        n = self._old.requested + self._new.requested
        return (self._old.served + self._new.served) / n if n else 0.0

    def ratio(self) -> float:
        """The share of the window's requested blocks an unbounded cache could serve (0
        before anything was requested)."""
        n = self._old.requested + self._new.requested
        if n == 0:
            return 0.0
        made = datasketches.hll_union(LG_K)
        made.update(self._old.made)
        made.update(self._new.made)
        both = datasketches.hll_union(LG_K)
        both.update(self._old.asked)
        both.update(self._new.asked)
        produced = made.get_result().get_estimate()
        both.update(made.get_result())
        unique = max(0.0, both.get_result().get_estimate() - produced)
        return min(1.0, max(0.0, (n - unique) / n))
