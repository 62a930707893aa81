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
    ) -> str | None:
        """``room_bytes``: the most each tier can take for it (a tier's capacity, or its
        empty space for a speculative write that must not displace anything)."""
        for t in tiers:
            if room_bytes.get(t, 0) >= cost.stored_bytes(t, s.prefix_tokens) and worth_storing(cost, t, s.prefix_tokens, self.chunk_tokens):
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
    ) -> list[OffloadDecision]:
        """Sessions to move out now (``force``: free down to the low watermark even below
        the high one, e.g. to admit a request); ``room_bytes`` as in :meth:`target_tier`,
        used up as sessions are placed."""
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
            tier = self.target_tier(s, cost, tiers, free)
            if tier is not None:
                free[tier] = free.get(tier, 0) - cost.stored_bytes(tier, s.prefix_tokens)
            out.append(OffloadDecision(s.session, tier))
            used -= s.gpu_tokens
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
                tier = self.target_tier(s, cost, tiers, room_bytes)
            if tier is not None:
                out.append(OffloadDecision(s.session, tier))
        return out
