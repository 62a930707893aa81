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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from kvtier.chunk_format import chunk_layout, encode_into, namespaced_key
from kvtier.chunk_keys import ChunkKey, chunk_keys
from kvtier.connectors.tiers.base import ChunkWrite
from kvtier.connectors.tiers.chunk_workers import map_store
from kvtier.connectors.tiers.manager import PutReport, TierManager
from kvtier.errors import InvalidArgumentError
from kvtier.gpu_pool.kernels import copy_host, gather_blocks, gather_blocks_host, host_native
from kvtier.gpu_pool.kernels.host_native import gather_blocks_hashed
from kvtier.hashing import chain_hashes
from kvtier.policies.eviction import ChunkInfo
from kvtier.transfer.pool_owner import PoolOwner
from kvtier.transfer.restore import LoadReport, Restorer
from kvtier.transfer.restore_plan import StoredPrefix


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


GROUP_BYTES = 4 << 20
PUT_BATCH_BYTES = 128 << 20
"""Staged chunks are put in batches of about this many bytes, each while the next is being
encoded (a disk write or a Redis send overlaps the gather and checksums of the next)."""
"""Layers are gathered and checksummed this many bytes at a time (see ``encode_into``)."""

Fill = Callable[..., None]
Source = tuple[tuple[int, ...], torch.dtype, Fill]
"""A chunk to write: its shape, dtype and how to fill its payload, a group of layers at a time."""


def _in_place(part: torch.Tensor, a: int, b: int) -> None:
    """The payload already lies where it goes (a snapshot's staging buffer)."""


def _copy_from(t: torch.Tensor) -> Source:
    """A chunk's (shape, dtype, fill) that copies it from a host snapshot."""
    if t.is_cuda:
        return tuple(t.shape), t.dtype, lambda part, a, b: part.copy_(t[a:b])
    return tuple(t.shape), t.dtype, lambda part, a, b: copy_host(part, t[a:b])


class _FusedGather:
    """A fill that gathers a chunk from a host pool and checksums it in one native pass
    (:func:`gather_blocks_hashed`), returning the checksums. It runs over the whole chunk
    in one call: it hashes as it copies, so there is no group to keep in cache."""

    whole = True

    def __init__(self, kv: torch.Tensor, ids: list[int], num_tokens: int) -> None:
        self.kv, self.ids, self.num_tokens = kv, ids, num_tokens

    def __call__(self, part: torch.Tensor, a: int = 0, b: int | None = None) -> tuple[int, ...]:
        return gather_blocks_hashed(self.kv[a:b], self.ids, self.num_tokens, part)


