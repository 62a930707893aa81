"""One view over the lower tiers (fastest first: CPU arena, NVMe, Redis).

Longest-prefix lookup across all of them, puts with write-through or write-back, promotion
of chunks read from a slow tier into the fastest one, and demotion cascading down when a
tier evicts. Every blob read back is verified (format, checksum, key, model fingerprint);
a bad one is deleted from the tier it came from and reported as a miss, never returned.
Errors of a tier (Redis down, disk full) are counted and turn into misses or failed puts:
the caller recomputes, it never crashes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from kvtier.chunk_format import byte_view, chunk_view, validate_chunk
from kvtier.connectors.tiers.base import Blob, PutResult, Tier
from kvtier.connectors.tiers.chunk_workers import map_restore
from kvtier.connectors.tiers.host_buffers import StagingPool
from kvtier.connectors.tiers.lent_chunk import LentChunk, ReadingBuffer
from kvtier.connectors.tiers.namespace_usage import namespace_of
from kvtier.errors import ChunkError, ChunkFormatError, ChunkMismatchError, InvalidArgumentError
from kvtier.policies.eviction import ChunkInfo

log = logging.getLogger(__name__)

WritePolicy = Literal["write_through", "write_back"]


@dataclass
class Location:
    """Where each of the leading ``length`` keys of a lookup lies (tier index per key)."""

    length: int
    tiers: list[int] = field(default_factory=list)


@dataclass
class PutReport:
    """What a put did in every tier it touched; ``failed`` are keys no tier stored."""

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
    """Blobs refused on read, by reason (corrupt, mismatch)."""
    quota_evicted_bytes: dict[tuple[str, str], int] = field(default_factory=dict)
    """(tenant, tier) -> bytes a tenant's quota made that tier evict (pushed down)."""


