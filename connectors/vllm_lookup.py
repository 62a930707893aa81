"""What of a prompt the store holds, asked in one round trip: the prompt's full chunks and
its candidate tail chunks, every rank's part of each, in a single ``locate``.

vLLM's scheduler waits on this question for every request it looks up (its loop is
stopped meanwhile), and through ``kvtier serve`` each question is an HTTP round trip:
asking for the stored prefix, then for the tails after it, then for the tier of the tail
found took three. The tails that may follow the stored prefix depend on how long it
is, so the candidates after every position go in the same question, up to a bound on
its size (long prompts ask the tails after the prefix in a second one).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvtier.connectors.chunk_store import ChunkStore
from kvtier.connectors.vllm_blocks import ChunkGrid, Rank

FINISHING = "finishing"
"""The tier of a chunk a finished request's final save is about to write (from vLLM's
held blocks into the fastest tier, before the load that reads it)."""

MAX_SPECULATIVE_KEYS = 512
"""Keys one lookup may ask about, every position's tails included, before the tails are
asked after the prefix is known (a second round trip). Hashing a candidate tail costs
microseconds; a round trip to a sidecar on a busy host, milliseconds."""


@dataclass(frozen=True)
class Stored:
    """One stored chunk of a prompt's prefix: its key, its blocks, the tier holding it,
    and how many of its leading blocks a load may take (not the prompt's last token's)."""

    key: str
    blocks: int
    tier: str
    take: int = 0


@dataclass(frozen=True)
class Probe:
    """What the store holds of one prompt: the leading full chunks (every rank's part),
    then the longest tail chunk after them, if any."""

    prefix: list[Stored]
    tail: Stored | None


class PrefixProbe:
    """Asks the store about a prompt's chunks: ``finishing`` are keys a final save is
    about to write (counted as stored, in :data:`FINISHING`)."""

    def __init__(self, grid: ChunkGrid, ranks: Sequence[Rank]) -> None:
        self.grid = grid
        self.ranks = list(ranks)
        self.round_trips = 0
        """Questions asked of the store so far."""

    def probe(self, store: ChunkStore, prompt: Sequence[int], full: Sequence[str], usable: int,
              finishing: Collection[str]) -> Probe:
        """The stored prefix of ``full`` (the prompt's full chunk keys) and the tail after
        it, for a prompt whose first ``usable`` blocks a load may fill."""
        per = self.grid.chunk_blocks
        tails = {c: self._tails(prompt, full, c) for c in range(len(full) + 1)}
        asked = list(full) + [k for keys in tails.values() for k in keys]
        speculate = len(asked) * len(self.ranks) <= MAX_SPECULATIVE_KEYS
        tier = self._locate(store, asked if speculate else list(full))
        prefix = []
        for key in full:
            t = FINISHING if key in finishing else tier.get(key)
            if t is None:
                break
            prefix.append(Stored(key, per, t))
        if len(prefix) * per >= usable:
            return Probe(prefix, None)
        candidates = tails[len(prefix)]
        if not speculate:
            tier = self._locate(store, candidates)
        most = len(candidates)
        for i, key in enumerate(candidates):
            t = FINISHING if key in finishing else tier.get(key)
            if t is not None:
                return Probe(prefix, Stored(key, most - i, t))
        return Probe(prefix, None)

    def _tails(self, prompt: Sequence[int], full: Sequence[str], chunk: int) -> list[str]:
        """Candidate tail keys after full chunk ``chunk - 1``, longest first: at most a
        chunk's blocks less one, and no more than the prompt's full blocks past it."""
        room = len(prompt) // self.grid.block_size - chunk * self.grid.chunk_blocks
        most = min(room, self.grid.chunk_blocks - 1)
        parent = full[chunk - 1] if chunk else None
        return [self.grid.tail_key(prompt, parent, chunk, m) for m in range(most, 0, -1)]

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
