"""Engine configs for tests, from the flat option names tests read best
(``engine_config(num_blocks=128, tiers=None, chunk_tokens=64)``) to the one nested
:class:`~kvtier.config.KVTierConfig` the engine takes."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvtier.config import KVTierConfig, TiersConfig

POOL = {"dtype", "device", "block_size", "num_blocks", "enable_prefix_caching"}
ENGINE = {
    "max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_threads",
    "max_inflight_bytes", "stream_restore", "fingerprint_salt",
}


def engine_config(
    tiers: TiersConfig | None = None,
    policy: dict[str, Any] | None = None,
    kv_memory_bytes: int | None = None,
    chunk_tokens: int = 256,
    **flat: Any,
) -> KVTierConfig:
    """``tiers=None``: the pool only; ``policy``: the policy section's fields (watermarks
    may be a :class:`~kvtier.policies.offload.Watermarks`)."""
    unknown = set(flat) - POOL - ENGINE
    if unknown:
        raise TypeError(f"engine_config: unknown options {sorted(unknown)}")
    pool = {k: v for k, v in flat.items() if k in POOL}
    if kv_memory_bytes is not None:
        pool["memory_bytes"] = kv_memory_bytes
    policy = dict(policy or {})
    if dataclasses.is_dataclass(policy.get("watermarks")):
        policy["watermarks"] = dataclasses.asdict(policy["watermarks"])
    if policy.get("profile") is not None:
        policy["profile"] = str(policy["profile"])
    return KVTierConfig(
        pool=pool,
        engine={k: v for k, v in flat.items() if k in ENGINE},
        tiers=tiers or TiersConfig.pool_only(),
        policy=policy,
        chunk_tokens=chunk_tokens,
    )