def _decoded(blob: Blob, key: str, layers: tuple[int, int] | None) -> torch.Tensor | None:
    """A blob's KV (layers ``layers`` of it), verified by ``get`` already: a view of
    ``blob`` (no copy) where its payload is aligned, as chunks written in place and
    demoted keep it. None if it does not hold the layers asked for."""
    try:
        return chunk_view(byte_view(blob), key, layers=layers, verify=False)[1]
    except ChunkFormatError:
        return None


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
        self.quotas: dict[str, dict[str, int]] = {}
        """tenant -> tier name -> bytes its namespace may hold there (see ``put``)."""
        self._lock = threading.Lock()
        for i, tier in enumerate(self.tiers[:-1]):
            tier.add_eviction_listener(self._demoter(i))

    def tier_index(self, name: str) -> int:
        for i, t in enumerate(self.tiers):
            if t.name == name:
                return i
        raise InvalidArgumentError(
            f"unknown tier {name!r}; configured tiers: {', '.join(t.name for t in self.tiers)}"
        )

    # ------------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[str]) -> Location:
        """The longest prefix of ``keys`` stored anywhere, and which tier holds each key
        (the fastest one that has it). One ``contains_prefix`` round trip per tier per run
        of consecutive keys in the same tier."""
        self.stats.lookups += 1
        loc = Location(0)
        pos = 0
        while pos < len(keys):
            best, best_n = -1, 0
            for i, tier in enumerate(self.tiers):
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

    # --------------------------------------------------------------------- put
    def put(
        self,
        chunks: Mapping[str, Blob],
        tier: int | str = 0,
        info: Mapping[str, ChunkInfo] | None = None,
    ) -> PutReport:
        """Store chunks in ``tier`` (and, write-through, every tier below it). A key is
        failed only if no tier took it. ``info`` goes to the tiers' eviction policies.
        A tenant's chunks (``tenant.key``) respect its ``quotas`` in every tier: past its
        quota it pushes its own coldest chunks down (or out, from the last tier), never
        another tenant's."""
        start = self.tier_index(tier) if isinstance(tier, str) else tier
        targets = self.tiers[start:]
        report = PutReport()
        pending = dict(chunks)
        stored_somewhere: set[str] = set()
        reasons: dict[str, list[str]] = {}
        for i, t in enumerate(targets):
            if self.write_policy == "write_back" and i > 0:
                # Write-back: lower tiers only catch what the target could not take.
                pending = {k: v for k, v in pending.items() if k not in stored_somewhere}
                if not pending:
                    break
            res = self._safe_put(t, pending, info)
            report.per_tier[t.name] = res
            stored_somewhere.update(res.stored)
            stored_somewhere.update(res.present)
            for k, why in res.failed.items():
                reasons.setdefault(k, []).append(f"{t.name}: {why}")
        report.failed = {
            k: "; ".join(reasons.get(k, ["not stored"]))
            for k in chunks
            if k not in stored_somewhere
        }
        return report

    def _safe_put(
        self, tier: Tier, chunks: Mapping[str, Blob], info: Mapping[str, ChunkInfo] | None = None
    ) -> PutResult:
        chunks, refused = self._within_quotas(tier, chunks)
        try:
            res = tier.put(chunks, info) if info else tier.put(chunks)
        except Exception as exc:  # noqa: BLE001 - reported per key, never raised
            tier.stats.count_error(type(exc).__name__)
            res = PutResult(failed={k: f"error: {exc}" for k in chunks})
        if refused:
            res.failed.update(refused)
            for reason in refused.values():
                tier.stats.count_error(reason.split(":")[0])
        if self.quotas and (res.stored or res.present):
            self._trim_to_quotas(tier, res.stored + res.present)
        return res

    # ------------------------------------------------------------------ quotas
    def _quota(self, namespace: str | None, tier: Tier) -> int | None:
        if namespace is None:
            return None
        return self.quotas.get(namespace, {}).get(tier.name)

    def _by_quota(self, tier: Tier, keys: Iterable[str]) -> dict[str, tuple[int, list[str]]]:
        """The keys of each namespace that has a quota in ``tier``: ns -> (quota, keys)."""
        out: dict[str, tuple[int, list[str]]] = {}
        for key in keys:
            ns = namespace_of(key)
            quota = self._quota(ns, tier)
            if quota is not None and ns is not None:
                out.setdefault(ns, (quota, []))[1].append(key)
        return out

    def _within_quotas(
        self, tier: Tier, chunks: Mapping[str, Blob]
    ) -> tuple[Mapping[str, Blob], dict[str, str]]:
        """What of ``chunks`` may go into ``tier`` under the tenants' quotas, after making
        room from each tenant's own coldest chunks there (handed down like any eviction);
        the rest is refused (``quota``: a batch bigger than the whole quota)."""
        if not self.quotas:
            return chunks, {}
        refused: dict[str, str] = {}
        for ns, (quota, keys) in self._by_quota(tier, chunks).items():
            held, present = tier.namespace_held(ns, keys)
            incoming = 0
            for key in keys:
                if key in present:
                    continue
                size = tier.occupancy(len(chunks[key]))  # what it takes there, all told
                if incoming + size > quota:
                    refused[key] = f"quota: tenant {ns} may hold {quota} bytes in {tier.name}"
                else:
                    incoming += size
            if held + incoming > quota:
                self._evict_for_quota(tier, ns, held + incoming - quota, keys)
        if not refused:
            return chunks, {}
        return {k: v for k, v in chunks.items() if k not in refused}, refused

    def _trim_to_quotas(self, tier: Tier, keys: Sequence[str]) -> None:
        """After a put: a tenant over its quota (concurrent puts raced past the check)
        gives up its coldest chunks, never the ones just stored."""
        for ns, (quota, ns_keys) in self._by_quota(tier, keys).items():
            held, _ = tier.namespace_held(ns)
            if held > quota:
                self._evict_for_quota(tier, ns, held - quota, ns_keys)

    def _evict_for_quota(self, tier: Tier, ns: str, need: int, keep: Sequence[str]) -> None:
        try:
            freed = tier.evict_namespace(ns, need, set(keep))
        except Exception as exc:  # noqa: BLE001 - the put goes on; the trim retries next time
            tier.stats.count_error(type(exc).__name__)
            return
        with self._lock:
            key = (ns, tier.name)
            self.stats.quota_evicted_bytes[key] = self.stats.quota_evicted_bytes.get(key, 0) + freed

    def tenant_bytes(self) -> dict[tuple[str, str], int]:
        """(tenant, tier) -> bytes held: counters, never a scan."""
        return {(ns, t.name): n for t in self.tiers for ns, n in t.namespace_bytes().items()}

    # --------------------------------------------------------------------- get
    def get(
        self,
        keys: Sequence[str],
        layers: tuple[int, int] | None = None,
        location: Location | None = None,
    ) -> list[bytes | None]:
        """Verified blobs of ``keys`` (None for a miss or a rejected blob), each read from
        the fastest tier holding it; chunks read from a slower tier are promoted to the
        fastest (whole chunks only)."""
        loc = location or self.lookup(keys)
        out: list[bytes | None] = [None] * len(keys)
        by_tier: dict[int, list[int]] = {}
        for idx in range(loc.length):
            by_tier.setdefault(loc.tiers[idx], []).append(idx)
        promote: dict[str, bytes] = {}
        for ti, idxs in by_tier.items():
            tier = self.tiers[ti]
            try:
                blobs = tier.get([keys[i] for i in idxs], layers)
            except Exception as exc:  # noqa: BLE001 - a failing tier is a miss
                tier.stats.count_error(type(exc).__name__)
                blobs = [None] * len(idxs)
            for i, blob in zip(idxs, blobs, strict=True):
                if blob is None:
                    continue
                if not self._accept(tier, keys[i], blob):
                    continue
                out[i] = bytes(blob)
                self.stats.hits_by_tier[tier.name] = self.stats.hits_by_tier.get(tier.name, 0) + 1
                if ti > 0 and layers is None and self.promote_on_hit:
                    promote[keys[i]] = out[i]
        self.stats.misses += sum(1 for b in out if b is None)
        self.promote(promote)
        return out

    def get_each(
        self, keys: Sequence[str], layers: tuple[int, int] | None = None
    ) -> list[tuple[bytes | None, str | None]]:
        """Each key on its own, not as a prefix: (verified blob, tier name) or (None, None).
        One batch read per tier for the keys the faster tiers missed; hits in a slower tier
        are promoted like :meth:`get`'s."""
        out: list[tuple[bytes | None, str | None]] = [(None, None)] * len(keys)
        todo = list(range(len(keys)))
        promote: dict[str, bytes] = {}
        for ti, tier in enumerate(self.tiers):
            if not todo:
                break
            try:
                blobs = tier.get([keys[i] for i in todo], layers)
            except Exception as exc:  # noqa: BLE001 - a failing tier is a miss
                tier.stats.count_error(type(exc).__name__)
                continue
            missed = []
            for i, blob in zip(todo, blobs, strict=True):
                if blob is None or not self._accept(tier, keys[i], blob):
                    missed.append(i)
                    continue
                out[i] = (bytes(blob), tier.name)
                self.stats.hits_by_tier[tier.name] = self.stats.hits_by_tier.get(tier.name, 0) + 1
                if ti > 0 and layers is None and self.promote_on_hit:
                    promote[keys[i]] = out[i][0]
            todo = missed
        self.stats.misses += len(todo)
        self.promote(promote)
        return out

    def count_misses(self, n: int = 1) -> None:
        """Keys a caller looked up (``lookup``) and found in no tier, counted as misses
        the way ``get`` counts its own."""
        self.stats.misses += n

    def promote(self, chunks: Mapping[str, Blob]) -> None:
        """Copy verified chunks read from a slower tier into the fastest one (when
        ``promote_on_hit``), so the next read of them is a RAM read."""
        if chunks and self.promote_on_hit:
            res = self._safe_put(self.tiers[0], chunks)
            self.stats.promotions += len(res.stored)

    def _accept(self, tier: Tier, key: str, blob: Blob) -> bool:
        try:
            validate_chunk(blob, key, self.fingerprint)
            return True
        except ChunkError as exc:
            self._reject(tier, key, exc)
            return False

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

    # ---------------------------------------------------------------- in place
    def lends_memory(self, tier: int, key: str) -> bool:
        """Whether :meth:`store_in_place` writes ``key`` into ``tier``'s own memory (it
        lends it, the write policy is write-back, and the key's tenant has no quota there:
        a quota is enforced by ``put``)."""
        target = self.tiers[tier]
        return (hasattr(target, "store_in_place") and self.write_policy == "write_back"
                and self._quota(namespace_of(key), target) is None)

    def store_in_place(
        self, tier: int, key: str, nbytes: int, fill: Callable[[torch.Tensor], int],
        info: ChunkInfo | None = None, reraise: tuple[type[BaseException], ...] = (),
    ) -> str | None:
        """Write one chunk straight into ``tier``'s memory when it lends it (the CPU
        arena, see :meth:`CPUTier.store_in_place`) and the write policy is write-back;
        None when it does not (the caller puts a blob). A failing tier answers ``error``;
        ``reraise``: errors of ``fill`` that are the caller's (a chunk that fails its
        checks), raised as they are after the slot is freed."""
        target = self.tiers[tier]
        if not self.lends_memory(tier, key):
            return None
        write = target.store_in_place  # type: ignore[attr-defined]
        try:
            return write(key, nbytes, fill, info)
        except reraise:
            raise
        except Exception as exc:  # noqa: BLE001 - reported, the caller falls back
            target.stats.count_error(type(exc).__name__)
            log.warning("in-place store of %s in %s failed: %s", key, target.name, exc)
            return "error"

    @contextlib.contextmanager
    def lease(
        self,
        keys: Sequence[str],
        layers: tuple[int, int] | None = None,
        location: Location | None = None,
        raw: bool = False,
        deferred: bool = False,
    ) -> Iterator[list]:
        """Verified KV of ``keys`` (layers ``layers`` only), each from the tier holding
        it: a view into the tier's memory where it lends it (the CPU arena: no copy; the
        slot is neither evicted nor reused until the block ends), else decoded from its
        ``get``. A chunk that fails its checks is a miss and is dropped from its tier.
        ``raw``: each whole chunk's verified bytes (uint8) instead of its KV, to send on
        as they are (the sidecar's GET). ``deferred``: whole chunks as
        :class:`~kvtier.connectors.tiers.lent_chunk.LentChunk` whose per-layer checksums
        the reader checks group by group right before copying each (key, model and length
        are checked here; with ``raw`` its ``kv`` is the payload's bytes); one that fails a
        check is dropped from its tier after the block, as one that fails here."""
        if raw and layers is not None:
            raise InvalidArgumentError("a raw lease is of whole chunks (layers must be None)")
        if deferred and layers is not None:
            raise InvalidArgumentError("a deferred lease is of whole chunks")
        loc = location or self.lookup(keys)
        out: list[torch.Tensor | None] = [None] * len(keys)
        by_tier: dict[int, list[int]] = {}
        for idx in range(loc.length):
            by_tier.setdefault(loc.tiers[idx], []).append(idx)
        rejected: list[tuple[Tier, str, ChunkError]] = []
        lent: list[tuple[Tier, str, LentChunk]] = []
        with contextlib.ExitStack() as stack:
            for ti, idxs in by_tier.items():
                tier = self.tiers[ti]
                if hasattr(tier, "lease"):
                    try:
                        sub = [keys[i] for i in idxs]
                        views = stack.enter_context(
                            tier.lease(sub, layers, background=True)
                            if deferred and getattr(tier, "reads_in_background", False)
                            else tier.lease(sub, layers)
                        )
                    except Exception as exc:  # noqa: BLE001 - a failing tier is a miss
                        tier.stats.count_error(type(exc).__name__)
                        self.stats.misses += len(idxs)
                        continue
                    checked = self._check_views(keys, idxs, views, layers, raw, deferred)
                    for i, got in zip(idxs, checked, strict=True):
                        if got is None:
                            self.stats.misses += 1
                            continue
                        if isinstance(got, ChunkError):
                            rejected.append((tier, keys[i], got))
                            self.stats.misses += 1
                            if not isinstance(got, ChunkMismatchError):
                                with tier.stats.lock:  # the tier lent it unverified
                                    tier.stats.corrupt += 1
                            continue
                        out[i] = got
                        if isinstance(got, LentChunk):
                            lent.append((tier, keys[i], got))
                        self.stats.hits_by_tier[tier.name] = self.stats.hits_by_tier.get(tier.name, 0) + 1
                else:
                    sub = [keys[i] for i in idxs]
                    blobs = self.get(sub, layers, Location(len(sub), [ti] * len(sub)))
                    for i, blob in zip(idxs, blobs, strict=True):
                        if blob is not None and raw:
                            out[i] = byte_view(blob)
                        elif blob is not None:
                            kv = _decoded(blob, keys[i], layers)
                            out[i] = kv if kv is None or not deferred else LentChunk(kv)
            yield out  # (get() counted the other tiers' misses)
        for tier, key, chunk in lent:  # checks the reader ran and that failed
            if chunk.error is not None:
                with tier.stats.lock:
                    tier.stats.corrupt += 1
                rejected.append((tier, key, chunk.error))
        for tier, key, exc in rejected:  # after the lease: a leased slot is freed on release
            self._reject(tier, key, exc)

    def _check_views(
        self,
        keys: Sequence[str],
        idxs: Sequence[int],
        views: Sequence[torch.Tensor | ReadingBuffer | None],
        layers: tuple[int, int] | None,
        raw: bool = False,
        deferred: bool = False,
    ) -> list[torch.Tensor | LentChunk | ChunkError | None]:
        """Each lent chunk verified (checksums of the layers asked, key, model) into its
        KV view, or the error that rejects it; on two threads where there are several
        (the checksum releases the GIL: a restore's verification takes half the time),
        inline where only headers are checked (``deferred``)."""

        def check(item: tuple[int, torch.Tensor | ReadingBuffer | None]
                  ) -> torch.Tensor | LentChunk | ChunkError | None:
            i, view = item
            if view is None:
                return None
            reading = view if isinstance(view, ReadingBuffer) else None
            if reading is not None:
                view = reading.buf  # header and first layer read: the rest still landing
            try:
                header, kv = chunk_view(view, keys[i], self.fingerprint, layers,
                                        verify=not deferred, as_kv=not raw)
                if deferred:
                    return LentChunk(kv, view, header, reading=reading)  # (raw: kv is bytes)
                return view if raw else kv
            except ChunkError as exc:
                return exc

        items = list(zip(idxs, views, strict=True))
        if deferred:  # headers only (tens of microseconds each): threads would cost more
            return [check(item) for item in items]
        return map_restore(check, items)

    # ----------------------------------------------------------------- evictions
    def _demoter(self, index: int):
        def on_evict(key: str, blob: bytes | None) -> None:
            if blob is None:
                return  # nothing to move (the tier could not hand the bytes over cheaply)
            target = index + 1 if self.demotion is None else self.demotion(index, len(blob))
            if target is None:
                with self._lock:
                    self.stats.demotions_skipped += 1
                return
            lower = self.tiers[target]
            res = self._safe_put(lower, {key: blob})
            with self._lock:
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
