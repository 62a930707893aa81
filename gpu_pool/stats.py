"""A snapshot of the pool's occupancy and efficiency, for logs, metrics and benchmarks."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int
    block_size: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    """Blocks registered in the prefix cache (referenced or not)."""
    blocks_evictable: int
    """Free blocks that still hold cached content."""
    num_sequences: int
    tokens_stored: int
    """Distinct token slots holding KV of live sequences (shared blocks counted once)."""
    utilisation: float
    """tokens_stored / (blocks referenced by sequences x block_size)."""
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    alloc_calls: int
    alloc_blocks: int
    alloc_ns_per_block: float
    evictions: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)
