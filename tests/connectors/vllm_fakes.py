"""vLLM's interfaces faked at the connector's boundary: the few fields of its requests,
allocations and scheduler outputs the scheduler side reads, and per-layer cache tensors in
both layouts vLLM's attention backends use. The connector's own code runs as it is."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

BLOCK = 16
LAYERS = 3
HEADS = 2
DIM = 8


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass
class NewRequest:
    req_id: str
    block_ids: tuple[list[int]]
    num_computed_tokens: int


@dataclass
class CachedRequests:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int]] | None] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequest] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequests = field(default_factory=CachedRequests)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)


def caches(num_blocks: int, blocks_first: bool, seed: int = 0,
           dtype: torch.dtype = torch.float16, heads: int = HEADS, dim: int = DIM
           ) -> dict[str, torch.Tensor]:
    """Per-layer caches ``[num_blocks, 2, block, heads, dim]`` (``blocks_first``) or
    ``[2, num_blocks, block, heads, dim]``, filled with random KV."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 2, BLOCK, heads, dim) if blocks_first else (2, num_blocks, BLOCK, heads, dim)
    return {f"layer.{i}": torch.randn(shape, generator=g).to(dtype) for i in range(LAYERS)}


def strided(kv: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same caches as views into wider tensors: not contiguous, so no host (numpy) view
    of them exists and the worker copies them as it does a device cache's."""
    out = {}
    for name, t in kv.items():
        wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 8, dtype=t.dtype)
        out[name] = wide[..., : t.shape[-1]]
        out[name].copy_(t)
    return out
