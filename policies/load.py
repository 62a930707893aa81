"""How busy the GPU and each tier's link are, and what a second of their time costs.

A decision that takes ``x`` seconds of a resource delays, besides its own request, every
request that queues on that resource meanwhile. In a single-server queue at utilisation
``rho``, ``x`` more seconds of work extend the busy period by ``x / (1 - rho)``, so the
requests it delays wait ``x / (1 - rho)`` seconds in all (``x`` for its own,
``x * rho / (1 - rho)`` for the others). Recomputing a prefix on a loaded GPU therefore
costs more than its prefill time, a write that holds up an admission costs the queue behind
it too, and a transfer on an idle link costs just its time. This is what makes the
restore, write-back and demotion decisions load-aware; with everything idle the weights are
1 and the decisions are the plain time comparisons.

Utilisation is measured, not assumed: each resource's busy intervals feed an exponentially
decaying sum over a horizon (a minute: many turns long, short enough to follow a load that
changes). Pure arithmetic, on whatever clock the caller uses (the engine's, or the
simulator's virtual one).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from kvtier.errors import InvalidArgumentError

MAX_SHARE = 0.95
"""Utilisation is read as at most this (a weight of 20): a saturated resource's weight is
finite, so decisions stay comparable, and one busy burst cannot make a resource look
infinitely expensive."""


@dataclass
class BusyShare:
    """The share of recent time one resource was busy (decaying over ``horizon_s``)."""

    horizon_s: float = 60.0
    _busy: float = 0.0
    """Busy seconds, each decayed by ``exp(-age / horizon)`` as of ``_at``."""
    _at: float | None = None
    _first: float | None = None

    def __post_init__(self) -> None:
        if not self.horizon_s > 0:
            raise InvalidArgumentError(f"a busy-share horizon must be > 0 s, not {self.horizon_s}")

    def observe(self, start: float, seconds: float) -> None:
        """The resource was busy from ``start`` for ``seconds`` (intervals may come out of
        order, or end in the future: a transfer queued on a link)."""
        if seconds <= 0:
            return
        end = start + seconds
        if self._first is None:
            self._first = start
        self._first = min(self._first, start)
        if self._at is None:
            self._at = end
        if end >= self._at:
            self._busy = self._busy * math.exp(-(end - self._at) / self.horizon_s) + seconds
            self._at = end
        else:
            self._busy += seconds * math.exp(-(self._at - end) / self.horizon_s)

    def share(self, now: float) -> float:
        """Busy share as of ``now`` (0 before anything was seen), at most :data:`MAX_SHARE`.
        Work already queued beyond ``now`` counts as busy now."""
        if self._at is None or self._first is None:
            return 0.0
        busy = self._busy * math.exp(-max(now - self._at, 0.0) / self.horizon_s)
        seen = max(now, self._at) - self._first
        if seen <= 0:
            return MAX_SHARE
        # Over a window shorter than the horizon, the decayed sum of a share rho is
        # rho * horizon * (1 - exp(-seen / horizon)).
        span = self.horizon_s * -math.expm1(-seen / self.horizon_s)
        return min(busy / span, MAX_SHARE)


def delay_weight(share: float) -> float:
    """Seconds of everyone's waiting that one second of a resource at this utilisation
    costs: ``1 / (1 - share)``."""
    return 1.0 / (1.0 - min(max(share, 0.0), MAX_SHARE))


@dataclass(frozen=True)
class LoadWeights:
    """What a second of each resource costs now (1: idle) and what each link has queued."""

    compute: float = 1.0
    links: Mapping[str, float] = field(default_factory=dict)
    """Each tier's link as reads see it."""
    link_wait_s: Mapping[str, float] = field(default_factory=dict)
    """Seconds of transfers already queued on each tier's link ahead of a new read."""
    write_links: Mapping[str, float] = field(default_factory=dict)
    """Each tier's write path where it is not its reads' (a duplex link: PCIe, a network);
    absent: writes share the reads' path and weight."""
    write_wait_s: Mapping[str, float] = field(default_factory=dict)
    """Seconds queued ahead of a new write on each tier's write path (absent: the reads'
    wait); for a write on an admission path, negative where the path frees before the
    turn could start anyway (slack)."""

    def link(self, tier: str) -> float:
        return self.links.get(tier, 1.0)

    def wait(self, tier: str) -> float:
        return self.link_wait_s.get(tier, 0.0)

    def write_link(self, tier: str) -> float:
        return self.write_links.get(tier, self.link(tier))

    def write_wait(self, tier: str) -> float:
        return self.write_wait_s.get(tier, self.wait(tier))


IDLE = LoadWeights()
"""Nothing else is running: every decision is the plain time comparison."""


class LoadMeter:
    """The busy shares of the GPU (compute) and of each tier's link, as one policy sees
    them: the engine's scheduler and transfers, or the simulator's events, feed it."""

    def __init__(self, horizon_s: float = 60.0, duplex: Collection[str] = ()) -> None:
        """``duplex``: the tiers whose writes take a path of their own."""
        self.horizon_s = horizon_s
        self.compute = BusyShare(horizon_s)
        self.links: dict[str, BusyShare] = {}
        self.write_links: dict[str, BusyShare] = {}
        """The write paths of the ``duplex`` tiers (the others' writes are in ``links``)."""
        self.duplex = frozenset(duplex)

    def observe_compute(self, start: float, seconds: float) -> None:
        self.compute.observe(start, seconds)

    def observe_link(self, tier: str, start: float, seconds: float, write: bool = False) -> None:
        paths = self.write_links if write and tier in self.duplex else self.links
        paths.setdefault(tier, BusyShare(self.horizon_s)).observe(start, seconds)

    def weights(self, now: float, link_wait_s: Mapping[str, float] | None = None,
                write_wait_s: Mapping[str, float] | None = None) -> LoadWeights:
        return LoadWeights(
            compute=delay_weight(self.compute.share(now)),
            links={t: delay_weight(b.share(now)) for t, b in self.links.items()},
            link_wait_s=dict(link_wait_s or {}),
            write_links={t: delay_weight(b.share(now)) if (b := self.write_links.get(t)) else 1.0
                         for t in self.duplex | self.write_links.keys()},
            write_wait_s=dict(write_wait_s or {}),
        )
