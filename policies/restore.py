"""Restore or recompute: how much of a resuming session's stored prefix to load.

Loading chunk ``i`` saves recomputing its tokens but costs its transfer from the tier that
holds it. The plan picks the number of leading chunks ``k`` (0 = recompute everything) that
minimises predicted time to first token. With layer-wise overlap, layer ``l`` computes while
layer ``l + 1`` loads, so loading and compute overlap except for one layer's share of the
smaller of the two; without it (overlap off, or a restore smaller than the cost model's
``stream_min_tokens``, which the engine does not stream) they add up. Each tier's share is
read in one request. A tier slower than recomputing is never chosen.

Under load the plan weighs each resource's time by what it costs everyone
(:mod:`kvtier.policies.load`): the turn holds the GPU until its first token, so its
predicted TTFT counts at the GPU's weight, and a load also delays whatever else queues on
its tier's link, which counts at that link's weight; transfers already queued on a link
delay the load. Idle, this is the plain lowest-TTFT plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.policies.cost_model import CostModel
from kvtier.policies.load import IDLE, LoadWeights


@dataclass(frozen=True)
class StoredChunk:
    tokens: int
    tier: str


@dataclass(frozen=True)
class RestorePlan:
    load_chunks: int
    load_tokens: int
    recompute_tokens: int
    predicted_ttft_s: float
    recompute_all_ttft_s: float

    @property
    def recompute_all(self) -> bool:
        return self.load_chunks == 0


def predicted_ttft(
    cost: CostModel,
    chunks: Sequence[StoredChunk],
    k: int,
    prompt_tokens: int,
    cached_tokens: int = 0,
    overlap: bool = True,
    head_start_s: float = 0.0,
    load_weights: LoadWeights = IDLE,
) -> float:
    """TTFT (from when compute can start) if the first ``k`` stored chunks are loaded and
    the rest of the prompt computed. ``cached_tokens`` are already in the pool (free);
    ``chunks`` are the stored ones after them, each with the new tokens it brings.
    ``head_start_s``: the loads began that long before compute can start (a turn waiting
    in the queue while its KV is fetched): that much of them is already done.
    ``load_weights``: only its links' queued transfers count here (the load waits for
    the longest of them)."""
    loaded = sum(c.tokens for c in chunks[:k])
    have = cached_tokens + loaded
    per_tier = tokens_per_tier(chunks[:k])
    load = sum(cost.load_time(tier, tokens) for tier, tokens in per_tier.items())
    if load > 0:
        load += max(0.0, *(load_weights.wait(tier) for tier in per_tier))
        load = max(load - head_start_s, 1e-9)
    compute = cost.prefill.time(have, max(prompt_tokens - have, 1))
    if not overlap or load == 0 or not cost.overlaps(loaded):
        return load + compute
    per_layer = min(load, compute) / max(cost.num_layers, 1)
    return max(load, compute) + per_layer


def tokens_per_tier(chunks: Sequence[StoredChunk]) -> dict[str, int]:
    per_tier: dict[str, int] = {}
    for c in chunks:
        per_tier[c.tier] = per_tier.get(c.tier, 0) + c.tokens
    return per_tier


def plan_restore(
    cost: CostModel,
    chunks: Sequence[StoredChunk],
    prompt_tokens: int,
    cached_tokens: int = 0,
    overlap: bool = True,
    head_start_s: float = 0.0,
    load_weights: LoadWeights = IDLE,
) -> RestorePlan:
    """The ``k`` with the lowest cost to everyone (ties go to loading less): its predicted
    TTFT at the GPU's weight plus each tier's load time at what that link's weight adds
    (the module docstring); ``head_start_s`` as in :func:`predicted_ttft`."""
    w = load_weights

    def objective(k: int, ttft: float) -> float:
        extra = sum((w.link(tier) - 1.0) * cost.load_time(tier, tokens)
                    for tier, tokens in tokens_per_tier(chunks[:k]).items())
        return w.compute * ttft + extra

    scratch = predicted_ttft(cost, chunks, 0, prompt_tokens, cached_tokens, overlap)
    best_k, best_ttft, best = 0, scratch, objective(0, scratch)
    for k in range(1, len(chunks) + 1):
        t = predicted_ttft(cost, chunks, k, prompt_tokens, cached_tokens, overlap, head_start_s, w)
        o = objective(k, t)
        if o < best:
            best_k, best_ttft, best = k, t, o
    loaded = sum(c.tokens for c in chunks[:best_k])
    have = cached_tokens + loaded
    return RestorePlan(best_k, loaded, max(prompt_tokens - have, 0), best_ttft, scratch)
