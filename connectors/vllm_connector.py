"""kvtier as a vLLM v1 KV connector (``KVConnectorBase_V1``): the facade vLLM loads.

Plug in through vLLM's own extension point::

    KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.connectors.vllm_connector",
        kv_role="kv_both",
        kv_connector_extra_config={"url": "http://127.0.0.1:8100"},   # or {"tiers": {...}}
    )

The unit is one vLLM block. Its key is kvtier's chained hash over the block's token ids
(``kvtier.chunk_keys``) under a fingerprint of the model (its weights) and of vLLM's KV
layout, so blocks of another model or layout can never match. This module only speaks
vLLM's interface; the work is the scheduler side's (:mod:`.vllm_scheduler`: lookups, the
step's plan of loads and saves) and the worker side's (:mod:`.vllm_worker`: blocks gathered
straight into the store's memory, lent chunks scattered straight into the cache, one copy
and one checksum pass each way; a missing or corrupt chunk is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes it: never wrong KV). Loads and saves
are synchronous.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvtier.chunk_format import max_chunk_bytes
from kvtier.connectors.chunk_store import ChunkStore, open_store
from kvtier.connectors.vllm_blocks import StepPlan
from kvtier.connectors.vllm_scheduler import SchedulerSide
from kvtier.connectors.vllm_worker import WorkerSide
from kvtier.models.weights_digest import checkpoint_digest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    """A step's plan, as vLLM hands it from the scheduler to the workers."""

    plan: StepPlan = field(default_factory=StepPlan)


def fingerprint(vllm_config: VllmConfig, salt: object = None) -> bytes:
    """The model (its weights: their digest for a local checkpoint, kept beside it, see
    :mod:`kvtier.models.weights_digest`; else the hub id and revision vLLM loads) and vLLM's
    KV layout (dtype, block size, layers, KV heads, head size, cache dtype)."""
    model = vllm_config.model_config
    digest = checkpoint_digest(str(model.model))
    weights = f"w{digest}" if digest else f"{model.model}@{model.revision or 'main'}"
    return "|".join((
        "vllm-v2",
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
        self._store: ChunkStore | None = None
        self.scheduler_side = SchedulerSide(self._open_store, self.block_size, self.fingerprint)
        self.worker_side = WorkerSide(self._open_store, self.block_size, self.fingerprint)

    @property
    def stats(self) -> dict[str, int]:
        w = self.worker_side.stats
        return {"hit_blocks": self.scheduler_side.hit_blocks, "loaded_blocks": w.loaded_blocks,
                "saved_blocks": w.saved_blocks, "load_errors": w.load_errors}

    def _open_store(self) -> ChunkStore:
        """The store, opened once; its slots hold one block of every layer (both sides
        size it alike, so an in-process store they share is sized once)."""
        if self._store is None:
            groups = self._kv_cache_config.kv_cache_groups
            layers = sum(len(g.layer_names) for g in groups)
            block = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
            self._store = open_store(self.extra, max_chunk_bytes(layers, block))
        return self._store

    # ------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_side.allocated(request, list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVTierConnectorMetadata(self.scheduler_side.step_plan(scheduler_output))

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.scheduler_side.finished(request.request_id)
        return False, None

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register(kv_caches, self._kv_cache_config.num_blocks)

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierConnectorMetadata)
        return meta.plan

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_side.load(self._plan().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        return  # whole blocks of every layer are saved together in wait_for_save

    def wait_for_save(self) -> None:
        self.worker_side.save(self._plan().saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors()

    def shutdown(self) -> None:
        if self._store is not None:
            self._store.close()
