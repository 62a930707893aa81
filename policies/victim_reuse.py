"""Of the blocks the pool let go, the share that requests asked for again.

A write-back bets that a victim's KV is wanted again before a tier would let it go. Whether
a *session* comes back is the think-time model's to say; but blocks are also wanted by other
sessions (a shared document or system prompt), and a session's own blocks may never be asked
for even when it returns (a reply shorter than a block). So the policy also measures the bet
directly, as a ghost list (ARC's idea): the keys of recent victims, no data; a request that
asks for one counts a reuse. The rate counts victims not asked for yet as not reused (it
errs low while young and converges as they age out); a prior of one reuse in two victims
stands in before anything was seen.

The list remembers as many victims as the lower tiers could hold (the caller says): a block
asked for after that could not have been served by a copy anyway.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

from kvtier.errors import InvalidArgumentError


class VictimReuse:
    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity < 1:
            raise InvalidArgumentError(f"a victim list holds at least one key, not {capacity}")
        self.capacity = capacity
        self._ghosts: OrderedDict[Hashable, None] = OrderedDict()
        self.let_go_total = 0
        self.reused_total = 0
        self.requested_total = 0

    def let_go(self, keys: Iterable[Hashable]) -> None:
        """These blocks left the pool (stored below or dropped)."""
        for key in keys:
            if key in self._ghosts:
                self._ghosts.move_to_end(key)
                continue
            self._ghosts[key] = None
            self.let_go_total += 1
            if len(self._ghosts) > self.capacity:
                self._ghosts.popitem(last=False)

    def requested(self, keys: Iterable[Hashable]) -> None:
        """A request asks for these blocks: each one the pool let go counts once as reused."""
        ghosts = self._ghosts
        for key in keys:
            self.requested_total += 1
            if ghosts.pop(key, 0) is None:
                self.reused_total += 1

    def rate(self) -> float:
        """Reused victims per victim (prior: 1 in 2)."""
        return (self.reused_total + 1) / (self.let_go_total + 2)

    def turnover(self) -> float:
        """Victims per block requested: how likely the pool lets a block go at all (1
        before anything was requested)."""
        if self.requested_total == 0:
            return 1.0
        return min(1.0, self.let_go_total / self.requested_total)
