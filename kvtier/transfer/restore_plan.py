"""What a restore would find, before it reads a byte: the prefix it may bring back, the
tokens of it still cached in the pool, and the stored chunks after them with the tiers they
lie in (the restore-or-recompute plan asks this first; the restore then reads what it saw
without asking every tier again)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.chunk_keys import ChunkKey
from kvtier.connectors.tiers.manager import Location, TierManager
from kvtier.transfer.pool_owner import PoolOwner


@dataclass
class StoredPrefix:
    """What a restore would find (:meth:`KVTransfer.stored_prefix`). Hand it to
    :meth:`KVTransfer.load` right after, and the restore reads what it saw without asking
    every tier (a Redis round trip among them) where each chunk lies a second time."""

    cached: int
    """Leading tokens still cached in the pool."""
    chunks: list[tuple[int, str]]
    """The stored chunks after them, in order: new tokens each brings, fastest tier."""
    prefix: list[int] = field(default_factory=list, repr=False)
    keys: list[ChunkKey] = field(default_factory=list, repr=False)
    loc: Location | None = field(default=None, repr=False)


ChunkKeys = Callable[[Sequence[int], "str | None"], list[ChunkKey]]
"""The chunk keys of a token prefix, in a namespace (a tenant's) or in none."""

@dataclass
class Reading:
    """A restore's plan: the whole-block ``prefix`` it may bring back, the tokens of it
    still ``cached`` in the pool, the stored ``chunks`` to read and ``where`` they lie."""

    prefix: list[int]
    cached: int
    chunks: list[ChunkKey]
    where: Location


class RestorePlanner:
    """Plans restores of ``runner``'s pool from ``manager``'s tiers; ``keys`` makes a
    prefix's chunk keys as the save side stores them."""

    def __init__(self, runner: PoolOwner, manager: TierManager, keys: ChunkKeys) -> None:
        self.runner = runner
        self.manager = manager
        self._keys = keys

    def restorable(
        self, token_ids: Sequence[int], stored_tokens: int | None, namespace: str | None = None
    ) -> Reading:
        """The whole-block prefix a restore may bring back, the tokens of it still cached
        in the pool, and its chunk keys (where they lie: not looked up yet)."""
        pool = self.runner.pool
        limit = len(token_ids) if stored_tokens is None else min(stored_tokens, len(token_ids))
        limit -= limit % pool.block_size
        prefix = list(token_ids[:limit])
        cached = len(pool.manager.match_prefix(prefix, self.runner.fingerprint)) * pool.block_size
        return Reading(prefix, cached, self._keys(prefix, namespace), Location(0))

    def stored_prefix(
        self, token_ids: Sequence[int], stored_tokens: int | None = None,
        namespace: str | None = None,
    ) -> StoredPrefix:
        """What a restore of ``token_ids[:stored_tokens]`` would find: the tokens still
        cached in the pool, and the stored chunks after them (new tokens each brings, name
        of the fastest tier holding it), in order, up to the first gap. ``namespace``: the
        tenant whose chunks are looked for (None: the engine's own)."""
        r = self.restorable(token_ids, stored_tokens, namespace)
        prefix, cached, keys = r.prefix, r.cached, r.chunks
        found = StoredPrefix(cached, [], prefix, keys)
        first = next((i for i, k in enumerate(keys) if k.end > cached), len(keys))
        if first == len(keys):
            return found
        found.loc = loc = self.manager.lookup([k.key for k in keys])
        end = cached
        for i in range(first, loc.length):
            if keys[i].start > end:
                break
            found.chunks.append((keys[i].end - end, self.manager.tiers[loc.tiers[i]].name))
            end = keys[i].end
        return found

    def seen(self, found: StoredPrefix, stored_tokens: int | None) -> Reading | None:
        """``found`` cut to ``stored_tokens`` when the cut falls on a chunk boundary it
        knows; else None (look again)."""
        if found.loc is None:
            return None
        limit = len(found.prefix) if stored_tokens is None else min(stored_tokens, len(found.prefix))
        keys = [k for k in found.keys if k.end <= limit]
        if limit != (keys[-1].end if keys else 0):
            return None
        n = min(found.loc.length, len(keys))
        return Reading(found.prefix[:limit], min(found.cached, limit), keys,
                       Location(n, found.loc.tiers[:n]))

    def keys_below_fastest(self, token_ids: Sequence[int], namespace: str | None = None
                           ) -> list[str]:
        """Keys of the stored prefix of ``token_ids`` that only slower tiers hold."""
        keys = [k.key for k in self._keys(list(token_ids), namespace)]
        loc = self.manager.lookup(keys)
        return [keys[i] for i in range(loc.length) if loc.tiers[i] > 0]

    # ------------------------------------------------------------------------- load
    def usable_chunks(
        self,
        token_ids: Sequence[int],
        stored_tokens: int | None,
        found: StoredPrefix | None,
        namespace: str | None = None,
    ) -> Reading:
        """The prefix a restore may bring back, the tokens of it still cached in the pool,
        and the stored chunks from the first one past the cached blocks on, with the tiers
        they lie in (none, ``Location(0)``, when the chunk right after the cached blocks is
        not stored). ``found`` saves asking the tiers again (see :meth:`Restorer.load`)."""
        seen = self.seen(found, stored_tokens) if found is not None else None
        r = seen or self.restorable(token_ids, stored_tokens, namespace)
        keys, cached = r.chunks, r.cached
        nothing = Reading(r.prefix, cached, [], Location(0))
        if not any(k.end > cached for k in keys):
            return nothing
        loc = r.where if seen is not None else self.manager.lookup([k.key for k in keys])
        first = next((i for i, k in enumerate(keys) if k.end > cached), len(keys))
        usable = keys[first : loc.length]
        if not usable or usable[0].start > cached:
            return nothing  # the next chunk is not stored anywhere
        return Reading(r.prefix, cached, usable,
                       Location(len(usable), loc.tiers[first : loc.length]))
