"""The systems the policy benchmark compares: kvtier's policy and the baselines, by name.

Each is a bundle of decisions (what to restore, where GPU victims go, what every tier
evicts, when to prefetch). The baselines model the published behaviour of each system on
one serving node, not its code; ``kvtier bench policies --systems`` takes any of these
names or a dotted path to a :class:`SystemSpec` of your own.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.policies.registry import names, register, resolve


@dataclass(frozen=True)
class SystemSpec:
    name: str
    restore: str
    """none: no reuse at all; gpu: GPU prefix hits only; any: load every stored hit;
    cost: kvtier's restore-or-recompute plan (load only what beats recomputing)."""
    gpu_eviction: str = "lru"
    tier_eviction: str = "lru"
    use_tiers: bool = True
    offload_on_evict: bool = False
    """A GPU victim is written to a lower tier before it leaves (write-back)."""
    write_through: bool = False
    """Every computed chunk is written to every lower tier at once."""
    cascade: bool = False
    """A tier's victim is demoted to the next tier down."""
    store_computed: bool = False
    """kvtier: each chunk a turn computes is stored at once in the first tier where the
    write pays for itself under the load now (its chance of reuse: the session's, or about
    certain for a chunk sessions share), off the admission path; the copy is what lets its
    blocks go later with no write."""
    prefetch_on_arrival: bool = False
    """Loads start when the request arrives (queue look-ahead), not when it is scheduled."""
    prefetch_on_hint: bool = False
    """Loads start when the chat backend says the user is typing."""
    predictive: bool = False
    """Think-time predictions drive eviction order, offload depth and watermark offloads."""
    retention_value: bool = False
    """Pensieve-style: GPU and tier victims have the lowest recompute-cost / idle-time."""
    adaptive: bool = False
    """kvtier: follow whichever of its store rules (what pays, or every computed chunk in
    every tier) served recent turns best, judged on shadow replays of each
    (:mod:`~kvtier.benchmarks.policy_sim.adaptive`). Simulated only: the engine (and so
    ``--real``) stores by the ``pays`` rule alone."""
    keep_reply: bool = True
    """The GPU keeps the KV of generated tokens after a turn (vLLM caches full decode
    blocks, CachedAttention and Pensieve keep whole conversations, kvtier sessions hold
    their replies), so the next turn reuses the reply. Write-through stores prompt chunks
    only: LMCache saves KV at prefill (``save_decode_cache`` is off by default)."""


SYSTEMS = {
    "recompute-only": SystemSpec("recompute-only", restore="none", use_tiers=False),
    "vllm-like": SystemSpec("vllm-like", restore="gpu", gpu_eviction="lru", use_tiers=False),
    "lmcache-like": SystemSpec(
        "lmcache-like", restore="any", gpu_eviction="lru", tier_eviction="lru",
        write_through=True,
    ),
    "cachedattention-like": SystemSpec(
        "cachedattention-like", restore="any", gpu_eviction="session-aware",
        tier_eviction="session-aware", offload_on_evict=True, cascade=True,
        prefetch_on_arrival=True,
    ),
    "pensieve-like": SystemSpec(
        "pensieve-like", restore="any", gpu_eviction="cost-aware", tier_eviction="cost-aware",
        offload_on_evict=True, cascade=True, retention_value=True,
    ),
    "kvtier": SystemSpec(
        "kvtier", restore="cost", gpu_eviction="session-aware", tier_eviction="session-aware",
        offload_on_evict=True, cascade=True, store_computed=True, prefetch_on_arrival=True,
        prefetch_on_hint=True, predictive=True,
    ),
    "kvtier-adaptive": SystemSpec(
        "kvtier-adaptive", restore="cost", gpu_eviction="session-aware",
        tier_eviction="session-aware", offload_on_evict=True, cascade=True, store_computed=True,
        prefetch_on_arrival=True, prefetch_on_hint=True, predictive=True, adaptive=True,
    ),
}
for _name, _spec in SYSTEMS.items():
    register("system", _name)(_spec)

DEFAULT_SYSTEMS = tuple(n for n in SYSTEMS if n != "kvtier-adaptive")
"""``kvtier-adaptive`` is opt-in (``--systems``): it wins the trace family but on the
overloaded Mooncake trace it loses to kvtier (docs/policies.md)."""


def system(name: str) -> SystemSpec:
    spec = resolve("system", name)
    if callable(spec) and not isinstance(spec, SystemSpec):
        spec = spec()
    if not isinstance(spec, SystemSpec):
        from kvtier.errors import InvalidArgumentError

        raise InvalidArgumentError(f"{name!r} is not a SystemSpec; known: {', '.join(names('system'))}")
    return spec
