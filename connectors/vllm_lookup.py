"""What of a prompt the store holds, asked in as few round trips as may be: the segments
(:class:`~kvtier.connectors.vllm_blocks.SequenceKeys`) that cover the longest stored prefix
of the prompt's full blocks, every rank's part of each.

vLLM's scheduler waits on this question for every request it looks up (its loop is
stopped meanwhile), and through ``kvtier serve`` each question is an HTTP round trip. So
the first asks about every slot stored whole and every segment each slot may hold, as many
slots' as a bound on its size allows; a slot neither stored whole nor asked about in
pieces is asked about in another (long prompts: their stored prefix is mostly whole
chunks, found in the first).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvtier.connectors.chunk_store import ChunkStore
from kvtier.connectors.vllm_blocks import ChunkGrid, Rank, SequenceKeys

FINISHING = "finishing"
"""The tier of a chunk a finished request's final save is about to write (from vLLM's
held blocks into the fastest tier, before the load that reads it)."""

MAX_SPECULATIVE_KEYS = 512
"""Keys one lookup may ask about (every rank's part counted) beyond the slots stored whole,
before the segments of further slots are asked about in another round trip. Hashing a
key costs microseconds; a round trip to a sidecar on a busy host, milliseconds."""


@dataclass(frozen=True)
class Stored:
    """One stored segment of a prompt's prefix: its key, its blocks, the tier holding it,
    and how many of its leading blocks a load may take (not the prompt's last token's)."""

    key: str
    blocks: int
    tier: str
    take: int = 0


class PrefixProbe:
    """Asks the store about a prompt's segments: ``finishing`` are keys a final save is
    about to write (counted as stored, in :data:`FINISHING`)."""

    def __init__(self, ranks: Sequence[Rank]) -> None:
        self.ranks = list(ranks)
        self.round_trips = 0
        """Questions asked of the store so far."""

    def probe(self, store: ChunkStore, seq: SequenceKeys, finishing: Collection[str] = ()
              ) -> list[Stored]:
        """The stored segments, in order, that cover the longest stored prefix of ``seq``'s
        full blocks (the fewest segments that reach it)."""
        room = MAX_SPECULATIVE_KEYS // len(self.ranks)
        whole = [k for s in range(seq.slots) if (k := seq.full_key(s)) is not None]
        pieces, asked = _pieces(seq, 0, room - len(whole), at_least_one=False)
        tier = self._locate(store, whole + pieces)
        out: list[Stored] = []
        for slot in range(seq.slots):
            key = seq.full_key(slot)
            found = None if key is None else FINISHING if key in finishing else tier.get(key)
            if key is not None and found is not None:
                out.append(Stored(key, seq.grid.chunk_blocks, found))
                continue
            if slot >= asked:
                pieces, asked = _pieces(seq, slot, room, at_least_one=True)
                tier.update(self._locate(store, pieces))
            cover = _cover(seq, slot, tier, finishing)
            out += cover
            if sum(s.blocks for s in cover) < seq.grid.chunk_blocks:
                break
        return out

    def _locate(self, store: ChunkStore, keys: list[str]) -> dict[str, str]:
        """Key -> the tier of its first rank's part, for the keys whose every rank's part
        is stored (one round trip)."""
        if not keys:
            return {}
        parts = [ChunkGrid.rank_key(k, r) for r in self.ranks for k in keys]
        self.round_trips += 1
        where = store.locate(parts)
        n = len(keys)
        return {k: where[i] for i, k in enumerate(keys)
                if where[i] is not None and all(where[r * n + i] is not None
                                                for r in range(1, len(self.ranks)))}


def _pieces(seq: SequenceKeys, first: int, room: int, at_least_one: bool
            ) -> tuple[list[str], int]:
    """The segment keys of slots ``first``, ``first + 1``, ... that fit in ``room`` keys,
    and the first slot left out."""
    keys: list[str] = []
    slot = first
    while slot < seq.slots:
        whole = seq.full_key(slot)  # asked about with every slot's in the first question
        more = [key for _, _, key in seq.candidate_keys(slot) if key != whole]
        if len(keys) + len(more) > room and not (at_least_one and slot == first):
            break
        keys += more
        slot += 1
    return keys, slot


def _cover(seq: SequenceKeys, slot: int, tier: dict[str, str], finishing: Collection[str]
           ) -> list[Stored]:
    """The fewest stored segments of ``slot`` that cover its longest stored beginning."""
    best: dict[int, list[Stored]] = {0: []}
    for a, b, key in seq.candidate_keys(slot):  # b ascending: best[a] is final when asked
        if a not in best:
            continue
        found = FINISHING if key in finishing else tier.get(key)
        if found is not None and (b not in best or len(best[a]) + 1 < len(best[b])):
            best[b] = [*best[a], Stored(key, b - a, found)]
    return best[max(best)]
