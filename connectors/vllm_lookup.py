"""What of a prompt the store holds, asked in as few round trips as may be: the segments
(:class:`~kvtier.connectors.vllm_blocks.SequenceKeys`) that cover the longest stored prefix
of the prompt's full blocks, every rank's part of each.

vLLM's scheduler waits on this question for every request it looks up (its loop is
stopped meanwhile), and through ``kvtier serve`` each question is an HTTP round trip. So
the first asks about every slot stored whole and every segment each slot may hold, as many
slots' as a bound on its size allows; a slot neither stored whole nor asked about in
pieces is asked about in another (long prompts: their stored prefix is mostly whole
chunks, found in the first).

vLLM looks up the requests it schedules in one pass one after the other; several that
arrived together (users whose replies ended in the same step send their next messages
at once) are asked about in that first question together (:class:`PassLookups`): one round
trip a pass, not one a request, each waiting on a busy sidecar.
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

MAX_PASS_KEYS = 4 * MAX_SPECULATIVE_KEYS
"""Keys the first question of several requests looked up together may hold (a request
left out is asked about in a round trip of its own)."""


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

    @property
    def _room(self) -> int:
        """Keys of one rank's parts a question may hold beyond the slots stored whole."""
        return MAX_SPECULATIVE_KEYS // len(self.ranks)

    def probe(self, store: ChunkStore, seq: SequenceKeys, finishing: Collection[str] = ()
              ) -> list[Stored]:
        """The stored segments, in order, that cover the longest stored prefix of ``seq``'s
        full blocks (the fewest segments that reach it)."""
        return self.probe_many(store, [seq], finishing)[0]

    def probe_many(self, store: ChunkStore, seqs: Sequence[SequenceKeys],
                   finishing: Collection[str] = ()) -> list[list[Stored]]:
        """:meth:`probe` of the leading ``seqs`` whose first questions fit in one round trip
        of :data:`MAX_PASS_KEYS` keys (the first always), asked together; a long prompt's
        further slots in questions of its own. One answer per sequence asked about."""
        room = self._room
        first: dict[str, None] = {}
        asked: list[int] = []
        for seq in seqs:
            whole = [k for s in range(seq.slots) if (k := seq.full_key(s)) is not None]
            pieces, upto = _pieces(seq, 0, room - len(whole), at_least_one=False)
            if asked and (len(first) + len(whole) + len(pieces)) * len(self.ranks) > MAX_PASS_KEYS:
                break
            first.update(dict.fromkeys(whole + pieces))
            asked.append(upto)
        tier = self._locate(store, list(first))
        return [self._walk(store, seq, dict(tier), upto, finishing)
                for seq, upto in zip(seqs, asked, strict=False)]

    def _walk(self, store: ChunkStore, seq: SequenceKeys, tier: dict[str, str], asked: int,
              finishing: Collection[str]) -> list[Stored]:
        """``seq``'s stored segments from the answers in ``tier`` (slots up to ``asked``
        asked about in pieces), asking about further slots' pieces where it gets there."""
        room = self._room
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


class PassLookups:
    """The lookups of one scheduling pass of vLLM's asked together: the first request it
    looks up brings every request that arrived and was not looked up yet into the same
    round trip, and their answers wait for their own lookups in the pass. An answer lives
    until the pass ends (:meth:`pass_ended`): the store may change before the next.

    A request that arrived and was not looked up in the pass after it (it waits in the
    queue) is named by :meth:`pass_ended`, with its answer where one was asked, so that its
    chunks can be raised into RAM while it waits."""

    def __init__(self, probe: PrefixProbe) -> None:
        self._probe = probe
        self._unasked: dict[str, SequenceKeys] = {}
        """Requests that arrived and were not looked up since, in arrival order."""
        self._answers: dict[str, list[Stored]] = {}
        """Answers asked in this pass for requests not looked up yet."""

    def arrived(self, req_id: str, seq: SequenceKeys) -> None:
        self._unasked[req_id] = seq

    def lookup(self, store: ChunkStore, req_id: str, seq: SequenceKeys,
               finishing: Collection[str] = ()) -> list[Stored]:
        """The stored segments of ``seq`` (:meth:`PrefixProbe.probe`), asked with every
        arrived request's not asked about yet, or taken from that question's answer."""
        self._unasked.pop(req_id, None)
        answer = self._answers.pop(req_id, None)
        if answer is not None:
            return answer
        others = [(r, s) for r, s in self._unasked.items() if r not in self._answers]
        answers = self._probe.probe_many(store, [seq, *(s for _, s in others)], finishing)
        for (other, _), found in zip(others, answers[1:], strict=False):
            self._answers[other] = found
        return answers[0]

    def pass_ended(self) -> list[tuple[SequenceKeys, list[Stored] | None]]:
        """The requests that arrived and were not looked up in this pass, each with the
        answer asked about it in the pass where there is one; forgets them, and every
        answer."""
        waiting = [(seq, self._answers.get(r)) for r, seq in self._unasked.items()]
        self._unasked.clear()
        self._answers.clear()
        return waiting

    def forget(self, req_id: str) -> None:
        """``req_id`` finished (or was aborted) before it was looked up."""
        self._unasked.pop(req_id, None)
        self._answers.pop(req_id, None)
