"""kvtier as a vLLM v1 KV connector (``KVConnectorBase_V1``): the facade vLLM loads.

Plug in through vLLM's own extension point::

    KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.connectors.vllm_connector",
        kv_role="kv_both",
        kv_connector_extra_config={"url": "http://127.0.0.1:8100"},   # or {"tiers": {...}}
    )

The unit is a chunk of whole vLLM blocks (``chunk_tokens``, 256 by default; a chunk-sized
slot a conversation fills turn by turn is stored in pieces, each block once). Its key is
kvtier's chained hash over the chunk's token ids (``kvtier.chunk_keys``) under a
fingerprint of the model (its weights), of vLLM's KV layout and of its parallelism; each
TP/PP rank stores its own part under the key and its rank, so blocks of another model,
layout or rank can never match. This module only speaks vLLM's interface; the work is the
scheduler side's (:mod:`.vllm_scheduler`: lookups, the step's plan of loads and saves, the
reply saved when a request ends) and the worker side's (:mod:`.vllm_worker`: blocks
gathered straight into the store's memory on a background thread, lent chunks scattered
straight into the cache, one copy and one checksum pass each way; a missing or corrupt
chunk is reported through ``get_block_ids_with_load_errors`` and vLLM recomputes it: never
wrong KV). Loads run on a background thread while vLLM parks the request (its async-load
protocol; ``async_loads`` false: before the forward pass); saves run off the forward path
and a finished request's blocks are held until they land (``get_finished``).

Options (``kv_connector_extra_config``): ``url``/``token``/``shm`` (a ``kvtier serve``) or
``config``/``tiers`` (in-process tiers; ``tiers: {disk_codec: int8}`` keeps the disk's chunks
compressed, docs/tiers.md), ``accept_codecs`` (the codecs of stored KV this instance loads:
``[none]`` exact KV only; unset: exact KV and what the store's tiers write; a lossy chunk is
decoded on load), ``lookup_timeout_s`` / ``transfer_timeout_s`` / ``store_retry_s`` (a
``kvtier serve``'s deadlines and back-off, :mod:`.store_breaker`), ``chunk_tokens`` (256), ``save_decode`` (true: save
a finished request's reply too), ``background_saves`` (true), ``async_loads`` (true: vLLM's
async-load protocol, :mod:`.vllm_loads`; false: load before the forward pass; ``auto``: per
request, whichever delays vLLM's requests less), ``save_priority``
(``normal``; ``idle``: the save thread runs only on a core nothing else wants), ``policy``
(true: load a
stored prefix only where that beats recomputing it, :mod:`.vllm_policy`), ``profile`` (a
``kvtier calibrate`` profile to start the tiers' speeds from), ``fingerprint_salt``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvtier.chunk_format import max_chunk_bytes
from kvtier.connectors import private_sidecar
from kvtier.connectors.chunk_store import (
    ChunkStore,
    RemoteChunkStore,
    accept_codecs,
    open_store,
    with_auto_codecs,
)
from kvtier.connectors.private_sidecar import SidecarAddress
from kvtier.connectors.save_refusals import ram_tier_problem
from kvtier.connectors.store_breaker import StoreDeadlines
from kvtier.connectors.tiers.codec_setup import CodecContext
from kvtier.connectors.vllm_blocks import DEFAULT_CHUNK_TOKENS, ChunkGrid, Rank, Role, StepPlan
from kvtier.connectors.vllm_metrics import Deltas, KVTierPromMetrics, KVTierStats
from kvtier.connectors.vllm_policy import LoadObservation, LoadPolicy, LoadTiming
from kvtier.connectors.vllm_scheduler import SchedulerSide
from kvtier.connectors.vllm_worker import WorkerSide
from kvtier.errors import ConfigError
from kvtier.kv_codecs import ENCODABLE
from kvtier.models.weights_digest import checkpoint_digest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvtier.policies.cost_model import CostModel

log = logging.getLogger(__name__)


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    """A step's plan, as vLLM hands it from the scheduler to the workers."""

    plan: StepPlan = field(default_factory=StepPlan)
    store: SidecarAddress | None = None
    """Where the ranks' shared tiers are, when the connector started them itself."""


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler side after a step: the loads they made (bytes
    and seconds), which measure each tier's speed for the restore-or-recompute policy."""

    loads: list[LoadObservation] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTierWorkerMetadata)
        return KVTierWorkerMetadata(self.loads + other.loads)


