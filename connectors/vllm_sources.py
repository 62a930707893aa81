"""Which stored segment already holds a segment's blocks, so that a save cuts it out of
that one inside the store instead of uploading them again.

A segment is keyed by every token through its last block, so two conversations that share
blocks inside a slot store them in different segments: the first to save one (a shared
system prompt that ends mid-slot, then that conversation's own message) stores them in a
segment running into its own tokens; the second, whose save ends a segment where the
shared blocks end so that later requests find them, would upload those blocks again.
:class:`SegmentSources` remembers, for each segment this instance saved or found stored,
the key of its tokens through each of its blocks (:meth:`SequenceKeys.run_key`), and
answers for a segment about to be saved with a stored one whose blocks begin with it.
A source may have been evicted since: the save then writes its blocks (never wrong KV,
only a lost shortcut).
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.connectors.vllm_blocks import DerivedFrom, Segment, SequenceKeys

REMEMBERED_RUNS = 1 << 16
"""Runs remembered (a few per segment: at most a slot's blocks), the oldest forgotten
first: about 20 MB of keys."""


class SegmentSources:
    def __init__(self, limit: int = REMEMBERED_RUNS) -> None:
        self.limit = limit
        self._runs: OrderedDict[str, tuple[str, int]] = OrderedDict()
        """Run key (tokens through a block) -> (stored segment's key, its first block)."""

    def remember(self, seq: SequenceKeys, seg: Segment) -> None:
        """``seg`` of ``seq`` is stored (or being saved, ahead of any save that cuts it)."""
        for end in range(seg.first + 1, seg.end + 1):
            run = seq.run_key(end)
            self._runs[run] = (seg.key, seg.first)
            self._runs.move_to_end(run)
        while len(self._runs) > self.limit:
            self._runs.popitem(last=False)

    def segments(self, seq: SequenceKeys, start: int, stop: int, shared: int = 0
                 ) -> list[Segment]:
        """Blocks ``[start, stop)`` of ``seq`` as segments to save: cut at the slots'
        bounds, and within a slot where vLLM's prefix cache hit ended (``shared``: another
        request computed those blocks, so others share them too) or else where the blocks
        a remembered segment holds end (:meth:`known_end`)."""
        per, out = seq.grid.chunk_blocks, []
        while start < stop:
            end = min(stop, (start // per + 1) * per)
            cut = shared if start < shared < end else self.known_end(seq, start, end)
            if start < cut < end:
                out.append(seq.segment(start, cut))
                start = cut
            out.append(seq.segment(start, end))
            start = end
        return out

    def known_end(self, seq: SequenceKeys, start: int, stop: int) -> int:
        """The last block ``b`` in ``(start, stop]``, within ``start``'s slot, through which
        a remembered segment starting no later than ``start`` holds ``seq``'s tokens; 0
        where there is none. A save that ends a segment there cuts its first blocks out
        of that one (another conversation saving the same shared blocks at the same time,
        a reply regenerated over the same prompt) and uploads only the rest."""
        per = seq.grid.chunk_blocks
        for end in range(min(stop, (start // per + 1) * per), start, -1):
            found = self._runs.get(seq.run_key(end))
            if found is not None and found[1] <= start:
                return end
        return 0

    def source_of(self, seq: SequenceKeys, seg: Segment) -> DerivedFrom | None:
        """A remembered segment holding ``seg``'s blocks (the same tokens through its
        end, from a block no later than its first), or None."""
        found = self._runs.get(seq.run_key(seg.end))
        if found is None:
            return None
        key, first = found
        if key == seg.key or first > seg.first:
            return None
        return DerivedFrom(key, seg.first - first)
