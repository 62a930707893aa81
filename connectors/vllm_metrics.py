"""kvtier's vLLM connector counters in vLLM's own stats: each side reports what it did
since its last report (:class:`KVTierStats`, summed across workers and the scheduler by
vLLM), vLLM logs them and :class:`KVTierPromMetrics` exports them on vLLM's ``/metrics``
as ``vllm:kvtier_*`` counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

COUNTERS: dict[str, str] = {
    "hit_blocks": "Blocks of new requests the store held and the policy chose to load.",
    "loaded_blocks": "Blocks loaded into vLLM's KV cache from kvtier.",
    "saved_blocks": "Blocks saved to kvtier (every rank's part counted).",
    "derived_blocks": "Blocks saved by cutting them out of a stored segment that held them (nothing uploaded).",
    "load_errors": "Blocks whose chunk was missing or failed its checks (vLLM recomputed them).",
    "recomputed_by_decision_tokens": "Stored tokens recomputed because loading them was slower.",
    "parked_loads": "Requests whose KV loaded while vLLM parked them (its async-load protocol).",
    "loads_before_forward": "Requests whose KV loaded before the forward pass of the step that scheduled them.",
    "load_seconds": "Time loads held vLLM's forward path.",
    "parked_load_seconds": "Time parked requests' loads took on the loading thread (off the forward path).",
    "save_wait_seconds": "Time saves held vLLM's forward path (submitting, draining).",
    "step_seconds": "Time of vLLM's steps the connector took part in (its share: the two above).",
    "steps": "vLLM steps the connector took part in.",
    "schedule_seconds": "Time vLLM's scheduler spent in the connector's hooks (lookups, plans).",
    "lookups": "Questions the scheduler asked the store (vLLM asks again for a request it could not schedule).",
    "arrival_raises": "Requests left waiting whose chunks were found below RAM (raised into RAM before scheduling).",
    "save_hold_seconds": "Time finished requests' blocks were held until their saves landed.",
    "held_requests": "Finished requests whose blocks were held for their saves.",
    "session_turns_reported": "Turn starts and ends of vLLM's sessions reported to the store (session-aware eviction).",
    "store_timeouts": "Requests to kvtier serve that found no answer within their deadline (connection closed).",
    "store_failures": "Requests to kvtier serve that failed without an answer otherwise (refused, reset).",
    "store_breaker_opens": "Times kvtier serve was set aside after a failure (skipped, then probed).",
    "skipped_lookups": "Lookups answered as a miss without asking, kvtier serve set aside (recomputed).",
    "skipped_loads": "Loads not asked for, kvtier serve set aside (their blocks recomputed).",
    "skipped_saves": "Chunk saves not sent, kvtier serve set aside (counted in refused_saves_unavailable too).",
    "refused_saves_too_large": "Chunk saves refused: larger than the store's tiers take.",
    "refused_saves_full": "Chunk saves refused: the store was full.",
    "refused_saves_unavailable": "Chunk saves lost: the store did not answer, or was set aside.",
    "refused_saves_error": "Chunk saves refused for any other reason (the log says which).",
}


@dataclass
class KVTierStats(KVConnectorStats):
    """Counts since the last report, by name (:data:`COUNTERS`)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: round(value, 6) if isinstance(value, float) else value
                for name, value in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class Deltas:
    """What a side's running totals grew by since the last call."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def since_last(self, totals: dict[str, float]) -> KVTierStats | None:
        delta = {k: v - self._last.get(k, 0) for k, v in totals.items() if k in COUNTERS}
        self._last = dict(totals)
        delta = {k: v for k, v in delta.items() if v}
        return KVTierStats(delta) if delta else None


class KVTierPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvtier_<name>_total`` counters, one child per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"vllm:kvtier_{name}_total", documentation=doc,
                                    labelnames=labelnames)
            for name, doc in COUNTERS.items()
        }
        for counter in self._counters.values():  # exported from the start, at 0
            for labels in per_engine_labelvalues.values():
                counter.labels(*labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            counter = self._counters.get(name)
            if counter is not None and value > 0:
                counter.labels(*labels).inc(value)
