"""When an idle session leaves the GPU and how far down it goes.

Under memory pressure (pool use above the high watermark) idle sessions leave, those
predicted to stay away longest first, until use is back under the low watermark. Each goes
to the fastest tier that can hold it and from which loading it back beats recomputing it (a
full tier makes room by demoting its own victims, ranked by its eviction policy, one tier
down). A session no tier can bring back faster than recompute is dropped (its chunks stay
wherever they were already stored).

Writes on the admission path are what make a turn wait, so they are done ahead of need:
above the high watermark, the idle sessions next in line to leave (as many as a room-making
offload down to the low watermark would take) are stored while their blocks stay in the
pool (:meth:`PredictiveOffload.stage_ahead`). When a turn then needs the room they leave at
once; a full tier makes room for them by demoting its own victims, as the write on the
admission path would have.

Under load a write is weighed against what it saves (:func:`write_pays`): a write on the
admission path holds up the turn being admitted and everything queued behind it, so a
session leaving then is stored only when its chance of coming back times the time a
restore saves (recompute minus load, at the GPU's load weight) beats the write's cost to
everyone (:mod:`kvtier.policies.load`); otherwise it is dropped, as the pool's LRU would.
Writes ahead of need (pre-stage, stage-ahead) hold up no admission: they only pay their
link's load.

Sending sessions predicted to stay away for hours straight to a deeper tier, so as not to
displace sooner returns from the fastest one, was measured and lost: the fastest tier's own
session-aware eviction already demotes them, and skipping it sent sessions that did come
back to the slower tier (``docs/policies.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TypeVar

from kvtier.errors import InvalidArgumentError
from kvtier.policies.cost_model import CostModel
from kvtier.policies.load import LoadWeights
from kvtier.policies.registry import register

T = TypeVar("T")


@dataclass(frozen=True)
class IdleSession:
    session: Hashable
    gpu_tokens: int
    """Tokens of its KV held in the pool (freed by offloading it)."""
    prefix_tokens: int
    """Tokens a resume could reuse (what recompute would have to redo)."""
    predicted_next_s: float
    """Expected seconds until its next turn."""
    p_return: float = 1.0
    """Chance that it comes back at all (shared prefixes: about certain)."""
    context_tokens: int = 0
    """Tokens before ``prefix_tokens`` that a resume has anyway (a chunk deep in a
    conversation costs more to recompute than one at its start)."""


@dataclass(frozen=True)
class OffloadDecision:
    session: Hashable
    tier: str | None
    """Target tier, or None: drop from the pool without storing (recompute on return)."""


@dataclass(frozen=True)
class Watermarks:
    high: float = 0.9
    low: float = 0.75

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.high <= 1:
            raise InvalidArgumentError(
                f"watermarks need 0 < low <= high <= 1, got low={self.low} high={self.high}"
            )


def _held(pair: tuple[IdleSession, bool]) -> int:
    return pair[0].gpu_tokens


def worth_storing(cost: CostModel, tier: str, tokens: int, chunk_tokens: int = 256) -> bool:
    """Loading ``tokens`` back from ``tier`` beats recomputing them."""
    chunks = max(1, -(-tokens // chunk_tokens))
    return cost.load_time(tier, tokens, chunks) < cost.prefill.time(0, tokens)


def copy_value(cost: CostModel, tier: str, s: IdleSession, weights: LoadWeights,
               chunk_tokens: int = 256) -> float:
    """What a copy of ``s`` in ``tier`` is expected to save everyone: its chance of reuse
    times recomputing minus loading (at the GPU's weight), less what the load costs its
    link's other users."""
    chunks = max(1, -(-s.prefix_tokens // chunk_tokens))
    recompute = cost.prefill.time(s.context_tokens, s.prefix_tokens)
    load = cost.load_time(tier, s.prefix_tokens, chunks)
    return s.p_return * (weights.compute * (recompute - load) - (weights.link(tier) - 1.0) * load)


def write_pays(
    cost: CostModel, tier: str, s: IdleSession, weights: LoadWeights, blocking: bool,
    chunk_tokens: int = 256,
) -> bool:
    """Storing ``s`` in ``tier`` now is worth what it costs everyone: with chance
    ``p_return`` a return then saves recomputing its prefix minus loading it (at the GPU's
    weight; the load also weighs on its link), against the write's time at what its path's
    weight adds (a duplex link's write path is not its reads') and, when the write blocks
    an admission (``blocking``), the delay it adds there at the GPU's weight: the write
    after what its path has queued, less any slack (a negative wait: the turn waits for
    something else till then). Idle and non-blocking, this is :func:`worth_storing`."""
    chunks = max(1, -(-s.prefix_tokens // chunk_tokens))
    write = cost.store_time(tier, s.prefix_tokens, chunks)
    wc, wl = weights.compute, weights.write_link(tier)
    price = (wl - 1.0) * write + (wc * max(write + weights.write_wait(tier), 0.0) if blocking else 0.0)
    return copy_value(cost, tier, s, weights, chunk_tokens) > price


def displace_pays(
    cost: CostModel, tier: str, new: IdleSession, victim: IdleSession, weights: LoadWeights,
    chunk_tokens: int = 256,
) -> bool:
    """A copy of ``new`` written ahead of need into a full ``tier`` would push out the
    tier's next victim: worth it when it is expected to save more than the victim's copy
    would, by more than the write costs the link's other users (the victim may still be
    demoted rather than lost: this errs toward keeping what is there)."""
    chunks = max(1, -(-new.prefix_tokens // chunk_tokens))
    write = cost.store_time(tier, new.prefix_tokens, chunks)
    gain = copy_value(cost, tier, new, weights, chunk_tokens) - copy_value(cost, tier, victim, weights, chunk_tokens)
    return gain > (weights.write_link(tier) - 1.0) * write


def landing_pays(
    cost: CostModel, tier: str, s: IdleSession, weights: LoadWeights, remaining_s: float,
    chunk_tokens: int = 256,
) -> bool:
    """A turn needs the blocks of ``s`` while their copy to ``tier`` is still in flight:
    waiting ``remaining_s`` for it to land (the turn and the queue behind it, at the GPU's
    weight) pays when its chance of reuse times what a restore then saves is more;
    otherwise the copy is abandoned and the blocks go now."""
    return copy_value(cost, tier, s, weights, chunk_tokens) > weights.compute * remaining_s


@register("offload", "predictive")
class PredictiveOffload:
    """kvtier's offload policy (see the module docstring)."""

    name = "predictive"

    def __init__(self, watermarks: Watermarks | None = None, chunk_tokens: int = 256) -> None:
        self.watermarks = watermarks or Watermarks()
        self.chunk_tokens = chunk_tokens

    def target_tier(
        self,
        s: IdleSession,
        cost: CostModel,
        tiers: Sequence[str],
        room_bytes: Mapping[str, float],
        weights: LoadWeights | None = None,
        blocking: bool = False,
    ) -> str | None:
        """``room_bytes``: the most each tier can take for it (a tier's capacity, or its
        empty space for a speculative write that must not displace anything);
        ``weights``: the load now, when the write must also pay for itself under it
        (:func:`write_pays`; ``blocking``: on the admission path)."""
        for t in tiers:
            if room_bytes.get(t, 0) < cost.stored_bytes(t, s.prefix_tokens):
                continue
            if not worth_storing(cost, t, s.prefix_tokens, self.chunk_tokens):
                continue
            if weights is None or write_pays(cost, t, s, weights, blocking, self.chunk_tokens):
                return t
        return None

    def decide(
        self,
        idle: Sequence[IdleSession],
        gpu_used_tokens: int,
        gpu_capacity_tokens: int,
        cost: CostModel,
        tiers: Sequence[str],
        room_bytes: Mapping[str, float],
        force: bool = False,
        weights: LoadWeights | None = None,
    ) -> list[OffloadDecision]:
        """Sessions to move out now (``force``: free down to the low watermark even below
        the high one, to admit a request: the writes are on its path); ``room_bytes`` as
        in :meth:`target_tier`, used up as sessions are placed; ``weights`` as there."""
        cap = max(gpu_capacity_tokens, 1)
        if not force and gpu_used_tokens <= self.watermarks.high * cap:
            return []
        target = self.watermarks.low * cap
        free = dict(room_bytes)
        out: list[OffloadDecision] = []
        used = gpu_used_tokens
        for s in sorted(idle, key=lambda s: -s.predicted_next_s):
            if used <= target:
                break
            tier = self.target_tier(s, cost, tiers, free, weights, blocking=force)
            if tier is not None:
                free[tier] = free.get(tier, 0) - cost.stored_bytes(tier, s.prefix_tokens)
            out.append(OffloadDecision(s.session, tier))
            used -= s.gpu_tokens
        return out

    def prestage(
        self,
        idle: Sequence[IdleSession],
        cost: CostModel,
        tiers: Sequence[str],
        empty_bytes: Mapping[str, float],
        weights: LoadWeights | None = None,
    ) -> list[OffloadDecision]:
        """Idle sessions to store into the tiers' empty space now, keeping their blocks,
        whatever the pool's use: a copy made while a link is idle lets the blocks go with
        no write when a turn needs them, and costs no admission anything. Those predicted
        away longest first (they leave first), each where a write pays under the load now
        (:func:`write_pays`, not blocking); ``empty_bytes`` is used up as they are placed."""
        free = dict(empty_bytes)
        out: list[OffloadDecision] = []
        for s in sorted(idle, key=lambda s: -s.predicted_next_s):
            tier = self.target_tier(s, cost, tiers, free, weights)
            if tier is not None:
                free[tier] = free.get(tier, 0) - cost.stored_bytes(tier, s.prefix_tokens)
            out.append(OffloadDecision(s.session, tier))
        return out

    def leaving_next(
        self,
        in_eviction_order: Iterable[T],
        gpu_used_tokens: int,
        gpu_capacity_tokens: int,
        tokens: Callable[[T], int] = attrgetter("gpu_tokens"),
    ) -> Iterator[T]:
        """The idle sessions (in the pool's victim order; ``tokens`` gives what each holds)
        that making room down to the low watermark would let go; none at or below the
        high watermark. These are what stage-ahead stores, and what a tier keeps copies of
        even when full: they are the copies that let the pool free blocks with no write."""
        cap = max(gpu_capacity_tokens, 1)
        if gpu_used_tokens <= self.watermarks.high * cap:
            return
        ahead = gpu_used_tokens - self.watermarks.low * cap
        for s in in_eviction_order:
            if ahead <= 0:
                return
            ahead -= tokens(s)
            yield s

    def stage_ahead(
        self,
        in_eviction_order: Iterable[tuple[IdleSession, bool]],
        gpu_used_tokens: int,
        gpu_capacity_tokens: int,
        cost: CostModel | None,
        tiers: Sequence[str],
        room_bytes: Mapping[str, float],
        weights: LoadWeights | None = None,
    ) -> list[OffloadDecision]:
        """Which idle sessions to store now, keeping their blocks: the pool's next victims
        (``in_eviction_order``: each with whether it is stored already), as many as making
        room down to the low watermark would take, that have no copy below yet. Above the
        high watermark only; sessions no tier pays for are left out (they are dropped when
        their turn comes). Without a cost model (nothing measured) each goes to the first
        tier."""
        out: list[OffloadDecision] = []
        reach = self.leaving_next(in_eviction_order, gpu_used_tokens, gpu_capacity_tokens, _held)
        for s, stored in reach:
            if stored:
                continue
            if cost is None:
                tier = tiers[0] if tiers else None
            else:
                tier = self.target_tier(s, cost, tiers, room_bytes, weights)
            if tier is not None:
                out.append(OffloadDecision(s.session, tier))
        return out
