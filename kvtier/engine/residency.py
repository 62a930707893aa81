"""Where each session's KV is meant to be, in one place: which sessions hold blocks of the
pool, by their chained block hashes, and how many of them hold each block.

An offload frees a session's blocks but keeps those another resident session shares (a
system prompt), at O(its own blocks): each session's hashes are kept, with a count per
hash. Whether a session's KV is stored below (``ChatSession.stored_tokens``,
``offloaded``) is the session's own record; this is the pool side of it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from kvtier.engine.session import ChatSession
from kvtier.hashing import chain_hashes


class Residency:
    """``on_leave(session_id, block_hashes)`` is told when a session's KV leaves the pool
    (the live policy's ``left_pool``: the blocks are what it watches being asked for
    again)."""

    def __init__(self, block_size: int, fingerprint: bytes,
                 on_leave: Callable[[str, list[bytes]], None] | None = None) -> None:
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.on_leave = on_leave
        self._hashes: dict[str, list[bytes]] = {}
        self._count: Counter[bytes] = Counter()

    def set(self, session: ChatSession, resident: bool) -> None:
        """The session's KV is in the pool (all of its full blocks) or has left it."""
        old = self._hashes.pop(session.session_id, None)
        if not resident and self.on_leave is not None:
            self.on_leave(session.session_id, old or [])
        for h in old or ():
            self._count[h] -= 1
            if self._count[h] <= 0:
                del self._count[h]
        if resident:
            hashes = chain_hashes(session.token_ids, self.block_size, self.fingerprint)
            self._hashes[session.session_id] = hashes
            self._count.update(hashes)

    def held_by_others(self, hashes: list[bytes]) -> list[bytes]:
        """Of ``hashes``, those some resident session holds."""
        return [h for h in hashes if self._count[h] > 0]

    def sessions(self) -> Iterator[tuple[str, int]]:
        """Resident sessions and how many full blocks each holds."""
        for sid, hashes in self._hashes.items():
            yield sid, len(hashes)
