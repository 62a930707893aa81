"""What the two sides of kvtier's vLLM connector share: how vLLM's blocks make chunks and
how a chunk is keyed, and a step's plan of chunk transfers (the scheduler side writes it,
the worker side carries it out). Imports nothing of vLLM, so both sides are tested
without it.

A chunk is ``chunk_blocks`` whole vLLM blocks (``chunk_tokens`` tokens, 256 by default: the
size kvtier's own engine and LMCache store), so a tier sees few large I/Os, not one per
16-token block. The full blocks past a sequence's last full chunk make its *tail* chunk,
keyed with its length (:func:`kvtier.chunk_keys.chunk_keys`), so a returning turn finds
the end of its previous turn too. With tensor or pipeline parallelism each rank stores its
own part of a chunk under the chunk's key and its rank (:meth:`ChunkGrid.rank_key`); a
lookup counts a chunk only when every rank's part is stored.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.chunk_keys import TAIL_MARKER, ChunkKey, chunk_keys
from kvtier.errors import InvalidArgumentError
from kvtier.hashing import chain_hash

DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class ChunkSpan:
    """One chunk of a request: its key (without the rank) and, for each of its blocks in
    order, the vLLM block it goes to or comes from. A load leaves the blocks marked None
    alone: those vLLM computed already, and those it must compute itself (a prompt's last
    block, whose last token vLLM needs to run)."""

    key: str
    block_ids: tuple[int | None, ...]

    @property
    def targets(self) -> list[int]:
        """The vLLM blocks a load writes."""
        return [b for b in self.block_ids if b is not None]


@dataclass
class ChunkTransfer:
    """Chunks of one request to load or save this step."""

    req_id: str
    chunks: list[ChunkSpan]
    session: str | None = None
    """The request's session (vLLM's session id), for the tiers' session-aware eviction."""


@dataclass
class StepPlan:
    """One step's work: ``finishing`` saves the last chunks of requests vLLM finished (their
    blocks are held for it), before this step's loads, which may need them; ``loads`` before
    the forward pass; ``saves`` of what the step computes, after it, in the background; and
    whether a request lost its blocks since the last step (pending saves then land before
    the forward pass may write those blocks)."""

    loads: list[ChunkTransfer] = field(default_factory=list)
    saves: list[ChunkTransfer] = field(default_factory=list)
    finishing: list[ChunkTransfer] = field(default_factory=list)
    preempted: bool = False
    prefill: bool = False
    """The step computes prompt tokens (more tokens than requests)."""

    def needs_finishing(self) -> bool:
        """A load of this step reads a chunk a finishing save writes."""
        written = {c.key for t in self.finishing for c in t.chunks}
        return any(c.key in written for t in self.loads for c in t.chunks)


class Role(enum.Enum):
    """What an instance does with kvtier (vLLM's ``kv_role``): a prefill instance of a
    disaggregated pair only saves, a decode instance only loads."""

    BOTH = "kv_both"
    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"

    @property
    def loads(self) -> bool:
        return self is not Role.PRODUCER

    @property
    def saves(self) -> bool:
        return self is not Role.CONSUMER


@dataclass(frozen=True)
class Rank:
    """Which part of the model a worker holds: its index among ``world`` = TP x PP ranks."""

    index: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.world:
            raise InvalidArgumentError(f"rank {self.index} outside a world of {self.world}")


@dataclass(frozen=True)
class ChunkGrid:
    """How a sequence of tokens in vLLM blocks of ``block_size`` is cut into chunks of
    ``chunk_blocks`` blocks and keyed under ``fingerprint`` (the model and vLLM's layout,
    the same on every rank)."""

    block_size: int
    chunk_blocks: int
    fingerprint: bytes

    @classmethod
    def of(cls, block_size: int, fingerprint: bytes, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
           ) -> ChunkGrid:
        """Chunks of ``chunk_tokens`` rounded down to whole blocks (one block at least)."""
        if block_size < 1 or chunk_tokens < 1:
            raise InvalidArgumentError("block_size and chunk_tokens must be positive")
        return cls(block_size, max(1, chunk_tokens // block_size), fingerprint)

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.chunk_blocks

    def keys(self, token_ids: Sequence[int], blocks: int | None = None) -> list[ChunkKey]:
        """Keys of the full chunks of the first ``blocks`` full blocks of ``token_ids`` (all
        of them by default), then of the tail chunk holding the rest of those blocks."""
        full = len(token_ids) // self.block_size
        blocks = full if blocks is None else min(blocks, full)
        return chunk_keys(token_ids[: blocks * self.block_size], self.chunk_tokens,
                          self.fingerprint, include_tail=True)

    def tail_key(self, token_ids: Sequence[int], parent: str | None, chunk: int, blocks: int
                 ) -> str:
        """The key of a tail chunk: ``blocks`` blocks from chunk index ``chunk`` on, after the
        full chunk keyed ``parent`` (None for the first); as :meth:`keys` makes it."""
        start = chunk * self.chunk_tokens
        tokens = token_ids[start : start + blocks * self.block_size]
        return chain_hash(bytes.fromhex(parent) if parent else None, tokens,
                          self.fingerprint + TAIL_MARKER).hex()

    @staticmethod
    def rank_key(key: str, rank: Rank) -> str:
        """The storage key of ``rank``'s part of chunk ``key`` (the key itself on one rank)."""
        return key if rank.world == 1 else f"{key}r{rank.index}w{rank.world}"
