"""Which of several candidate rules to follow now: the one whose shadow served the recent
turns best.

No single rule for what to store wins on every workload (issue 34): storing only the
chunks whose copy pays for itself keeps the tiers for what comes back, and loses where
one-shot requests share documents; storing every chunk as it is computed (LMCache's rule)
wins there and floods the tiers where it does not. So each candidate runs as a shadow, a
replay of the same requests that keeps bookkeeping only, and the live system follows the
candidate whose shadow had the lowest mean time per turn over the last ``window`` turns
(the caller says which time: the simulator gives each turn's own, without its wait behind
earlier turns). A shadow's state is its own (what its rule would have stored), so a candidate is
judged on what it would have done, not on the state the live rule left.

The window trades reaction against noise; it is fixed, not fitted to any workload. Until
every candidate has served ``min_turns`` the live rule stays the first candidate (kvtier's
default); from then on each is judged on its last ``window`` turns (all it has, while
fewer); a tie keeps the current one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvtier.errors import InvalidArgumentError

DEFAULT_WINDOW = 256
"""Turns each candidate is judged over: a few hundred turns make a mean that one slow
outlier moves little, yet follow a workload whose shape changes within a trace."""
DEFAULT_MIN_TURNS = 32
"""Turns every candidate must have served before any is followed: the first turns meet
empty caches under every rule and say little about which stores better."""


class FollowTheBest:
    def __init__(self, candidates: Sequence[str], window: int = DEFAULT_WINDOW,
                 min_turns: int = DEFAULT_MIN_TURNS) -> None:
        if not candidates or len(set(candidates)) != len(candidates):
            raise InvalidArgumentError(f"candidates must be distinct and not empty: {list(candidates)}")
        if not 1 <= min_turns <= window:
            raise InvalidArgumentError(f"need 1 <= min_turns <= window, not {min_turns} and {window}")
        self.candidates = tuple(candidates)
        self.window = window
        self.min_turns = min_turns
        self.current = self.candidates[0]
        self._recent = {c: deque(maxlen=window) for c in self.candidates}
        self._sums = dict.fromkeys(self.candidates, 0.0)
        self.switches = 0
        self.turns_followed = dict.fromkeys(self.candidates, 0)

    def observe(self, candidate: str, ttft_s: float) -> None:
        """The candidate's shadow served a turn in ``ttft_s`` seconds (its time as judged)."""
        recent = self._recent[candidate]
        if len(recent) == recent.maxlen:
            self._sums[candidate] -= recent[0]
        recent.append(ttft_s)
        self._sums[candidate] += ttft_s

    def mean(self, candidate: str) -> float | None:
        """The candidate's mean TTFT over its window (None before ``min_turns``)."""
        recent = self._recent[candidate]
        return self._sums[candidate] / len(recent) if len(recent) >= self.min_turns else None

    def choose(self) -> str:
        """The candidate to follow for the next turn (and count it as followed)."""
        means = {c: self.mean(c) for c in self.candidates}
        if all(m is not None for m in means.values()):
            best = min(self.candidates, key=lambda c: (means[c], c != self.current))
            if best != self.current:
                self.current = best
                self.switches += 1
        self.turns_followed[self.current] += 1
        return self.current
