"""Whether a stored prefix is worth loading into vLLM: kvtier's restore-vs-recompute rule
(:func:`kvtier.policies.restore.plan_restore`, the same code the engine and the simulator
run) on costs measured for this vLLM instance.

- **Recompute**: vLLM's own prefill speed, measured from its steps: the seconds between
  two consecutive step plans over the tokens the first one scheduled, for steps that
  scheduled at least :data:`MIN_PREFILL_TOKENS` (decode steps say little of prefill). The
  lower quartile of the recent window: a step slowed by a load or followed by an idle
  engine only raises some samples.
- **Load**: each tier's read speed, from a ``kvtier calibrate`` profile where given, and
  from the loads the workers report (bytes and seconds, per request, attributed to the
  tier that held the request's chunks when that is one tier), averaged as they come.

A tier never measured is loaded from (its first loads measure it); until vLLM's prefill
speed is known every stored prefix is loaded, as before any measurement. A load from a
tier slower than recomputing the same tokens is not planned: vLLM recomputes them, and
the tokens are counted (``recomputed_by_decision``).

- **When** (:class:`LoadTiming`): a load planned, it runs either before the forward pass
  of the step that schedules the request (every request of that step waits for it) or
  parked, vLLM's async-load protocol (the request waits a whole step while its KV loads
  beside it, and is scheduled at the next). ``auto`` chooses per request: before the
  forward pass where the step's requests together wait less for the load than the loading
  request would for a step, ``(requests + 1) x load time <= step time``, on the measured
  step spacing and tier speed; parked where either is unknown.
"""

from __future__ import annotations

import enum
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.policies.cost_model import CostModel, LinearCost, PrefillCost, TierCost
from kvtier.policies.restore import StoredChunk, plan_restore

MIN_PREFILL_TOKENS = 64
WINDOW = 64
"""Steps (and loads per tier) remembered."""
MIN_STEPS = 3
"""Prefill steps measured before the rule is applied."""
UNMEASURED = LinearCost(0.0, 1e18)
"""A tier not measured yet: loaded from (so that it is measured)."""


class LoadTiming(enum.Enum):
    """When a planned load runs (the connector's ``async_loads``)."""

    PARKED = "async"
    """vLLM's async-load protocol: the request is parked while its KV loads beside a
    step, and scheduled at the next (``async_loads: true``)."""
    BEFORE_FORWARD = "sync"
    """Before the forward pass of the step that schedules the request (``false``)."""
    AUTO = "auto"
    """Per request, whichever delays vLLM's requests less (:meth:`LoadPolicy.parks`)."""

    @classmethod
    def of(cls, value: object) -> LoadTiming:
        """``async_loads`` as configured: true, false (JSON or strings) or ``auto``."""
        text = str(value).strip().lower()
        if text in ("true", "1", "yes", "async"):
            return cls.PARKED
        if text in ("false", "0", "no", "sync"):
            return cls.BEFORE_FORWARD
        if text == "auto":
            return cls.AUTO
        raise ConfigError(f"kvtier connector: async_loads must be true, false or auto, not {value!r}")


@dataclass(frozen=True)
class LoadObservation:
    """One load a worker made: the bytes it scattered and how long it took."""

    req_id: str
    nbytes: int
    seconds: float


class StepMeter:
    """vLLM's prefill speed and step time from the spacing of its step plans."""

    def __init__(self) -> None:
        self._per_token: deque[float] = deque(maxlen=WINDOW)
        self._spacing: deque[float] = deque(maxlen=WINDOW)
        self._last: tuple[float, int] | None = None
        self.requests = 0
        """Requests the last step scheduled."""

    def plan_built(self, now: float, tokens: int, requests: int = 0) -> None:
        """A step plan was built at ``now`` for a step of ``tokens`` scheduled tokens of
        ``requests`` requests."""
        last = self._last
        if last is not None and now > last[0]:
            self._spacing.append(now - last[0])
            if last[1] >= MIN_PREFILL_TOKENS:
                self._per_token.append((now - last[0]) / last[1])
        self._last = (now, tokens)
        self.requests = requests

    def step_s(self) -> float | None:
        """A typical step's seconds, plan to plan (the median of the recent ones: an idle
        engine's long gaps are few); None until measured."""
        if len(self._spacing) < MIN_STEPS:
            return None
        return statistics.median(self._spacing)

    def per_token_s(self) -> float | None:
        """Seconds per prefill token (None until measured)."""
        if len(self._per_token) < MIN_STEPS:
            return None
        return statistics.quantiles(self._per_token, n=4)[0]


class LoadPolicy:
    """Restore or recompute, per request, for a vLLM worker's KV of ``kv_bytes_per_token``
    (one rank's share) in ``num_layers`` layers."""

    def __init__(self, kv_bytes_per_token: int, num_layers: int,
                 tiers: Mapping[str, TierCost] | None = None, enabled: bool = True) -> None:
        self.kv_bytes_per_token = kv_bytes_per_token
        self.num_layers = num_layers
        self.tiers: dict[str, TierCost] = dict(tiers or {})
        self.enabled = enabled
        self.steps = StepMeter()
        self._before_forward_s = 0.0
        """Predicted seconds of the loads chosen to run before the next step's forward."""

    def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
        """A load of ``nbytes`` from ``tier`` took ``seconds`` (end to end, as vLLM waits)."""
        if nbytes <= 0 or seconds <= 0:
            return
        known = self.tiers.get(tier)
        if known is None:
            seen = LinearCost(0.0, nbytes / seconds)
            self.tiers[tier] = TierCost(tier, seen, seen)
        else:
            self.tiers[tier] = known.observe_read(nbytes, seconds, weight=0.3)

    def chunks_to_load(self, chunks: Sequence[StoredChunk], prompt_tokens: int,
                       cached_tokens: int) -> int:
        """How many leading ``chunks`` (each with the tokens it brings past
        ``cached_tokens``, and its tier) to load for a prompt of ``prompt_tokens``."""
        per_token = self.steps.per_token_s()
        if not self.enabled or per_token is None or not chunks:
            return len(chunks)
        tiers = {c.tier: self.tiers.get(c.tier) or TierCost(c.tier, UNMEASURED, UNMEASURED)
                 for c in chunks}
        cost = CostModel("vllm", "", self.kv_bytes_per_token, self.num_layers,
                         PrefillCost(0.0, per_token, 0.0), tiers)
        return plan_restore(cost, chunks, prompt_tokens, cached_tokens, overlap=False).load_chunks

    def parks(self, nbytes: Mapping[str, int]) -> bool:
        """Whether a load of ``nbytes`` from each tier is better parked (vLLM's async-load
        protocol: the request waits one step) than run before the forward pass of the
        step that schedules it (the step's requests all wait for it, and for the other
        loads chosen so for that step). Parked where the step time or a tier's speed is
        not known yet."""
        step = self.steps.step_s()
        if step is None or any(tier not in self.tiers for tier in nbytes):
            return True
        seconds = sum(self.tiers[tier].read.time(n) for tier, n in nbytes.items())
        if (self.steps.requests + 1) * (self._before_forward_s + seconds) > step:
            return True
        self._before_forward_s += seconds
        return False

    def step_planned(self) -> None:
        """The step's plan is built: the loads chosen to run before its forward are in it."""
        self._before_forward_s = 0.0
