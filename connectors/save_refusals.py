"""Saves the store refused, made loud: each counted by why (for vLLM's ``/metrics``) and
logged, at most once a minute per reason, with the setting that would have let it through.
A save that is refused costs a future hit, never KV: without this, a model whose chunks
outgrow the sidecar's RAM tier saved nothing and nobody heard.

The store's reasons are strings (a tier's ``full``, ``too_large``, ``io_error: ...``; an
HTTP status through ``kvtier serve``); :func:`refusal_of` sorts them.
"""

from __future__ import annotations

import enum
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

log = logging.getLogger(__name__)

LOG_EVERY_S = 60.0
"""A reason's warning is logged at most this often (the first at once); the counts go on."""


class Refusal(enum.Enum):
    """Why a chunk was not stored."""

    TOO_LARGE = "too_large"
    FULL = "full"
    UNAVAILABLE = "unavailable"
    """The store did not answer (a timeout, refused or dropped), or was set aside after
    such a failure."""
    ERROR = "error"


WHAT_TO_CHANGE = {
    Refusal.TOO_LARGE: "a chunk is larger than the store's tiers take: give the RAM tier room "
                       "for one (the sidecar's tiers.cpu_bytes, KVTIER_TIERS__CPU_BYTES, and "
                       "server.chunk_slot_bytes, KVTIER_SERVER__CHUNK_SLOT_BYTES; "
                       "server.max_body_bytes for bodies), or lower the connector's chunk_tokens",
    Refusal.FULL: "the store is full and could not evict: raise its tiers' sizes "
                  "(tiers.cpu_bytes, tiers.disk_bytes)",
    Refusal.UNAVAILABLE: "the store did not answer in time: check the sidecar, or raise the "
                         "connector's transfer_timeout_s",
    Refusal.ERROR: "see the reason; the store's own log says more",
}


_NAMED = [(re.compile(rf"(?<![a-z]){r.value}(?![a-z])"), r)  # "disk_full" is full
          for r in (Refusal.TOO_LARGE, Refusal.FULL, Refusal.UNAVAILABLE)]


def refusal_of(why: str) -> Refusal:
    """The kind of a store's reason: one the connector gave (``unavailable: ...``), else
    the first a tier named (a RAM tier's ``too_large`` names the setting to change even
    where a lower tier was full too), else an error."""
    text = why.lower()
    if text.startswith(Refusal.UNAVAILABLE.value):
        return Refusal.UNAVAILABLE
    return next((r for pattern, r in _NAMED if pattern.search(text)), Refusal.ERROR)


class SaveRefusals:
    """Refused saves by reason, each reason's warning rate-limited (:data:`LOG_EVERY_S`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.counts: dict[Refusal, int] = dict.fromkeys(Refusal, 0)
        self._unlogged: dict[Refusal, int] = dict.fromkeys(Refusal, 0)
        self._logged_at: dict[Refusal, float] = {}

    def refused(self, failed: Mapping[str, str]) -> None:
        """Count the store's refusals (key -> why) and warn where a reason is due."""
        by_reason: dict[Refusal, list[tuple[str, str]]] = {}
        for key, why in failed.items():
            by_reason.setdefault(refusal_of(why), []).append((key, why))
        now = self._clock()
        due: list[tuple[Refusal, int, str, str]] = []
        with self._lock:
            for reason, items in by_reason.items():
                self.counts[reason] += len(items)
                self._unlogged[reason] += len(items)
                last = self._logged_at.get(reason)
                if last is None or now - last >= LOG_EVERY_S:
                    self._logged_at[reason] = now
                    due.append((reason, self._unlogged[reason], *items[0]))
                    self._unlogged[reason] = 0
        for reason, n, key, why in due:
            log.warning("kvtier: %d chunk save(s) refused (%s) since the last warning, e.g. "
                        "%s: %s. %s", n, reason.value, key, why, WHAT_TO_CHANGE[reason])

    def counters(self) -> dict[str, int]:
        """As the connector's counters (``vllm:kvtier_refused_saves_<reason>_total``)."""
        return {f"refused_saves_{r.value}": n for r, n in self.counts.items()}


def ram_tier_problem(tiers: Iterable[Mapping[str, Any]], chunk_bytes: int,
                     ram_tier: str = "cpu") -> str | None:
    """Why the store's RAM tier (its entry of ``/v1/stats`` ``tiers``) can hold none of
    the connector's chunks of ``chunk_bytes``, with the setting to change; None where it
    can, or where the store has no RAM tier (a choice, not a fault)."""
    for tier in tiers:
        if tier.get("name") != ram_tier:
            continue
        capacity = int(tier.get("capacity_bytes") or 0)
        if capacity >= chunk_bytes:
            return None
        return (f"the store's RAM tier holds {capacity} bytes, less than one of this model's "
                f"chunks ({chunk_bytes} bytes): its saves are refused as too_large or go to "
                f"slower tiers only. Set the sidecar's tiers.cpu_bytes "
                f"(KVTIER_TIERS__CPU_BYTES) to many chunks, or lower the connector's chunk_tokens")
    return None
