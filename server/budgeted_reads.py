"""Chunks read for a client's request, each read charged against the read budget
(:mod:`kvtier.server.reply_budget`) before a tier lends it, and held while its bytes are:
a GET's chunk, a batch GET's chunks, a prefetch's promotions, a derive's source and new
chunk. The sizes come from the tiers' indexes (:mod:`kvtier.server.read_plan`), so a
request that could never fit is refused (413) and one that does not fit now is told to
retry (503) before anything is read. These run on worker threads (a tier's lease may wait
on its lock or a disk read)."""

from __future__ import annotations

import contextlib
import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.connectors.tiers.blobs import get_each
from kvtier.connectors.tiers.derived import EXACT
from kvtier.connectors.tiers.manager import TierManager
from kvtier.errors import ChunkFormatError
from kvtier.server.errors import RouteError
from kvtier.server.read_plan import plan_each, plan_prefix, runs
from kvtier.server.reply_budget import ReplyBudget, Reservation

RUN_KEYS = 64
"""Keys a batch GET or a prefetch reads at a time (one lease per tier for them)."""

Codecs = frozenset[str] | None


class Unlent(enum.Enum):
    """Why a GET got no chunk under a lease."""

    MISSING = "missing"
    """No tier holds it."""
    REJECTED = "rejected"
    """The tier holding it did not lend it verified (a copy its checks rejected, or one
    gone meanwhile): the caller reads on through every tier."""


@dataclass
class LeasedChunk:
    """A whole chunk a tier lends, verified: sent from the tier's memory, ``lease`` open
    until the reply is written."""

    view: torch.Tensor
    lease: contextlib.ExitStack
    tier: str


def lease_whole(reads: ReplyBudget, held: Reservation, manager: TierManager, key: str,
                codecs: Codecs) -> LeasedChunk | Unlent:
    """The whole chunk under its tier's lease, charged to ``held`` before the tier lends
    it (or why not). A hit below the fastest tier is promoted, as any read's is."""
    loc = manager.lookup([key], codecs)
    if not loc.length:
        manager.count_misses()
        return Unlent.MISSING
    (size,) = manager.sizes([key], loc.tiers)
    held.grow_to(reads.charge(size))
    lease = contextlib.ExitStack()
    try:
        (part,) = lease.enter_context(manager.lease_chunks([key], loc, codecs, strict=True))
        if part is not None:
            try:
                part.verify()  # the whole chunk goes out: checked first
            except ChunkFormatError:
                part = None  # dropped from its tier when the lease ends
        if part is None:
            lease.close()
            return Unlent.REJECTED
        view = part.buf
        if loc.tiers[0] > 0:
            manager.promote({key: memoryview(view.numpy())})
    except BaseException:
        lease.close()
        raise
    held.settle(view.numel())
    return LeasedChunk(view, lease, manager.tiers[loc.tiers[0]].name)


def read_copy(reads: ReplyBudget, held: Reservation, manager: TierManager, key: str,
              span: tuple[int, int] | None, codecs: Codecs) -> tuple[bytes | None, str | None]:
    """A verified copy of the chunk (or of its layers ``span``), and its tier; the whole
    chunk's read charged to ``held`` first, then what the copy keeps."""
    (planned,) = plan_each(manager, [key], codecs)
    if not planned.stored:
        manager.count_misses()
        return None, None
    held.grow_to(reads.charge(planned.size))
    ((blob, tier),) = get_each(manager, [key], span, codecs, strict=True)
    held.settle(0 if blob is None else len(blob))
    return blob, tier


def read_batch(reads: ReplyBudget, held: Reservation, manager: TierManager,
               keys: Sequence[str], wheres: Sequence[str], counts: Counter[str],
               span: tuple[int, int] | None, codecs: Codecs) -> tuple[dict[str, bytes | None], int]:
    """Each of ``keys`` (distinct; stored as ``wheres``; asked for ``counts`` times) read
    and kept for one reply: (key -> copy or None, the reply's chunk bytes). A whole-chunk
    reply whose size the indexes show over the budget is a 413 before any read; each run
    of reads is charged before it is made, and what it keeps stays charged to ``held``."""
    plan = plan_each(manager, wheres, codecs)
    if span is None:
        known = sum(p.size * counts[k] for k, p in zip(keys, plan, strict=True)
                    if p.size is not None)
        reads.check_fits(known, "the reply")
    out: dict[str, bytes | None] = dict.fromkeys(keys)
    stored = [i for i, p in enumerate(plan) if p.stored]
    manager.count_misses(len(plan) - len(stored))
    charges = [reads.charge(plan[i].size) for i in stored]
    kept = nbytes = 0
    for run in runs(charges, reads.group_bytes, RUN_KEYS):
        held.grow_to(kept + sum(charges[j] for j in run))
        idx = [stored[j] for j in run]
        got = get_each(manager, [wheres[i] for i in idx], span, codecs, strict=True)
        for i, (blob, _) in zip(idx, got, strict=True):
            out[keys[i]] = blob
            if blob is not None:
                kept += len(blob)
                nbytes += len(blob) * counts[keys[i]]
        held.settle(kept)
        reads.check_fits(nbytes, "the reply")  # sizes no index knew, or layer ranges
    return out, nbytes


def prefetch(reads: ReplyBudget, manager: TierManager, tenant: str, wheres: Sequence[str],
             codecs: Codecs) -> int:
    """The stored prefix of ``wheres`` raised into the fastest tier, a run of reads at a
    time, each run's reads charged while they are held: how many chunks were promoted. A
    key named twice is read once. No room for the first run is a 503; a later run that
    finds none ends the prefetch (what was promoted stays)."""
    wheres = list(dict.fromkeys(wheres))
    plan = plan_prefix(manager, wheres, codecs)
    slower = [i for i, p in enumerate(plan) if p.tier != 0]  # only these are read
    charges = [reads.charge(plan[i].size) for i in slower]
    promoted = 0
    for run in runs(charges, reads.group_bytes, RUN_KEYS):
        try:
            held = reads.reserve(tenant, sum(charges[j] for j in run))
        except RouteError:
            if promoted:
                break
            raise
        try:
            promoted += manager.prefetch([wheres[slower[j]] for j in run], codecs)
        finally:
            held.release()
    return promoted


def derive_charge(reads: ReplyBudget, manager: TierManager, source: str) -> int:
    """What a derive from ``source`` holds while it runs: the source's lease and the new
    chunk (at most the source's bytes), as a PUT of it holds its body; 0 where no exact
    copy is stored (nothing is read)."""
    located = manager.locate([source], EXACT)
    if located[0] is None:
        return 0
    (size,) = manager.sizes([source], located)
    return 2 * reads.charge(size)
