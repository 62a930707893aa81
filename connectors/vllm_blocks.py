"""What the two sides of kvtier's vLLM connector share: a step's plan of block transfers
(the scheduler side writes it, the worker side carries it out), and how a vLLM block is
keyed. Imports nothing of vLLM, so both sides are tested without it."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.chunk_keys import chunk_keys


@dataclass
class BlockTransfer:
    """Blocks of one request to load or save this step, with their chunk keys."""

    req_id: str
    block_ids: list[int]
    keys: list[str]


@dataclass
class StepPlan:
    """One step's loads (before the forward pass) and saves (after it)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


def block_keys(token_ids: list[int], block_size: int, fingerprint: bytes) -> list[str]:
    """The chunk key of each full block of ``token_ids``: kvtier's chained hash over the
    block's tokens under ``fingerprint`` (the model and vLLM's KV layout), so the scheduler
    and the workers agree on keys without sharing Python's hash seed."""
    return [k.key for k in chunk_keys(token_ids, block_size, fingerprint, False)]
