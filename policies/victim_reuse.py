"""Of the blocks the pool let go, the share that requests ask for again.

A write-back bets that a victim's KV is wanted again before a tier would let it go. Whether
a *session* comes back is the think-time model's to say; but blocks are also wanted by other
sessions (a shared document or system prompt), and a session's own blocks may never be asked
for even when it returns (a reply shorter than a block). So the policy also measures the bet
directly, as a ghost list (ARC's idea): the keys of recent victims, no data; a request that
asks for one counts a reuse.

A victim not asked for *yet* is not a victim never asked for: on a trace whose victims come
back hundreds or thousands of victims later (a shared prefix's next user), counting the
young ones as misses put the rate at half its true value for most of a run. So the rate is
a life table (Kaplan-Meier) over a victim's age, counted in victims let go after it, in
doubling bands: each band's hazard is the reuses in that band over the victims that reached
it (those still in it at half weight), and the rate is the chance of a reuse in any band the
list can see. A prior of one reuse in two victims stands in before anything was seen (one
pseudo-victim reused at once, one never), and fades as victims are counted.

The list remembers as many victims as the lower tiers could hold (the caller says): a block
asked for after that could not have been served by a copy anyway.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable

from kvtier.errors import InvalidArgumentError


class VictimReuse:
    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity < 1:
            raise InvalidArgumentError(f"a victim list holds at least one key, not {capacity}")
        self.capacity = capacity
        self._ghosts: OrderedDict[Hashable, int] = OrderedDict()
        """Victim key -> its place in the sequence of victims (its age is the count since)."""
        self._clock = 0
        bands = capacity.bit_length() + 2
        self._reached = [1] * bands
        """Victims that reached each age band (band ``b``: ages below ``2**b``; each starts
        with the prior's never-reused pseudo-victim; band 0 also its reused one)."""
        self._reached[0] = 2
        self._reused_in = [0] * bands
        self._reused_in[0] = 1
        self._left_in = [0] * bands
        """Victims that aged out of the list in each band (neither reused nor at risk)."""
        self._crossing: list[deque[tuple[int, Hashable]]] = [deque() for _ in range(bands)]
        """Band ``b``: the victims of band ``b - 1`` in age order, waiting to reach ``b``."""
        self._rate: tuple[int, int, float] | None = None
        self.let_go_total = 0
        self.reused_total = 0
        self.requested_total = 0

    def let_go(self, keys: Iterable[Hashable]) -> None:
        """These blocks left the pool (stored below or dropped); a victim let go again is a
        new bet (its age starts over)."""
        ghosts = self._ghosts
        for key in keys:
            self._clock += 1
            if key in ghosts:
                del ghosts[key]
            else:
                self.let_go_total += 1
            ghosts[key] = self._clock
            self._reached[0] += 1
            if len(self._crossing) > 1:
                self._crossing[1].append((self._clock, key))
            if len(ghosts) > self.capacity:
                _, seq = ghosts.popitem(last=False)
                self._left_in[self._band(seq)] += 1
        self._age()

    def _band(self, seq: int) -> int:
        return min((self._clock - seq).bit_length(), len(self._reached) - 1)

    def _age(self) -> None:
        """Move victims whose age reached a band's lower end into it."""
        ghosts, crossing = self._ghosts, self._crossing
        for b in range(1, len(crossing)):
            waiting, start = crossing[b], 1 << (b - 1)
            while waiting and self._clock - waiting[0][0] >= start:
                seq, key = waiting.popleft()
                if ghosts.get(key) != seq:
                    continue  # reused, let go again or aged out of the list meanwhile
                self._reached[b] += 1
                if b + 1 < len(crossing):
                    crossing[b + 1].append((seq, key))

    def requested(self, keys: Iterable[Hashable]) -> None:
        """A request asks for these blocks: each one the pool let go counts once as reused."""
        ghosts = self._ghosts
        for key in keys:
            self.requested_total += 1
            seq = ghosts.pop(key, None)
            if seq is not None:
                self.reused_total += 1
                self._reused_in[self._band(seq)] += 1

    def rate(self) -> float:
        """Chance that a victim is asked for again while the list remembers it (prior:
        1 in 2), from the life table over victims' ages."""
        memo = self._rate
        if memo is not None and memo[0] == self._clock and memo[1] == self.reused_total:
            return memo[2]
        survive = 1.0
        bands = len(self._reached)
        for b in range(bands):
            after = self._reached[b + 1] if b + 1 < bands else 0
            still = self._reached[b] - after - self._reused_in[b] - self._left_in[b]
            at_risk = self._reached[b] - 0.5 * max(still, 0)
            if at_risk > 0:
                survive *= 1.0 - min(self._reused_in[b] / at_risk, 1.0)
        out = 1.0 - survive
        self._rate = (self._clock, self.reused_total, out)
        return out

    def turnover(self) -> float:
        """Victims per block requested: how likely the pool lets a block go at all (1
        before anything was requested)."""
        if self.requested_total == 0:
            return 1.0
        return min(1.0, self.let_go_total / self.requested_total)
