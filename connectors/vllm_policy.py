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
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier.policies.cost_model import CostModel, LinearCost, PrefillCost, TierCost
from kvtier.policies.restore import StoredChunk, plan_restore

MIN_PREFILL_TOKENS = 64
WINDOW = 64
"""Steps (and loads per tier) remembered."""
MIN_STEPS = 3
"""Prefill steps measured before the rule is applied."""
UNMEASURED = LinearCost(0.0, 1e18)
"""A tier not measured yet: loaded from (so that it is measured)."""


@dataclass(frozen=True)
class LoadObservation:
    """One load a worker made: the bytes it scattered and how long it took."""

    req_id: str
    nbytes: int
    seconds: float


class StepMeter:
    """vLLM's prefill speed from the spacing of its step plans."""

    def __init__(self) -> None:
        self._per_token: deque[float] = deque(maxlen=WINDOW)
        self._last: tuple[float, int] | None = None

    def plan_built(self, now: float, tokens: int) -> None:
        """A step plan was built at ``now`` for a step of ``tokens`` scheduled tokens."""
        last = self._last
        if last is not None and last[1] >= MIN_PREFILL_TOKENS and now > last[0]:
            self._per_token.append((now - last[0]) / last[1])
        self._last = (now, tokens)

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
