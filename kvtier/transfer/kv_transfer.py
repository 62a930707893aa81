"""Moving a token prefix's KV between the paged pool and the lower tiers.

``save`` gathers the pool blocks that hold a prefix (all layers, one kernel launch per
chunk) into chunk blobs and puts them through the :class:`TierManager`; ``load`` reads the
stored chunks back, verified, scatters them into fresh pool blocks and publishes them in the
prefix cache, so the next request over that prefix finds them as ordinary prefix hits and
computes only the rest. ``evict`` drops a prefix's unreferenced blocks from the pool (the
offload's second half: only once its chunks are safely stored).

This module holds :class:`KVTransfer` with its save and evict side; the restore side
(``load``, ``stored_prefix``, the loader thread) is a :class:`~kvtier.transfer.restore.Restorer`
it owns.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace

import torch

from kvtier.chunk_format import chunk_layout, namespaced_key
from kvtier.chunk_keys import ChunkKey, chunk_keys
from kvtier.connectors.tiers.base import ChunkWrite
from kvtier.connectors.tiers.manager import TierManager
from kvtier.errors import InvalidArgumentError
from kvtier.hashing import chain_hashes
from kvtier.policies.eviction import ChunkInfo
from kvtier.transfer.block_path import BlockSpan, gather
from kvtier.transfer.chunk_sources import ChunkSource, copied_from, gathered_from
from kvtier.transfer.pool_owner import PoolOwner
from kvtier.transfer.restore import LoadReport, Restorer
from kvtier.transfer.restore_plan import StoredPrefix
from kvtier.transfer.staged_puts import StagedPuts


@dataclass
class SaveReport:
    tokens: int
    """Leading tokens whose KV is now stored in some tier."""
    keys: list[str] = field(default_factory=list)
    stored: int = 0
    already: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    bytes: int = 0


@dataclass
class Snapshot:
    """Host copies of the chunks of a prefix that are not stored yet."""

    keys: list[ChunkKey]
    already: int = 0
    """Leading chunks already stored in some tier."""
    end: int = 0
    """Tokens covered by the stored chunks plus the copied ones (contiguous)."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Each chunk's KV, a view of its staging buffer at the payload's place in the chunk."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    """Each chunk's staging buffer (from the manager's pool), given back by ``store``."""
    nbytes: int = 0
    ready: torch.cuda.Event | None = None


