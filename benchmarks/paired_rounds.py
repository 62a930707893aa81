"""A ratio to a reference measured round by round, with how far the rounds let it be
trusted: each round's ratio (the setup against the reference run in the same round, so
that a drift of the machine between rounds cancels), their mean, and a 95 % interval of
that mean (Student's t over the rounds).

Why over rounds and not over turns: with real servers most of the spread is between
server starts, not between turns of one start (docs/vllm.md, session 40: one start of
vLLM alone served every first-turn group 13-16 % slower than the next start did). Turns of
one start are not independent samples; starts are.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
       2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086)
"""Two-sided 95 % quantiles of Student's t for 1..20 degrees of freedom (beyond: 1.96
is within 5 % of them)."""


@dataclass(frozen=True)
class PairedRatio:
    """``by_round``: each round's ratio; ``low``..``high``: the 95 % interval of their mean
    (None with a single round: one start says nothing of the next)."""

    by_round: tuple[float, ...]
    mean: float
    low: float | None
    high: float | None

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["by_round"] = [round(x, 4) for x in self.by_round]
        for key in ("mean", "low", "high"):
            out[key] = None if out[key] is None else round(out[key], 4)
        return out


def paired_ratio(pairs: list[tuple[float | None, float | None]]) -> PairedRatio | None:
    """``pairs``: (the setup's figure, the reference's) per round; rounds where either is
    missing or the reference is 0 are left out. None when no round is left."""
    ratios = tuple(a / b for a, b in pairs if a is not None and b)
    if not ratios:
        return None
    mean = statistics.fmean(ratios)
    if len(ratios) < 2:
        return PairedRatio(ratios, mean, None, None)
    df = len(ratios) - 1
    t = T95[df - 1] if df <= len(T95) else 1.96
    half = t * statistics.stdev(ratios) / math.sqrt(len(ratios))
    return PairedRatio(ratios, mean, mean - half, mean + half)
