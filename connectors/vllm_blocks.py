"""What the two sides of kvtier's vLLM connector share: how vLLM's blocks make chunks and
how a chunk is keyed, and a step's plan of chunk transfers (the scheduler side writes it,
the worker side carries it out). Imports nothing of vLLM, so both sides are tested
without it.

A chunk is ``chunk_blocks`` whole vLLM blocks (``chunk_tokens`` tokens, 256 by default:
the size kvtier's own engine and LMCache store), so a tier sees few large I/Os, not one
per 16-token block. A chunk-sized stretch of a sequence (a *slot*) may be stored in
pieces, *segments*, saved turn by turn as a conversation grows (:class:`SequenceKeys`): a
returning turn finds the end of its previous turn, and a turn uploads only the blocks the
store lacks. With tensor or pipeline parallelism each rank stores its own part of a chunk
under the chunk's key and its rank (:meth:`ChunkGrid.rank_key`); a lookup counts a chunk
only when every rank's part is stored.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.chunk_keys import TAIL_MARKER, ChunkKey, chunk_keys
from kvtier.errors import InvalidArgumentError
from kvtier.hashing import TOKEN_BYTES, chain_hash_encoded, encode_tokens

DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class DerivedFrom:
    """A stored segment holding a span's blocks, from its block ``offset`` on: the span is
    cut out of it inside the store, not uploaded (its blocks are saved already)."""

    key: str
    offset: int


@dataclass(frozen=True)
class ChunkSpan:
    """One chunk of a request: its key (without the rank) and, for each of its blocks in
    order, the vLLM block it goes to or comes from. A load leaves the blocks marked None
    alone: those vLLM computed already, and those it must compute itself (a prompt's last
    block, whose last token vLLM needs to run)."""

    key: str
    block_ids: tuple[int | None, ...]
    first_block: int = 0
    """Where the chunk starts in its sequence, in blocks: its place in the session's chain
    (a session-aware tier gives up a session's last chunks first, keeping a usable
    prefix)."""
    source: DerivedFrom | None = None
    """A save's: a stored segment that holds these blocks already (a save tries to cut
    the chunk out of it first, and writes its blocks where that fails)."""

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
    parked: bool = False
    """A load's: vLLM parked the request while it loads (its async-load protocol: on the
    loading thread); else it is loaded before the step's forward pass."""


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
    idle: bool = False
    """The step computes nothing: vLLM steps only to hear whether the saves its finished
    requests' blocks are held for have landed."""

    def needs_finishing(self, loads: list[ChunkTransfer] | None = None) -> bool:
        """A load of this step (of ``loads``) reads a chunk a finishing save writes."""
        written = {c.key for t in self.finishing for c in t.chunks}
        return any(c.key in written for t in (self.loads if loads is None else loads)
                   for c in t.chunks)

    def parked_loads(self) -> list[ChunkTransfer]:
        """The loads of requests vLLM parked (on the loading thread)."""
        return [t for t in self.loads if t.parked]

    def loads_before_forward(self) -> list[ChunkTransfer]:
        """The loads that run before the step's forward pass."""
        return [t for t in self.loads if not t.parked]


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

    def slot_keys(self, token_ids: Sequence[int], parent: str | None, slot: int, blocks: int
                  ) -> list[str]:
        """The keys of slot ``slot``'s first ``b`` blocks, ``b`` = 1 .. ``blocks``, after the
        full chunk keyed ``parent`` (None for the first): tail keys, and the full chunk's
        where ``blocks`` fills the slot; as :meth:`keys` makes them. The slot's tokens are
        encoded once for all of them."""
        start, bs = slot * self.chunk_tokens, self.block_size
        data = memoryview(encode_tokens(token_ids[start : start + blocks * bs]))
        up = bytes.fromhex(parent) if parent else None
        tail = self.fingerprint + TAIL_MARKER
        out = [chain_hash_encoded(up, data[: b * bs * TOKEN_BYTES], b * bs, tail).hex()
               for b in range(1, min(blocks, self.chunk_blocks - 1) + 1)]
        if blocks == self.chunk_blocks:
            out.append(chain_hash_encoded(up, data, blocks * bs, self.fingerprint).hex())
        return out

    @staticmethod
    def rank_key(key: str, rank: Rank) -> str:
        """The storage key of ``rank``'s part of chunk ``key`` (the key itself on one rank)."""
        return key if rank.world == 1 else f"{key}r{rank.index}w{rank.world}"


