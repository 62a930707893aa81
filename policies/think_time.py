"""How long until a session's next turn: per-user think times shrunk toward the population's.

Think times are modelled as lognormal. The population's log-mean and log-spread are learned
online from every observed gap (a prior until enough are seen); a session's own log-mean is
the precision-weighted blend of its gaps and the population's (a normal-normal update with
the population spread), so a new user is predicted like everyone else and a regular user
like themself. Given that a session has already been idle ``t`` seconds, the expected time
left is the lognormal's conditional mean beyond ``t`` minus ``t``: a session idle far longer
than it usually thinks is predicted to stay away longer still.

Conversations also end: after each turn a session comes back with probability ``p``
(learned online as gaps seen per turn finished, with a Beta prior). Bayes turns a long
silence into evidence that the session is over, so :meth:`p_return_within` (what eviction
ranks by) falls with idle time faster than the think-time tail alone would say.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

from kvtier.errors import InvalidArgumentError


@dataclass
class _Running:
    """Welford mean/variance of log think times."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    @property
    def var(self) -> float:
        return self.m2 / (self.n - 1) if self.n > 1 else 0.0


@dataclass
class ThinkTimeModel:
    prior_median_s: float = 30.0
    prior_sigma: float = 1.2
    prior_weight: int = 20
    """Pseudo-observations the prior counts for in the population estimate."""
    continue_prior: tuple[float, float] = (4.0, 1.0)
    """Beta prior (returns, ends) on the chance that a session comes back after a turn."""
    population: _Running = field(default_factory=_Running)
    sessions: dict[Hashable, _Running] = field(default_factory=dict)
    turns_ended: int = 0

    def __post_init__(self) -> None:
        if self.prior_median_s <= 0 or self.prior_sigma <= 0:
            raise InvalidArgumentError("think-time prior needs a median > 0 and sigma > 0")

    # ----------------------------------------------------------------- learning
    def observe(self, session: Hashable, think_s: float) -> None:
        """A gap between the end of one turn and the start of the next."""
        x = math.log(max(think_s, 1e-3))
        self.population.add(x)
        self.sessions.setdefault(session, _Running()).add(x)

    def turn_ended(self, session: Hashable) -> None:
        """A turn finished (the session may or may not come back)."""
        self.turns_ended += 1

    def forget(self, session: Hashable) -> None:
        self.sessions.pop(session, None)

    def p_continue(self) -> float:
        """Chance that a session comes back after a turn: gaps seen per turn finished.
        Turns whose next gap is still running count as ends, so it errs low early on."""
        a, b = self.continue_prior
        seen = self.population.n
        return (seen + a) / (max(self.turns_ended, seen) + a + b)

    # --------------------------------------------------------------- prediction
    def population_params(self) -> tuple[float, float]:
        """(log-mean, log-sigma) of the population, blended with the prior (cached until
        the next observation)."""
        cached = getattr(self, "_pop_cache", None)
        if cached is not None and cached[0] == self.population.n:
            return cached[1]
        out = self._population_params()
        self._pop_cache = (self.population.n, out)
        return out

    def _population_params(self) -> tuple[float, float]:
        w, p = self.prior_weight, self.population
        mu0 = math.log(self.prior_median_s)
        mu = (w * mu0 + p.n * p.mean) / (w + p.n)
        var = (w * self.prior_sigma**2 + max(p.n - 1, 0) * p.var) / (w + max(p.n - 1, 0))
        return mu, math.sqrt(max(var, 1e-4))

    def params(self, session: Hashable) -> tuple[float, float]:
        """(log-mean, log-sigma) for one session: its mean shrunk toward the population's."""
        mu0, sigma = self.population_params()
        own = self.sessions.get(session)
        if own is None or own.n == 0:
            return mu0, sigma
        # Normal-normal: prior N(mu0, sigma^2) on the session mean, n observations of
        # spread sigma -> posterior mean = (mu0 + n * mean) / (1 + n).
        mu = (mu0 + own.n * own.mean) / (1 + own.n)
        return mu, sigma

    def expected_remaining(self, session: Hashable, idle_s: float) -> float:
        """Expected seconds until the next turn, given ``idle_s`` seconds idle already."""
        mu, sigma = self.params(session)
        if idle_s <= 0:
            return math.exp(mu + sigma * sigma / 2)
        z = (math.log(idle_s) - mu) / sigma
        num = math.erfc((z - sigma) / math.sqrt(2))
        den = math.erfc(z / math.sqrt(2))
        if den < 1e-300:  # far in the tail: E[T | T > t] ~ t (1 + sigma / z)
            return idle_s * sigma / max(z, 1e-9)
        cond = math.exp(mu + sigma * sigma / 2) * num / den
        return max(cond - idle_s, 0.0)

    def p_alive(self, session: Hashable, idle_s: float) -> float:
        """P(the session comes back at all | idle ``idle_s`` so far)."""
        mu, sigma = self.params(session)
        s0 = 1.0 if idle_s <= 0 else 0.5 * math.erfc((math.log(idle_s) - mu) / (sigma * math.sqrt(2)))
        p = self.p_continue()
        return p * s0 / (p * s0 + 1.0 - p)

    def expected_next_s(self, session: Hashable, idle_s: float) -> float:
        """Expected seconds until the next turn, weighted up by the chance it never comes
        (what the offload policy compares with its deep-offload threshold)."""
        return self.expected_remaining(session, idle_s) / max(self.p_alive(session, idle_s), 1e-9)

    def p_return_within(
        self, session: Hashable, idle_s: float, horizon_s: float, ends: bool = True
    ) -> float:
        """P(next turn within ``horizon_s`` | idle ``idle_s`` so far). With ``ends``, the
        session may have ended: P = p (S(t) - S(t+h)) / (p S(t) + 1 - p)."""
        mu, sigma = self.params(session)

        def sf(t: float) -> float:
            if t <= 0:
                return 1.0
            return 0.5 * math.erfc((math.log(t) - mu) / (sigma * math.sqrt(2)))

        s0 = sf(idle_s)
        s1 = sf(idle_s + horizon_s)
        if not ends:
            return 0.0 if s0 <= 0 else max(0.0, min(1.0, 1.0 - s1 / s0))
        p = self.p_continue()
        den = p * s0 + (1.0 - p)
        return 0.0 if den <= 0 else max(0.0, min(1.0, p * (s0 - s1) / den))

    def eviction_rank(self, session: Hashable, idle_s: float) -> float:
        """Higher = evict sooner: 1 - P(back within the population's median think time).
        (The median is the horizon on which a GPU-resident session's memory is contested.)"""
        horizon = math.exp(self.population_params()[0])
        return 1.0 - self.p_return_within(session, idle_s, horizon)
