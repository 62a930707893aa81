"""The tier stack: one view over the lower tiers (fastest first: CPU arena, NVMe, Redis).

Longest-prefix lookup across all of them, stores with write-through or write-back,
promotion of chunks read from a slow tier into the fastest one, and demotion cascading down
when a tier evicts. Every chunk lent out is checked once (:class:`LentChunk`: format, key,
model fingerprint here, checksums by its reader); a bad one is dropped from the tier it
came from and is a miss, never returned. Errors of a tier (Redis down, disk full) are
counted and turn into misses or failed stores: the caller recomputes, it never crashes.
Tenants' quotas are bookkeeping of their own (:mod:`.quotas`), asked before each write.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvtier.chunk_format import chunk_view
from kvtier.connectors.tiers.base import Blob, ChunkWrite, PutResult, Tier, blob_writes, known_info
from kvtier.connectors.tiers.chunk_workers import map_restore
from kvtier.connectors.tiers.codec_writes import EncodedChunk, encode_writes
from kvtier.connectors.tiers.host_buffers import StagingPool
from kvtier.connectors.tiers.lent_chunk import LentChunk, ReadingBuffer
from kvtier.connectors.tiers.quotas import TenantQuotas
from kvtier.errors import (
    ChunkError,
    ChunkMismatchError,
    DescriptorsExhaustedError,
    InvalidArgumentError,
)
from kvtier.kv_codecs import Codec
from kvtier.policies.eviction import ChunkInfo

log = logging.getLogger(__name__)

WritePolicy = Literal["write_through", "write_back"]


@dataclass
class Location:
    """Where each of the leading ``length`` keys of a lookup lies (tier index per key)."""

    length: int
    tiers: list[int] = field(default_factory=list)

    @classmethod
    def all_in(cls, tier: int, n: int) -> Location:
        """``n`` keys, each to be read from ``tier`` (a miss there is a miss)."""
        return cls(n, [tier] * n)


@dataclass
class PutReport:
    """What a store did in every tier it touched; ``failed`` are keys no tier stored."""

    per_tier: dict[str, PutResult] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass
class ManagerStats:
    lookups: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=dict)
    misses: int = 0
    promotions: int = 0
    demotions: int = 0
    demotion_failures: int = 0
    demotions_skipped: int = 0
    """Evicted chunks the demotion policy dropped (not worth keeping in a lower tier)."""
    rejected: dict[str, int] = field(default_factory=dict)
    """Chunks refused on read, by reason (corrupt, mismatch)."""
    codec_chunks_stored: dict[str, int] = field(default_factory=dict)
    """Chunks a compressing tier stored, by codec (each encoded on its way in)."""
    codec_bytes_stored: dict[str, int] = field(default_factory=dict)
    """Their stored bytes, by codec."""
    codec_kv_bytes_stored: dict[str, int] = field(default_factory=dict)
    """The KV bytes they hold, by codec (over ``codec_bytes_stored``: the ratio)."""
    codec_reads: dict[str, int] = field(default_factory=dict)
    """Lossy chunks lent to readers, by codec."""
    quota_evicted_bytes: dict[tuple[str, str], int] = field(default_factory=dict)
    """(tenant, tier) -> bytes a tenant's quota made that tier evict (pushed down)."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    """Guards the counters the stack's threads bump (readers, writers, demotions)."""

    def count_encoded(self, encoded: Mapping[str, EncodedChunk], stored: Iterable[str]) -> None:
        """The chunks of ``stored`` a compressing tier encoded on their way in."""
        with self.lock:
            for key in stored:
                e = encoded.get(key)
                if e is not None:
                    for counts, n in ((self.codec_chunks_stored, 1),
                                      (self.codec_bytes_stored, e.stored_bytes),
                                      (self.codec_kv_bytes_stored, e.kv_bytes)):
                        counts[e.codec] = counts.get(e.codec, 0) + n

    def count_read(self, codec: str) -> None:
        """A chunk of ``codec`` lent to a reader (lossy ones are counted)."""
        if codec != "none":
            with self.lock:
                self.codec_reads[codec] = self.codec_reads.get(codec, 0) + 1


def _readable(tiers: Sequence[Tier], take: Collection[str]) -> list[bool]:
    """Per tier, whether a reader taking the codecs ``take`` looks there: a tier that
    encodes every chunk it holds by a codec the reader refuses holds nothing it takes, so a
    lookup does not count its chunks (a lossless tier may still hold a lossy chunk promoted
    into it as it was: the lease refuses that one)."""
    return [t.codec is Codec.NONE or t.codec.value in take for t in tiers]


@dataclass
class _Rejected:
    tier: Tier
    key: str
    error: ChunkError


class TierManager:
    def __init__(
        self,
        tiers: Sequence[Tier],
        write_policy: WritePolicy = "write_back",
        promote_on_hit: bool = True,
        fingerprint: bytes | None = None,
        staging: StagingPool | None = None,
    ):
        if not tiers:
            raise InvalidArgumentError("a TierManager needs at least one tier")
        if write_policy not in ("write_through", "write_back"):
            raise InvalidArgumentError(
                f"write_policy must be write_through or write_back, got {write_policy!r}"
            )
        self.tiers = list(tiers)
        self.write_policy = write_policy
        self.promote_on_hit = promote_on_hit
        self.fingerprint = fingerprint
        self.stats = ManagerStats()
        self.staging = StagingPool() if staging is None else staging
        """Reused host buffers chunks are encoded into for a tier that lends no memory."""
        self.demotion: Callable[[int, int], int | None] | None = None
        """Where a chunk that tier ``i`` evicts goes, given (i, its bytes): a lower tier's
        index or None to drop it; unset: always the next tier. The engine sets its live
        policy's :meth:`~kvtier.policies.live.LivePolicy.demotion_target`, which the
        policy simulator's cascade asks too."""
        self.accept_codecs: frozenset[str] | None = None
        """The codecs of the chunks this stack's readers take (a chunk of another is a
        mismatch: a miss, left in its tier); None: lossless and each tier's own codec
        (``tiers.<tier>_codec``), so a reader that configured no lossy tier only ever
        gets exact KV, even from tiers it shares with writers that compress."""
        self.tenant_quotas = TenantQuotas()
        self.tenant_quotas.evicted_bytes = self.stats.quota_evicted_bytes
        for i, tier in enumerate(self.tiers[:-1]):
            tier.add_eviction_listener(self._demoter(i))

    @property
    def quotas(self) -> dict[str, dict[str, int]]:
        """tenant -> tier name -> bytes its namespace may hold there (see :mod:`.quotas`)."""
        return self.tenant_quotas.limits

    @quotas.setter
    def quotas(self, limits: dict[str, dict[str, int]]) -> None:
        self.tenant_quotas.limits = limits

    @property
    def codecs(self) -> frozenset[str]:
        """What :attr:`accept_codecs` resolves to."""
        if self.accept_codecs is not None:
            return self.accept_codecs
        return frozenset({Codec.NONE.value, *(t.codec.value for t in self.tiers)})

    def tier_index(self, name: str) -> int:
        for i, t in enumerate(self.tiers):
            if t.name == name:
                return i
        raise InvalidArgumentError(
            f"unknown tier {name!r}; configured tiers: {', '.join(t.name for t in self.tiers)}"
        )

    # ------------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[str], codecs: Collection[str] | None = None) -> Location:
        """The longest prefix of ``keys`` stored anywhere, and which tier holds each key
        (the fastest one that has it). One ``contains_prefix`` round trip per tier per run
        of consecutive keys in the same tier. ``codecs``: what the reader takes (None:
        :attr:`codecs`); a tier of another codec is not looked in."""
        self.stats.lookups += 1
        readable = _readable(self.tiers, self.codecs if codecs is None else codecs)
        loc = Location(0)
        pos = 0
        while pos < len(keys):
            best, best_n = -1, 0
            for i, tier in enumerate(self.tiers):
                if not readable[i]:
                    continue
                try:
                    n = tier.contains_prefix(keys[pos:])
                except Exception as exc:  # noqa: BLE001 - a failing tier is a miss
                    tier.stats.count_error(type(exc).__name__)
                    n = 0
                if n > 0:
                    best, best_n = i, n
                    break  # the fastest tier holding keys[pos] serves this run
            if best < 0:
                break
            loc.tiers.extend([best] * best_n)
            pos += best_n
        loc.length = pos
        return loc

    def present(self, keys: Sequence[str], codecs: Collection[str] | None = None) -> list[bool]:
        """Whether each of ``keys`` is stored in some tier (not only as a prefix)."""
        return [t is not None for t in self.locate(keys, codecs)]

    def locate(self, keys: Sequence[str], codecs: Collection[str] | None = None
               ) -> list[int | None]:
        """The fastest tier holding each key (prefix or not), else None: one ``contains_each`` per tier
        (``codecs`` as :meth:`lookup` takes them)."""
        self.stats.lookups += 1
        readable = _readable(self.tiers, self.codecs if codecs is None else codecs)
        found: list[int | None] = [None] * len(keys)
        for i, tier in enumerate(self.tiers):
            if not readable[i]:
                continue
            missing = [j for j, t in enumerate(found) if t is None]
            if not missing:
                break
            try:
                here = tier.contains_each([keys[j] for j in missing])
            except Exception as exc:  # noqa: BLE001 - a failing tier is a miss
                tier.stats.count_error(type(exc).__name__)
                continue
            for j, held in zip(missing, here, strict=True):
                if held:
                    found[j] = i
        return found

    def sizes(self, keys: Sequence[str], tiers: Sequence[int | None]) -> list[int | None]:
        """The bytes a read of each key would lend, from the index of the tier ``tiers``
        names for it (a lookup's or :meth:`locate`'s answer), without reading anything:
        what a reader budgets before it reads. None where that tier knows no size,
        the key is not located, or the tier failed to answer."""
        out: list[int | None] = [None] * len(keys)
        by_tier: dict[int, list[int]] = {}
        for i, ti in enumerate(tiers[: len(keys)]):
            if ti is not None:
                by_tier.setdefault(ti, []).append(i)
        for ti, idxs in by_tier.items():
            tier = self.tiers[ti]
            try:
                found = tier.stored_sizes([keys[i] for i in idxs])
            except Exception as exc:  # noqa: BLE001 - a failing tier knows no sizes
                tier.stats.count_error(type(exc).__name__)
                continue
            for i, n in zip(idxs, found, strict=True):
                out[i] = n
        return out

    # ------------------------------------------------------------------- store
    def store(
        self,
        writes: Sequence[ChunkWrite],
        tier: int | str = 0,
        reraise: tuple[type[BaseException], ...] = (),
    ) -> PutReport:
        """Store chunks in ``tier`` (and, write-through, every tier below it; write-back,
        the lower tiers take what it could not). A key is failed only if no tier took it.
        A tenant's chunks (``tenant.key``) respect its quotas in every tier: past its
        quota it pushes its own coldest chunks down (or out, from the last tier), never
        another tenant's. ``reraise``: errors of a write's fill that are the caller's (a
        chunk that fails its checks), raised as they are; any other error of a tier is a
        failed store there."""
        start = self.tier_index(tier) if isinstance(tier, str) else tier
        report = PutReport()
        pending = list(writes)
        stored_somewhere: set[str] = set()
        reasons: dict[str, list[str]] = {}
        for i, t in enumerate(self.tiers[start:]):
            if self.write_policy == "write_back" and i > 0:
                pending = [w for w in pending if w.key not in stored_somewhere]
                if not pending:
                    break
            res = self._store_in(t, pending, reraise)
            report.per_tier[t.name] = res
            stored_somewhere.update(res.stored)
            stored_somewhere.update(res.present)
            for k, why in res.failed.items():
                reasons.setdefault(k, []).append(f"{t.name}: {why}")
        report.failed = {
            w.key: "; ".join(reasons.get(w.key, ["not stored"]))
            for w in writes
            if w.key not in stored_somewhere
        }
        return report

    def _store_in(
        self, tier: Tier, writes: Sequence[ChunkWrite],
        reraise: tuple[type[BaseException], ...] = (),
    ) -> PutResult:
        encoded = encode_writes(writes, tier.codec, self.staging)
        admitted = self.tenant_quotas.admit(tier, encoded.writes)
        try:
            res = tier.store_in_place(admitted.writes) if admitted.writes else PutResult()
        except reraise:
            raise
        except Exception as exc:  # noqa: BLE001 - reported per key, never raised
            tier.stats.count_error(type(exc).__name__)
            log.warning("storing %d chunks in %s failed: %s", len(admitted.writes), tier.name, exc)
            res = PutResult(failed={w.key: f"error: {exc}" for w in admitted.writes})
        if encoded.encoded:
            self.stats.count_encoded(encoded.encoded, res.stored)
        if encoded.failed:
            res.failed.update(encoded.failed)
            tier.stats.count_error("invalid")
        if admitted.refused:
            res.failed.update(admitted.refused)
            for reason in admitted.refused.values():
                tier.stats.count_error(reason.split(":")[0])
        if res.stored or res.present:
            self.tenant_quotas.trim(tier, res.stored + res.present)
        return res

    def lends_memory(self, tier: int | str = 0) -> bool:
        """Whether ``tier`` stores chunks in its own memory (a write's fill lands where the
        chunk stays: chunks are filled two at a time by the caller, one store each)."""
        return self.tiers[self.tier_index(tier) if isinstance(tier, str) else tier].lends_memory

    def tenant_bytes(self) -> dict[tuple[str, str], int]:
        """(tenant, tier) -> bytes held: counters, never a scan."""
        return self.tenant_quotas.tenant_bytes(self.tiers)

    def count_misses(self, n: int = 1) -> None:
        """Keys a caller looked up (``lookup``) and found in no tier, counted as misses
        the way a lease counts its own."""
        self.stats.misses += n

    def promote(self, chunks: Mapping[str, Blob]) -> None:
        """Copy verified chunks read from a slower tier into the fastest one (when
        ``promote_on_hit``), so the next read of them is a RAM read."""
        if chunks and self.promote_on_hit:  # each copy ranked as its source is
            infos = {k: i for k in chunks if (i := known_info(self.tiers[1:], k)) is not None}
            res = self._store_in(self.tiers[0], blob_writes(chunks, infos))
            self.stats.promotions += len(res.stored)

    def prefetch(self, keys: Sequence[str], codecs: Collection[str] | None = None) -> int:
        """Raise the stored prefix of ``keys`` into the fastest tier (when
        ``promote_on_hit``): each chunk a slower tier holds is leased, verified and
        written into the fastest one from the lent memory (one copy). Returns how many
        chunks were read. ``codecs``: what the reader who will read them takes. A key
        named twice is read once (each read holds a buffer until the promotion is done)."""
        keys = list(dict.fromkeys(keys))
        loc = self.lookup(keys, codecs)
        with self.lease_chunks(keys[: loc.length], loc, codecs) as lent:
            writes: list[ChunkWrite] = []
            for key, ti, chunk in zip(keys, loc.tiers, lent, strict=False):
                if chunk is None or ti == 0:
                    continue
                try:
                    chunk.verify()
                except ChunkError:
                    continue  # dropped from its tier when the lease ends
                info = self.tiers[ti].chunk_info(key)  # the copy ranked as its source is
                writes.append(ChunkWrite.of_blob(key, memoryview(chunk.buf.numpy()), info))
            if writes and self.promote_on_hit:
                self.stats.promotions += len(self._store_in(self.tiers[0], writes).stored)
        return len(writes)

    # ------------------------------------------------------------------- lease
    @contextlib.contextmanager
    def lease(
        self, keys: Sequence[str], layers: tuple[int, int] | None = None,
        location: Location | None = None, codecs: Collection[str] | None = None,
    ) -> Iterator[list[torch.Tensor | None]]:
        """Verified KV of ``keys`` (layers ``layers`` only: only their checksums are read),
        each from the tier holding it, as a view of the memory the tier lends (the CPU
        arena's slot: no copy; a staging buffer a file or a reply was read into), valid
        until the block ends. A chunk that fails its checks is a miss and is dropped from
        its tier. Checked two chunks at a time (the checksum releases the GIL). ``codecs``:
        what the reader takes (None: :attr:`codecs`); a chunk of another is a miss, left
        in its tier."""
        take = self.codecs if codecs is None else codecs
        with self._lent(keys, location or self.lookup(keys, take), layers) as (lent, rejected):
            def check(item: tuple[str, Tier, torch.Tensor | ReadingBuffer | None]
                      ) -> torch.Tensor | None:
                key, tier, view = item
                if view is None:
                    return None
                assert isinstance(view, torch.Tensor)
                try:
                    header, kv = chunk_view(view, key, self.fingerprint, layers, codecs=take)
                    self.stats.count_read(header.codec)
                    return kv
                except ChunkError as exc:
                    rejected.append(_Rejected(tier, key, exc))
                    return None

            out = map_restore(check, lent)
            self._count(lent, out)
            yield out

    @contextlib.contextmanager
    def lease_chunks(
        self, keys: Sequence[str], location: Location | None = None,
        codecs: Collection[str] | None = None, strict: bool = False,
    ) -> Iterator[list[LentChunk | None]]:
        """Whole chunks of ``keys`` as :class:`LentChunk` whose key, model and length are
        checked; their layers' checksums are checked by the reader right before it uses
        them (group by group: the bytes are read from memory once), or all at once with
        :meth:`LentChunk.verify`. A tier that reads in the background lends a chunk once
        its first layers are read. One that fails a check is dropped from its tier after
        the block, as one that fails here is. ``codecs`` as :meth:`lease` takes them.
        ``strict``: a tier that cannot tell whether it holds a key for want of file
        descriptors raises :class:`DescriptorsExhaustedError` (a service answers "retry",
        not "not found"); otherwise that is a miss, as any failing tier's is (a reader that
        can recompute)."""
        take = self.codecs if codecs is None else codecs
        with self._lent(keys, location or self.lookup(keys, take), None,
                        background=True, strict=strict) as (lent, rejected):
            out: list[LentChunk | None] = []
            for key, tier, view in lent:
                out.append(None if view is None
                           else self._lent_chunk(key, tier, view, rejected, take))
            self._count(lent, out)
            try:
                yield out
            finally:
                for (key, tier, _), chunk in zip(lent, out, strict=True):
                    if chunk is not None and chunk.error is not None:
                        rejected.append(_Rejected(tier, key, chunk.error))

    def _lent_chunk(self, key: str, tier: Tier, view: torch.Tensor | ReadingBuffer,
                    rejected: list[_Rejected], codecs: Collection[str]) -> LentChunk | None:
        reading = view if isinstance(view, ReadingBuffer) else None
        buf = reading.buf if reading is not None else view
        assert isinstance(buf, torch.Tensor)
        try:  # header, key, model and length (the header and first layers have landed)
            header, _ = chunk_view(buf, key, self.fingerprint, verify=False, as_kv=False,
                                   codecs=codecs)
        except ChunkError as exc:
            rejected.append(_Rejected(tier, key, exc))
            return None
        self.stats.count_read(header.codec)
        return LentChunk(buf, header, reading=reading)

    @contextlib.contextmanager
    def _lent(
        self, keys: Sequence[str], location: Location, layers: tuple[int, int] | None,
        background: bool = False, strict: bool = False,
    ) -> Iterator[tuple[list[tuple[str, Tier, torch.Tensor | ReadingBuffer | None]],
                        list[_Rejected]]]:
        """What each tier lends of ``keys`` (key, tier, unverified bytes or None), one
        lease per tier; then the chunks the block rejected are dropped (after the leases
        end: a leased slot is freed on release)."""
        loc = location
        lent: list[tuple[str, Tier, torch.Tensor | ReadingBuffer | None]] = [
            (k, self.tiers[0], None) for k in keys]
        rejected: list[_Rejected] = []
        by_tier: dict[int, list[int]] = {}
        for idx in range(loc.length):
            by_tier.setdefault(loc.tiers[idx], []).append(idx)
        with contextlib.ExitStack() as stack:
            for ti, idxs in by_tier.items():
                tier = self.tiers[ti]
                try:
                    views = stack.enter_context(tier.lease(
                        [keys[i] for i in idxs], layers,
                        background=background and tier.reads_in_background))
                except DescriptorsExhaustedError as exc:
                    tier.stats.count_error(type(exc).__name__)
                    if strict:
                        raise
                    views = [None] * len(idxs)
                except Exception as exc:  # noqa: BLE001 - a failing tier is a miss
                    tier.stats.count_error(type(exc).__name__)
                    views = [None] * len(idxs)
                for i, view in zip(idxs, views, strict=True):
                    lent[i] = (keys[i], tier, view)
            try:
                yield lent, rejected
            finally:
                stack.close()
                for r in rejected:
                    if not isinstance(r.error, ChunkMismatchError):
                        with r.tier.stats.lock:  # the tier lent it unverified
                            r.tier.stats.corrupt += 1
                    self._reject(r.tier, r.key, r.error)

    def _count(self, lent: Sequence[tuple[str, Tier, object]], out: Sequence[object]) -> None:
        """Hits by tier and misses of a lease (a rejected chunk is a miss)."""
        for (_, tier, _), got in zip(lent, out, strict=True):
            if got is None:
                self.stats.misses += 1
            else:
                self.stats.hits_by_tier[tier.name] = self.stats.hits_by_tier.get(tier.name, 0) + 1

    def _reject(self, tier: Tier, key: str, exc: ChunkError) -> None:
        """A chunk failed its checks: counted, logged and, if corrupt, dropped from its tier
        (a miss, then a recompute; never wrong KV). A whole chunk of another model (or filed
        under another key) is a miss too, but it stays: it may be another engine's, sharing
        the directory or the Redis, and is not this reader's to delete."""
        foreign = isinstance(exc, ChunkMismatchError)
        reason = "mismatch" if foreign else "corrupt"
        self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1
        if foreign:
            log.info("chunk %s in %s is not this model's: %s", key, tier.name, exc)
            return
        log.warning("dropping chunk %s from %s: %s", key, tier.name, exc)
        try:
            tier.delete([key])
        except Exception as del_exc:  # noqa: BLE001
            tier.stats.count_error(type(del_exc).__name__)

    # ----------------------------------------------------------------- evictions
    def _demoter(self, index: int):
        def on_evict(key: str, blob: bytes | None, info: ChunkInfo | None) -> None:
            if blob is None:
                return  # nothing to move (the tier could not hand the bytes over cheaply)
            target = index + 1 if self.demotion is None else self.demotion(index, len(blob))
            if target is None:
                with self.stats.lock:
                    self.stats.demotions_skipped += 1
                return
            lower = self.tiers[target]
            res = self._store_in(lower, [ChunkWrite.of_blob(key, blob, info)])  # ranked as above
            with self.stats.lock:
                if res.stored or res.present:
                    self.stats.demotions += 1
                else:
                    self.stats.demotion_failures += 1

        return on_evict

    def share(self, keys: Sequence[str], session: Hashable) -> None:
        """``session``'s chain uses these stored chunks too: every tier holding them keeps
        them for both (see :meth:`Tier.share`)."""
        for tier in self.tiers:
            tier.share(keys, session)

    def delete(self, keys: Sequence[str]) -> int:
        n = 0
        for t in self.tiers:
            try:
                n += t.delete(keys)
            except Exception as exc:  # noqa: BLE001
                t.stats.count_error(type(exc).__name__)
        return n

    def close(self) -> None:
        for t in self.tiers:
            t.close()
        self.staging.close()