@dataclass(frozen=True)
class Segment:
    """Blocks ``[first, first + blocks)`` of a sequence, within one slot, stored as one
    chunk under ``key``."""

    key: str
    first: int
    blocks: int

    @property
    def end(self) -> int:
        return self.first + self.blocks


class SequenceKeys:
    """The keys of a token sequence's segments. Slot ``s`` is the sequence's blocks
    ``[s * chunk_blocks, (s + 1) * chunk_blocks)``; its segment of blocks ``[a, b)`` (counted
    within the slot) is keyed by the hash of every token through block ``b`` (the slot's
    full chunk key where ``b`` is the whole slot, a tail key otherwise) and, unless the
    segment starts the slot, by ``a``: a whole slot saved at once, or a sequence's last
    blocks saved at its end, keep the keys :meth:`ChunkGrid.keys` gives them, and a turn
    that adds blocks to a slot another turn began stores only those (``a`` > 0).
    The keys are computed once, when made, a lookup's candidates once per slot, when first
    asked for (the scheduler's threads share them)."""

    def __init__(self, grid: ChunkGrid, token_ids: Sequence[int],
                 prefix: SequenceKeys | None = None) -> None:
        """``prefix``: the keys of a sequence ``token_ids`` begins with (a request's
        prompt, for its prompt and reply): its whole slots' keys are taken, not hashed
        again."""
        self.grid = grid
        self.full_blocks = len(token_ids) // grid.block_size
        per = grid.chunk_blocks
        self._ends: list[list[str]] = []
        """Per slot, the key of its blocks through ``b`` (``b`` = 1, 2, ...)."""
        self._candidates: dict[int, list[tuple[int, int, str]]] = {}
        parent = None
        if prefix is not None and prefix.grid == grid:
            whole = min(prefix.full_blocks, self.full_blocks) // per
            self._ends = [list(ends) for ends in prefix._ends[:whole]]
            parent = self._ends[-1][-1] if whole else None
        for s in range(len(self._ends), -(-self.full_blocks // per)):
            n = self.slot_blocks(s)
            ends = grid.slot_keys(token_ids, parent, s, n)
            if n == per:
                parent = ends[-1]
            self._ends.append(ends)

    @property
    def slots(self) -> int:
        return len(self._ends)

    def slot_blocks(self, slot: int) -> int:
        """Full blocks of the sequence in ``slot``."""
        per = self.grid.chunk_blocks
        return max(0, min(per, self.full_blocks - slot * per))

    def full_key(self, slot: int) -> str | None:
        """The key of ``slot`` stored whole (None where the sequence does not fill it)."""
        n = self.slot_blocks(slot)
        return self._ends[slot][-1] if n == self.grid.chunk_blocks else None

    def run_key(self, end: int) -> str:
        """The key of the tokens of block ``end``'s slot up to block ``end`` (every token
        before them chained in): equal in two sequences exactly when their tokens through
        block ``end`` are."""
        slot, b = divmod(end - 1, self.grid.chunk_blocks)
        return self._ends[slot][b]

    def segment(self, first: int, end: int) -> Segment:
        """The segment of blocks ``[first, end)`` (within one slot)."""
        per = self.grid.chunk_blocks
        slot, a = divmod(first, per)
        b = end - slot * per
        if not (0 <= a < b <= self.slot_blocks(slot)):
            raise InvalidArgumentError(f"blocks [{first}, {end}) are not a segment of one slot")
        base = self._ends[slot][b - 1]
        return Segment(base if a == 0 else f"{base}-{a}", first, end - first)

    def candidates(self, slot: int) -> list[Segment]:
        """Every segment ``slot`` may hold."""
        base = slot * self.grid.chunk_blocks
        return [Segment(key, base + a, b - a) for a, b, key in self.candidate_keys(slot)]

    def candidate_keys(self, slot: int) -> list[tuple[int, int, str]]:
        """``(a, b, key)`` of every segment ``slot`` may hold, blocks ``[a, b)`` within it,
        ``b`` ascending, then ``a``: what a lookup asks about (made once per slot; vLLM
        asks again each step about a request it could not schedule)."""
        got = self._candidates.get(slot)
        if got is None:
            ends = self._ends[slot][: self.slot_blocks(slot)]
            got = self._candidates[slot] = [
                (a, b, end if a == 0 else f"{end}-{a}")
                for b, end in enumerate(ends, 1) for a in range(b)]
        return got