class KVTransfer:
    def __init__(
        self,
        runner: PoolOwner,
        manager: TierManager,
        chunk_tokens: int = 256,
        stream: bool | None = False,
    ):
        bs = runner.pool.block_size
        if chunk_tokens < bs or chunk_tokens % bs:
            raise InvalidArgumentError(
                f"chunk_tokens ({chunk_tokens}) must be a positive multiple of the pool's "
                f"block_size ({bs})"
            )
        self.runner = runner
        self.manager = manager
        self.chunk_tokens = chunk_tokens
        self._stream: torch.cuda.Stream | None = None
        self._staged = StagedPuts(manager, runner.fingerprint)
        self.restorer = Restorer(runner, manager, self._keys, stream)

    # ----------------------------------------------------------------- restore
    def load(self, token_ids: Sequence[int], stored_tokens: int | None = None,
             stream: bool | None = None, found: StoredPrefix | None = None,
             namespace: str | None = None) -> LoadReport:
        """See :meth:`Restorer.load`."""
        return self.restorer.load(token_ids, stored_tokens, stream, found, namespace)

    def stored_prefix(self, token_ids: Sequence[int], stored_tokens: int | None = None,
                      namespace: str | None = None) -> StoredPrefix:
        """See :meth:`RestorePlanner.stored_prefix`."""
        return self.restorer.plan.stored_prefix(token_ids, stored_tokens, namespace)

    def keys_below_fastest(self, token_ids: Sequence[int], namespace: str | None = None
                           ) -> list[str]:
        """See :meth:`RestorePlanner.keys_below_fastest`."""
        return self.restorer.plan.keys_below_fastest(token_ids, namespace)

    @property
    def lost_restores(self) -> int:
        return self.restorer.lost_restores

    @property
    def _pool(self):
        return self.runner.pool

    def _keys(self, token_ids: Sequence[int], namespace: str | None = None) -> list[ChunkKey]:
        """The chunk keys of ``token_ids``, as the tiers store them: in ``namespace`` (a
        tenant's; chunks written under such a key name it in their header) or in none."""
        keys = chunk_keys(token_ids, self.chunk_tokens, self.runner.fingerprint)
        if namespace is None:
            return keys
        return [replace(k, key=namespaced_key(namespace, k.key)) for k in keys]

    def _pool_blocks(self, token_ids: Sequence[int]) -> list[int | None]:
        """The pool block holding each full block of ``token_ids`` (None where not cached).

        Each block is looked up by its own chained hash, not only along the matched prefix:
        when another session's offload dropped a shared system prompt from the pool, this
        session's later blocks are still found (and the prompt's chunks are in the tiers)."""
        bs = self._pool.block_size
        hashes = chain_hashes(token_ids, bs, self.runner.fingerprint)
        lookup = self._pool.block_pool.lookup
        return [lookup(h) for h in hashes]

    def storable_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens up to the last full block of ``token_ids`` whose KV is in the pool now."""
        blocks = self._pool_blocks(token_ids)
        present = [i for i, b in enumerate(blocks) if b is not None]
        return (present[-1] + 1) * self._pool.block_size if present else 0

    # -------------------------------------------------------------------- save
    def _plan(
        self, token_ids: Sequence[int], raise_to: int | None = None, namespace: str | None = None
    ) -> tuple[Snapshot, list[tuple[ChunkKey, list[int]]]]:
        """The chunks of ``token_ids`` to store (not stored yet, wholly in the pool), with
        their pool blocks, and a snapshot that records what is stored already. With
        ``raise_to`` (a tier index), chunks that only slower tiers hold are stored again,
        into that tier, when the pool still has them: a session leaving the pool goes
        where the policy picked for it, though an older copy lies deeper."""
        bs = self._pool.block_size
        blocks = self._pool_blocks(token_ids)
        n = self.storable_tokens(token_ids)
        snap = Snapshot(keys=self._keys(list(token_ids[:n]), namespace))
        todo: list[tuple[ChunkKey, list[int]]] = []
        if not snap.keys:
            return snap, todo
        have = self.manager.lookup([k.key for k in snap.keys])
        for i, ck in enumerate(snap.keys):
            ids = blocks[ck.start // bs : ck.end // bs]
            if i < have.length:
                deeper = raise_to is not None and have.tiers[i] > raise_to
                if deeper and all(b is not None for b in ids):
                    todo.append((ck, ids))  # type: ignore[arg-type]
                elif not todo:
                    snap.already += 1  # a leading chunk stored already: not written again
                snap.end = ck.end
                continue
            if any(b is None for b in ids):
                break  # a hole: neither stored nor in the pool
            todo.append((ck, ids))  # type: ignore[arg-type]
            snap.end = ck.end
        snap.nbytes = sum(ck.num_tokens for ck, _ in todo) * self._pool.storage.bytes_per_token
        return snap, todo

    def snapshot(
        self,
        token_ids: Sequence[int],
        reserve: Callable[[int], None] | None = None,
        raise_to: int | str | None = None,
        namespace: str | None = None,
    ) -> Snapshot:
        """Copy the KV of every chunk not stored yet out of the pool (engine thread);
        ``raise_to``: also of those only tiers slower than it hold (see :meth:`_plan`).

        The copy is what makes storing asynchronous safe: once taken, the pool's blocks may
        be reused. ``reserve(nbytes)`` is called before any copy is made (the transfer
        engine's cap on bytes in flight). On CUDA the gather runs on a side stream into
        pinned host memory and ``ready`` is its completion event."""
        snap, todo = self._plan(token_ids, self._tier_index(raise_to), namespace)
        if not todo:
            return snap
        if reserve is not None:
            reserve(snap.nbytes)
        kv = self._pool.storage.kv
        for ck, _ in todo:  # reused buffers (pinned with CUDA), laid out as the chunk
            shape = (kv.shape[0], 2, ck.num_tokens, kv.shape[4], kv.shape[5])
            offset, total = chunk_layout(ck.key, self.runner.fingerprint, kv.dtype, shape)
            buf = snap.buffers[ck.key] = self.manager.staging.acquire(total)
            snap.tensors[ck.key] = buf[offset:total].view(kv.dtype).view(shape)
        spans, tokens = [BlockSpan.of(ids) for _, ids in todo], [ck.num_tokens for ck, _ in todo]
        if kv.is_cuda:  # queued on the side stream; ``ready`` says when it is done
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(kv.device))
            with torch.cuda.stream(stream):
                gathered = gather(self.restorer.cache, spans, tokens, hashed=False)
                for i, (ck, _) in enumerate(todo):
                    gathered.into(i, snap.tensors[ck.key])
                snap.ready = torch.cuda.Event()
                snap.ready.record(stream)
        else:
            gathered = gather(self.restorer.cache, spans, tokens, hashed=False)
            for i, (ck, _) in enumerate(todo):
                gathered.into(i, snap.tensors[ck.key])
        return snap

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self._pool.storage.kv.device)
        return self._stream

    def store(self, snap: Snapshot, tier: int | str = 0, owner: Hashable | None = None) -> SaveReport:
        """Encode a snapshot's chunks and put them in ``tier`` (any thread); ``owner`` (a
        session id) lets the tiers' eviction policy treat them as that session's chain."""
        try:
            if snap.ready is not None:
                snap.ready.synchronize()
            sources = {key: copied_from(t) for key, t in snap.tensors.items()}
            return self._write(snap, sources, tier, owner)
        finally:
            self.release(snap)

    def release(self, snap: Snapshot) -> None:
        """Give a snapshot's buffers back (``store`` does; call it for one never stored)."""
        buffers, snap.buffers = snap.buffers, {}
        snap.tensors = {}
        for buf in buffers.values():
            self.manager.staging.release(buf)

    def _tier_index(self, tier: int | str | None) -> int | None:
        return self.manager.tier_index(tier) if isinstance(tier, str) else tier

    def save(
        self, token_ids: Sequence[int], tier: int | str = 0, owner: Hashable | None = None,
        raise_copies: bool = False, namespace: str | None = None,
    ) -> SaveReport:
        """Store the KV of ``token_ids`` up to its last block held in the pool (whole
        blocks; the last chunk is a tail keyed by its length), now, gathering each chunk
        from the pool straight to where it is stored (a CPU arena slot, or a staging
        buffer a lower tier writes from): one copy, checksummed while in cache. Chunks
        already in a tier are not written again (``raise_copies``: unless only slower tiers
        than ``tier`` hold them); a chunk that is neither stored nor fully in the pool ends
        the stored prefix."""
        snap, todo = self._plan(token_ids, self._tier_index(tier) if raise_copies else None,
                                namespace)
        kv = self._pool.storage.kv
        gathered = gather(self.restorer.cache, [BlockSpan.of(ids) for _, ids in todo],
                          [ck.num_tokens for ck, _ in todo])
        sources = {ck.key: gathered_from(gathered, i, (kv.shape[0], 2, ck.num_tokens, kv.shape[4],
                                                      kv.shape[5]), kv.dtype)
                   for i, (ck, _) in enumerate(todo)}
        return self._write(snap, sources, tier, owner)

    def _write(
        self, snap: Snapshot, sources: dict[str, ChunkSource],
        tier: int | str, owner: Hashable | None,
    ) -> SaveReport:
        report = SaveReport(tokens=0, keys=[k.key for k in snap.keys], already=snap.already)
        if owner is not None and snap.already:  # a shared prefix, not written again
            self.manager.share([k.key for k in snap.keys[: snap.already]], owner)
        index = {ck.key: i for i, ck in enumerate(snap.keys)}
        pending = self._store_in_place(sources, tier, owner, index, report)
        if pending:
            staged = self._staged.put(
                pending, tier, lambda key, n: ChunkInfo(n, session=owner, index=index[key]),
                snap.buffers)
            report.stored += staged.stored
            report.bytes += staged.bytes
            report.failed.update(staged.failed)
        # The stored prefix ends at the first chunk no tier took.
        for ck in snap.keys:
            if ck.key in report.failed or ck.end > snap.end:
                break
            report.tokens = ck.end
        return report

    def _store_in_place(
        self,
        sources: dict[str, ChunkSource],
        tier: int | str,
        owner: Hashable | None,
        index: dict[str, int],
        report: SaveReport,
    ) -> dict[str, ChunkSource]:
        """Write the chunks straight into the target tier's memory where it lends it
        (the CPU arena: one copy into a slot, header and checksums written in place; the
        tier fills two at a time), and on down the stack where it is full; returns the
        chunks left for staging buffers (every chunk, for a tier that lends no memory)."""
        fp = self.runner.fingerprint
        target = self._tier_index(tier)
        assert target is not None
        if not sources or not self.manager.lends_memory(target):
            return dict(sources)  # every chunk goes through staging
        writes: list[ChunkWrite] = []
        for key, source in sources.items():
            total = source.nbytes(key, fp)
            writes.append(ChunkWrite(
                key, total, fill=lambda slot, key=key, source=source: source.encode(key, fp, slot),
                info=ChunkInfo(total, session=owner, index=index[key])))
        res = self.manager.store(writes, target)
        for write in writes:
            if write.key in res.failed:
                report.failed[write.key] = res.failed[write.key]
            else:
                report.stored += 1
                report.bytes += write.nbytes
        return {}

    def close(self) -> None:
        """Wait for restores and puts in flight and stop their threads."""
        self.restorer.close()
        self._staged.close()

    # ------------------------------------------------------------------- evict
    def pool_blocks(self, token_ids: Sequence[int]) -> set[int]:
        """Pool blocks currently holding any full block of ``token_ids``."""
        return {b for b in self._pool_blocks(token_ids) if b is not None}

    def evict(self, token_ids: Sequence[int], keep: set[int] | frozenset[int] = frozenset()) -> int:
        """Drop the blocks of ``token_ids`` from the pool's cache where no sequence uses them
        and they are not in ``keep`` (blocks other resident sessions share: a chunk is
        coarser than a block, so a shared block may not be in any stored chunk of theirs);
        returns how many were freed."""
        bp = self._pool.block_pool
        freed = 0
        for b in self._pool_blocks(token_ids):
            if b is not None and b not in keep and bp.ref_count(b) == 0:
                bp.uncache_block(b)
                freed += 1
        return freed