def fingerprint(vllm_config: VllmConfig, salt: object = None) -> bytes:
    """The model (its weights: their digest for a local checkpoint, kept beside it, see
    :mod:`kvtier.models.weights_digest`; else the hub id and revision vLLM loads), vLLM's
    KV layout (dtype, block size, layers, KV heads, head size, cache dtype) and how the
    model is split (TP and PP sizes: a rank's layers and heads depend on them)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    digest = checkpoint_digest(str(model.model))
    weights = f"w{digest}" if digest else f"{model.model}@{model.revision or 'main'}"
    return "|".join((
        "vllm-v3",
        f"tp{parallel.tensor_parallel_size}pp{parallel.pipeline_parallel_size}",
        weights,
        f"salt{len(str(salt))}:{salt}" if salt else "nosalt",
        str(model.dtype),
        f"bs{vllm_config.cache_config.block_size}",
        f"layers{model.get_num_layers(vllm_config.parallel_config)}",
        f"kvh{model.get_num_kv_heads(vllm_config.parallel_config)}",
        f"hd{model.get_head_size()}",
        str(vllm_config.cache_config.cache_dtype),
    )).encode()


class KVTierConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.block_size = vllm_config.cache_config.block_size
        self.fingerprint = fingerprint(vllm_config, self.extra.get("fingerprint_salt"))
        self.grid = ChunkGrid.of(self.block_size, self.fingerprint,
                                 int(self.extra.get("chunk_tokens", DEFAULT_CHUNK_TOKENS)))
        parallel = vllm_config.parallel_config
        self.world = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        self.workers_apart = parallel.distributed_executor_backend not in (None, "uni")
        """vLLM runs its workers in processes of their own (TP/PP > 1, or vLLM's CPU backend
        with multiprocessing, which uses the multiprocess executor even for one worker)."""
        StoreDeadlines.of(self.extra)  # refused at start, by name, where out of range
        self._store: ChunkStore | None = None
        self._chunk_bytes = 0
        """The largest chunk this side writes (the store's slots are sized to it)."""
        self._profile: CostModel | None = None
        self._shared: SidecarAddress | None = None
        """In-process tiers that vLLM's rank processes share: the private sidecar holding
        them (started by the scheduler side, told to the workers in each step's plan)."""
        self._deltas = Deltas()
        self._step_t0: float | None = None
        self.kv_role = Role(self._kv_transfer_config.kv_role or "kv_both")
        self.load_timing = LoadTiming.of(self.extra.get("async_loads", True))
        """Loads off the forward path: vLLM parks a request while its KV loads on a
        background thread (:mod:`.vllm_loads`); or before the forward pass; or either,
        chosen per request (``auto``: :meth:`LoadPolicy.parks`)."""
        self.scheduler_side = SchedulerSide(self._open_store, self.grid, self.world,
                                            save_decode=bool(self.extra.get("save_decode", True)),
                                            policy=self._policy(), role=self.kv_role,
                                            timing=self.load_timing)
        self.worker_side = WorkerSide(self._open_store, self.grid)
        if self.role == KVConnectorRole.SCHEDULER:
            recompute_failed_loads(self._kv_transfer_config,
                                   _flag(self.extra, "recompute_failed_loads", True))
        if not (self._needs_shared and self.role == KVConnectorRole.WORKER):
            self._open_store()  # now, not on the first request (an arena is allocated)

    @property
    def stats(self) -> dict[str, float]:
        """This side's running totals (the scheduler's or a worker's)."""
        if self.role == KVConnectorRole.SCHEDULER:
            s = self.scheduler_side
            return {"hit_blocks": s.hit_blocks, "recomputed_by_decision_tokens": s.recomputed_by_decision,
                    "schedule_seconds": s.busy_s, "lookups": s.lookups,
                    "arrival_raises": s.arrivals.raises,
                    "parked_loads": s.parked_loads, "loads_before_forward": s.forward_loads,
                    "session_turns_reported": s.turns.sent, **self._store_faults()}
        w, saves = self.worker_side.stats, self.worker_side.saves
        return {**self._store_faults(), **self.worker_side.refusals.counters(),
                "loaded_blocks": w.loaded_blocks, "saved_blocks": w.saved_blocks,
                "derived_blocks": w.derived_blocks,
                "load_errors": w.load_errors, "load_seconds": w.load_s,
                "parked_load_seconds": w.async_load_s,
                "save_wait_seconds": w.save_wait_s, "step_seconds": w.step_s, "steps": w.steps,
                "save_hold_seconds": saves.hold_s, "held_requests": saves.holds}

    def _store_faults(self) -> dict[str, int]:
        """What a ``kvtier serve`` cost this side: timeouts, breaker opens, skips."""
        store = self._store
        return store.faults.counters() if isinstance(store, RemoteChunkStore) else {}

    def get_kv_connector_stats(self) -> KVTierStats | None:
        return self._deltas.since_last(self.stats)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVTierStats | None:
        return KVTierStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVTierPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _layers_and_block(self) -> tuple[int, int]:
        """Layers this worker holds and the bytes of one block of all of them."""
        groups = self._kv_cache_config.kv_cache_groups
        layers = sum(len(g.layer_names) for g in groups)
        return layers, sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)

    def _policy(self) -> LoadPolicy:
        """Restore or recompute on this instance's measured costs; ``profile``: a ``kvtier
        calibrate`` profile whose tiers' speeds it starts from; ``policy: false`` loads
        every stored prefix."""
        layers, block = self._layers_and_block()
        cost = self._calibrated()
        return LoadPolicy(block // self.block_size, layers, None if cost is None else cost.tiers,
                          enabled=bool(self.extra.get("policy", True)))

    def _calibrated(self) -> CostModel | None:
        """The ``profile`` option's cost model (None without one), read once."""
        from kvtier.machine import this_machine
        from kvtier.policies.profile import load_profile

        if self._profile is None and self.extra.get("profile"):
            cost, warnings = load_profile(self.extra["profile"], machine=this_machine())
            for warning in warnings:
                log.warning("kvtier connector: %s", warning)
            self._profile = cost
        return self._profile

    def _codec_context(self) -> CodecContext | None:
        """What resolving a tier's ``auto`` codec needs: this worker's chunks (every layer
        of ``chunk_tokens`` tokens, as the worker stores them) and, with a ``profile``, the
        tiers' calibrated speeds; the budget is the tiers' configuration's. None for a
        cache dtype no codec encodes (fp8)."""
        dtype = getattr(self._kv_cache_config.kv_cache_groups[0].kv_cache_spec, "dtype", None)
        if dtype not in ENCODABLE:
            return None
        layers, block = self._layers_and_block()
        per_layer = block // layers // dtype.itemsize
        shape = (layers, 2, self.grid.chunk_tokens, 1, per_layer // (2 * self.block_size))
        return CodecContext(shape, dtype, max_error=0.0, cost=self._calibrated())

    @property
    def _needs_shared(self) -> bool:
        """In-process tiers, but vLLM's workers run in processes of their own."""
        return not self.extra.get("url") and (self.world > 1 or self.workers_apart)

    def _open_store(self) -> ChunkStore:
        """The store, opened once; its slots hold one chunk of every layer (both sides
        size it alike, so an in-process store they share is sized once). In-process tiers
        for several ranks live in a private sidecar the scheduler side starts."""
        if self._store is None:
            layers, block = self._layers_and_block()
            slot = max_chunk_bytes(layers, block * self.grid.chunk_blocks)
            options = with_auto_codecs(self.extra, self._codec_context())
            if self._needs_shared:
                if self.role == KVConnectorRole.SCHEDULER and self._shared is None:
                    self._shared = private_sidecar.start(options, slot)
                if self._shared is None:
                    raise ConfigError("kvtier connector: no step plan has said yet where the "
                                      "ranks' shared tiers are")
                options = {**options, **self._shared.options()}
            self._store = open_store(options, slot)
            self._chunk_bytes = slot
        return self._store

    def _check_ram_tier(self) -> None:
        """Say at start, with the setting to change, where the server's RAM tier cannot
        hold one of this worker's chunks (every save would be refused there)."""
        store = self._open_store()
        if not isinstance(store, RemoteChunkStore):
            return
        try:
            tiers = store.tier_capacities()
        except Exception as exc:  # noqa: BLE001 - a check, not a condition of starting
            log.info("kvtier connector: could not ask %s for its tiers: %s", store.url, exc)
            return
        problem = ram_tier_problem(tiers, self._chunk_bytes)
        if problem is not None:
            log.warning("kvtier connector: %s", problem)

    # ------------------------------------------------------------- scheduler side
    # Every hook runs on vLLM's scheduling path, between its steps: timed (schedule_seconds).
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        with self._scheduling():
            n = self.scheduler_side.matched_tokens(request, num_computed_tokens)
            return n, n > 0 and self.scheduler_side.parks(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        with self._scheduling():
            self.scheduler_side.allocated(request, list(blocks.get_block_ids()[0]),
                                          num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        with self._scheduling():
            return KVTierConnectorMetadata(self.scheduler_side.step_plan(scheduler_output),
                                           self._shared)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        with self._scheduling():
            meta = connector_output.kv_connector_worker_meta
            if isinstance(meta, KVTierWorkerMetadata):
                self.scheduler_side.observe(meta.loads)
            if connector_output.finished_sending:
                self.scheduler_side.saves_landed(list(connector_output.finished_sending))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        with self._scheduling():
            return self.scheduler_side.finished(request, list(block_ids)), None

    def on_new_request(self, request: Request) -> None:
        with self._scheduling():
            self.scheduler_side.arrived(request)

    @contextlib.contextmanager
    def _scheduling(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.scheduler_side.busy_s += time.perf_counter() - t0

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # a prefill instance saves before it answers: its decode peer may ask at once
        background = self.extra.get("background_saves", self.kv_role is not Role.PRODUCER)
        idle = str(self.extra.get("save_priority", "normal")).lower()
        if idle not in ("idle", "normal"):
            raise ConfigError(f"kvtier connector: save_priority must be idle or normal, not {idle!r}")
        self.worker_side = WorkerSide(self._open_store, self.grid, _worker_rank(self.world),
                                      background=bool(background), idle_saves=idle == "idle",
                                      async_loads=self.load_timing is not LoadTiming.BEFORE_FORWARD,
                                      accept_codecs=accept_codecs(self.extra),
                                      saves_yield=(None if "saves_yield_to_prefill" not in self.extra
                                                   else _flag(self.extra, "saves_yield_to_prefill", False)),
                                      save_step_gap_s=_seconds(self.extra, "save_step_gap_s"))
        self.worker_side.register(kv_caches, self._kv_cache_config.num_blocks)
        if self.extra.get("url") and self.worker_side.rank.index == 0:
            self._check_ram_tier()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._step_t0 = time.perf_counter()
        if isinstance(connector_metadata, KVTierConnectorMetadata):
            plan = connector_metadata.plan
            self.worker_side.saves.step_started(plan.prefill, idle=plan.idle)
            if self._shared is None:
                self._shared = connector_metadata.store

    def clear_connector_metadata(self) -> None:
        """The step ends: its time counted (the connector's share of it is in the stats)."""
        self.worker_side.saves.step_ended()
        if self._step_t0 is not None:
            self.worker_side.stats.step_s += time.perf_counter() - self._step_t0
            self.worker_side.stats.steps += 1
            self._step_t0 = None
        super().clear_connector_metadata()

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierConnectorMetadata)
        return meta.plan

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVTierConnectorMetadata)
        if kv_connector_metadata.plan.preempted:
            self.worker_side.wait_saves()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        self.worker_side.save(plan.finishing)  # finished requests' last chunks, blocks held
        now = plan.loads_before_forward()
        if now:
            if plan.needs_finishing(now):
                self.worker_side.wait_saves()
            self.worker_side.load(now)
        parked = plan.parked_loads()  # on the loading thread, after the saves they read
        self.worker_side.load_async(parked, after_saves=plan.needs_finishing(parked))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        return  # whole blocks of every layer are saved together in wait_for_save

    def wait_for_save(self) -> None:
        self.worker_side.save(self._plan().saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return (self.worker_side.finished(finished_req_ids) or None,
                self.worker_side.finished_loading() or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        loads = self.worker_side.take_observations()
        return KVTierWorkerMetadata(loads) if loads else None

    def shutdown(self) -> None:
        self.scheduler_side.close()
        self.worker_side.close()
        if self._store is not None:
            self._store.close()
        if self._shared is not None and self.role == KVConnectorRole.SCHEDULER:
            private_sidecar.stop(self._shared)


def recompute_failed_loads(config: Any, recompute: bool) -> None:
    """A chunk that cannot be loaded (evicted between the lookup and the load, corrupt, a
    store gone) is a cache miss, its blocks recomputed, not a failed request. vLLM's own
    default (``kv_load_failure_policy: fail``, for peers whose KV cannot be recomputed)
    ends the request with an error instead; the scheduler reads the policy right after it
    builds its connector, so the connector sets ``recompute`` there, unless its option
    ``recompute_failed_loads`` is false (then vLLM's setting stands)."""
    if recompute and getattr(config, "kv_load_failure_policy", "recompute") != "recompute":
        config.kv_load_failure_policy = "recompute"
        log.info("kvtier connector: blocks that fail to load are recomputed "
                 "(kv_load_failure_policy: recompute; recompute_failed_loads: false keeps vLLM's)")


def _flag(extra: dict[str, Any], name: str, default: bool) -> bool:
    """A boolean option of ``kv_connector_extra_config`` (JSON true/false, or a string)."""
    value = extra.get(name, default)
    if isinstance(value, str):
        if value.strip().lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ConfigError(f"kvtier connector: {name} must be true or false, not {value!r}")
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def _seconds(extra: dict[str, Any], name: str) -> float | None:
    """A duration option of ``kv_connector_extra_config`` in seconds (None: unset)."""
    value = extra.get(name)
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"kvtier connector: {name} must be a number of seconds, not {value!r}") from None
    if not 0 <= seconds <= 60:  # NaN too
        raise ConfigError(f"kvtier connector: {name} must be between 0 and 60 seconds, not {value!r}")
    return seconds


def _worker_rank(world: int) -> Rank:
    """This worker's rank among the TP x PP ranks (asked of vLLM's process groups, which
    exist once the worker registers its caches)."""
    if world == 1:
        return Rank()
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp = get_tp_group()
    return Rank(get_pp_group().rank_in_group * tp.world_size + tp.rank_in_group, world)