def _gather_from(kv: torch.Tensor, ids: list[int], num_tokens: int
                 ) -> Source:
    """A chunk's (shape, dtype, fill) that gathers its layers straight from the pool's
    blocks (on CUDA: gathered on the device, then one copy per group of layers to the
    host, waited for)."""
    shape = (kv.shape[0], 2, num_tokens, kv.shape[4], kv.shape[5])
    if not kv.is_cuda:  # on the calling thread (chunks are encoded two at a time)
        if host_native.AVAILABLE:  # copied and checksummed in one pass
            return shape, kv.dtype, _FusedGather(kv, ids, num_tokens)
        return shape, kv.dtype, lambda part, a, b: gather_blocks_host(kv[a:b], ids, num_tokens, part)
    dev: list[torch.Tensor] = []

    def fill(part: torch.Tensor, a: int, b: int) -> None:
        if not dev:
            dev.append(gather_blocks(kv, ids, num_tokens=num_tokens))
        part.copy_(dev[0][a:b])

    return shape, kv.dtype, fill


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
        self._putter: ThreadPoolExecutor | None = None
        self.restorer = Restorer(runner, manager, self._keys, self._side_stream, stream)

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
        if kv.is_cuda:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(kv.device))
            with torch.cuda.stream(stream):
                for ck, ids in todo:
                    dev = gather_blocks(kv, ids, num_tokens=ck.num_tokens)
                    snap.tensors[ck.key].copy_(dev, non_blocking=True)
                    dev.record_stream(stream)
                snap.ready = torch.cuda.Event()
                snap.ready.record(stream)
        else:
            for ck, ids in todo:
                gather_blocks(kv, ids, num_tokens=ck.num_tokens, out=snap.tensors[ck.key])
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
            sources = {key: _copy_from(t) for key, t in snap.tensors.items()}
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
        sources = {ck.key: _gather_from(kv, ids, ck.num_tokens) for ck, ids in todo}
        return self._write(snap, sources, tier, owner)

    def _write(
        self, snap: Snapshot, sources: dict[str, Source],
        tier: int | str, owner: Hashable | None,
    ) -> SaveReport:
        report = SaveReport(tokens=0, keys=[k.key for k in snap.keys], already=snap.already)
        if owner is not None and snap.already:  # a shared prefix, not written again
            self.manager.share([k.key for k in snap.keys[: snap.already]], owner)
        index = {ck.key: i for i, ck in enumerate(snap.keys)}
        pending = self._store_in_place(sources, tier, owner, index, report)
        if pending:
            self._put_staged(pending, tier, owner, index, report, snap.buffers)
        # The stored prefix ends at the first chunk no tier took.
        for ck in snap.keys:
            if ck.key in report.failed or ck.end > snap.end:
                break
            report.tokens = ck.end
        return report

    def _encode(self, key: str, source: Source, dest: torch.Tensor) -> int:
        shape, dtype, fill = source
        group = None if getattr(fill, "whole", False) else GROUP_BYTES
        return encode_into(dest, key, self.runner.fingerprint, dtype, shape, fill, group)

    def _store_in_place(
        self,
        sources: dict[str, Source],
        tier: int | str,
        owner: Hashable | None,
        index: dict[str, int],
        report: SaveReport,
    ) -> dict[str, Source]:
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
            shape, dtype, _ = source
            _, total = chunk_layout(key, fp, dtype, shape)
            writes.append(ChunkWrite(
                key, total, fill=lambda slot, key=key, source=source: self._encode(key, source, slot),
                info=ChunkInfo(total, session=owner, index=index[key])))
        res = self.manager.store(writes, target)
        for write in writes:
            if write.key in res.failed:
                report.failed[write.key] = res.failed[write.key]
            else:
                report.stored += 1
                report.bytes += write.nbytes
        return {}

    def _put_staged(
        self,
        pending: dict[str, Source],
        tier: int | str,
        owner: Hashable | None,
        index: dict[str, int],
        report: SaveReport,
        staged: dict[str, torch.Tensor],
    ) -> None:
        """Encode each chunk in place into a reused staging buffer and put the buffers'
        memory in batches (the disk tier writes from it, Redis sends it), each batch on
        the putter thread while the next is encoded: no chunk-sized bytes object is made,
        and at most about two batches of buffers are out at once. A snapshot's chunk already lies in its buffer at its place
        (``staged``): only its checksums and header are written."""
        staging = self.manager.staging
        batches: list[tuple[Future[PutReport], list[torch.Tensor], dict[str, memoryview]]] = []
        held: list[torch.Tensor] = []

        def settle(batch: tuple[Future[PutReport], list[torch.Tensor], dict[str, memoryview]]) -> None:
            fut, bufs, sent = batch
            try:
                res = fut.result()
                report.failed.update(res.failed)
                report.stored += len(sent) - len(res.failed)
                report.bytes += sum(len(b) for k, b in sent.items() if k not in res.failed)
            finally:  # a put finishes before its buffers go back
                for buf in bufs:
                    staging.release(buf)

        def encode(item: tuple[str, Source, torch.Tensor]) -> memoryview:
            key, source, buf = item
            return memoryview(buf[: self._encode(key, source, buf)].numpy())

        try:
            for batch in self._batches(pending):
                todo: list[tuple[str, Source, torch.Tensor]] = []
                for key, source in batch:
                    shape, dtype, _ = source
                    buf = staged.get(key)
                    if buf is not None:
                        source = (shape, dtype, _in_place)
                    else:
                        _, total = chunk_layout(key, self.runner.fingerprint, dtype, shape)
                        buf = staging.acquire(total)
                        held.append(buf)
                    todo.append((key, source, buf))
                blobs = dict(zip([k for k, _, _ in todo], map_store(encode, todo), strict=True))
                batches.append((self._put_later(blobs, tier, owner, index), held, blobs))
                held = []
                while len(batches) > 1:  # one batch being put while the next is encoded
                    settle(batches.pop(0))
        finally:
            for buf in held:  # encoding failed: these were never handed to a put
                staging.release(buf)
            failure: BaseException | None = None
            for batch in batches:  # each one settled, whatever another raised
                try:
                    settle(batch)
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    failure = failure or exc
            if failure is not None:
                raise failure

    def _batches(self, pending: dict[str, Source]) -> list[list[tuple[str, Source]]]:
        """``pending`` in order, cut into batches of about ``PUT_BATCH_BYTES``."""
        fp = self.runner.fingerprint
        out: list[list[tuple[str, Source]]] = [[]]
        size = 0
        for key, source in pending.items():
            if size >= PUT_BATCH_BYTES:
                out.append([])
                size = 0
            out[-1].append((key, source))
            size += chunk_layout(key, fp, source[1], source[0])[1]
        return [b for b in out if b]

    def _put_later(
        self, blobs: dict[str, memoryview], tier: int | str, owner: Hashable | None, index: dict[str, int]
    ) -> Future[PutReport]:
        """Put one batch of encoded chunks on the putter thread (batches in order)."""
        writes = [ChunkWrite.of_blob(key, b, ChunkInfo(len(b), session=owner, index=index[key]))
                  for key, b in blobs.items()]
        if self._putter is None:
            self._putter = ThreadPoolExecutor(1, thread_name_prefix="kvtier-put")
        return self._putter.submit(self.manager.store, writes, tier)

    def close(self) -> None:
        """Wait for restores and puts in flight and stop their threads."""
        self.restorer.close()
        if self._putter is not None:
            self._putter.shutdown(wait=True)
            self._putter = None

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
