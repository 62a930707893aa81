"""kvtier as a vLLM v1 KV connector (``KVConnectorBase_V1``).

Plug in through vLLM's own extension point::

    KVTransferConfig(
        kv_connector="KVTierConnector",
        kv_connector_module_path="kvtier.connectors.vllm_connector",
        kv_role="kv_both",
        kv_connector_extra_config={"url": "http://127.0.0.1:8100"},   # or {"tiers": {...}}
    )

The unit is one vLLM block. Its key is kvtier's chained hash over the block's token ids
(``kvtier.chunk_keys``) under a fingerprint of the model and of vLLM's KV layout, so the
scheduler and the workers agree on keys without sharing Python's hash seed, and blocks of
another model or layout can never match. A block's chunk holds that block of every layer,
copied whole from vLLM's per-layer cache tensors (never reinterpreted: the chunk's nominal
shape only carries the bytes; the fingerprint names the real layout).

Scheduler side: ``get_num_new_matched_tokens`` asks the store for the longest stored
prefix of the prompt's full blocks (leaving at least one token to compute) and plans the
load; ``build_connector_meta`` hands each step's loads and saves to the workers. Worker
side: ``start_load_kv`` copies the planned blocks into the cache before the forward pass
(a missing or corrupt chunk is reported through ``get_block_ids_with_load_errors`` and
vLLM recomputes it: never wrong KV); ``wait_for_save`` stores the prompt blocks the step
completed. Loads and saves are synchronous.
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

from kvtier.chunk_format import decode_chunk, encode_chunk, max_chunk_bytes
from kvtier.chunk_keys import chunk_keys
from kvtier.connectors.chunk_store import ChunkStore, open_store
from kvtier.errors import ChunkError
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
class BlockTransfer:
    """Blocks of one request to load or save this step, with their chunk keys."""

    req_id: str
    block_ids: list[int]
    keys: list[str]


@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class _ReqState:
    """Scheduler-side view of one running request."""

    prompt: list[int]
    keys: list[str]
    """Keys of the prompt's full blocks."""
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0
    """Leading prompt blocks known to be stored (loaded ones included)."""


class KVTierConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.block_size = vllm_config.cache_config.block_size
        model = vllm_config.model_config
        # The weights name the model: their digest for a local checkpoint (kept beside it,
        # see kvtier.models.weights_digest), else the hub id and revision vLLM loads.
        digest = checkpoint_digest(str(model.model))
        weights = f"w{digest}" if digest else f"{model.model}@{model.revision or 'main'}"
        salt = extra.get("fingerprint_salt")
        self.fingerprint = "|".join(
            (
                "vllm-v2",
                weights,
                f"salt{len(str(salt))}:{salt}" if salt else "nosalt",
                str(model.dtype),
                f"bs{self.block_size}",
                f"layers{model.get_num_layers(vllm_config.parallel_config)}",
                f"kvh{model.get_num_kv_heads(vllm_config.parallel_config)}",
                f"hd{model.get_head_size()}",
                str(vllm_config.cache_config.cache_dtype),
            )
        ).encode()
        self.extra = extra
        self._store: ChunkStore | None = None
        # scheduler side
        self._requests: dict[str, _ReqState] = {}
        self._planned: dict[str, tuple[int, int]] = {}
        """req_id -> (first block to load, blocks stored), from the last lookup."""
        self._loads: dict[str, BlockTransfer] = {}
        # worker side
        self._layers: list[tuple[str, torch.Tensor, int]] = []
        self._load_errors: set[int] = set()
        self.stats = {"hit_blocks": 0, "loaded_blocks": 0, "saved_blocks": 0, "load_errors": 0}

    # ------------------------------------------------------------------ the store
    def _block_bytes(self) -> int:
        """One block of every layer (both sides compute it alike, so an in-process store
        shared by the scheduler and the worker is sized once)."""
        return sum(
            g.kv_cache_spec.page_size_bytes * len(g.layer_names)
            for g in self._kv_cache_config.kv_cache_groups
        )

    @property
    def store(self) -> ChunkStore:
        if self._store is None:
            layers = sum(len(g.layer_names) for g in self._kv_cache_config.kv_cache_groups)
            self._store = open_store(self.extra, max_chunk_bytes(layers, self._block_bytes()))
        return self._store

    def _keys(self, token_ids: list[int]) -> list[str]:
        return [k.key for k in chunk_keys(token_ids, self.block_size, self.fingerprint, False)]

    # ------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        prompt = list(request.prompt_token_ids or [])
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _ReqState(prompt, self._keys(prompt))
        usable = (len(prompt) - 1) // self.block_size  # leave a token to compute
        try:
            stored = self.store.lookup(state.keys[:usable]) if usable > 0 else 0
        except Exception as exc:  # noqa: BLE001 - an unreachable store is a miss
            log.warning("kvtier lookup failed, recomputing: %s", exc)
            stored = 0
        first = num_computed_tokens // self.block_size
        if stored <= first:
            return 0, False
        self._planned[request.request_id] = (first, stored)
        return stored * self.block_size - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._requests[request.request_id]
        state.block_ids = list(blocks.get_block_ids()[0])
        plan = self._planned.pop(request.request_id, None)
        if num_external_tokens <= 0 or plan is None:
            return
        first, stored = plan
        self._loads[request.request_id] = BlockTransfer(
            request.request_id, state.block_ids[first:stored], state.keys[first:stored]
        )
        state.saved = max(state.saved, stored)
        self.stats["hit_blocks"] += stored - first

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVTierConnectorMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        progress: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            progress[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                state.block_ids = list(new_ids[0])  # a resumed request gets all its blocks
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            progress[req_id] = cached.num_computed_tokens[i]
        for req_id, computed in progress.items():
            state = self._requests[req_id]
            done = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = min(done, len(state.prompt)) // self.block_size
            full = min(full, len(state.keys), len(state.block_ids))
            if full > state.saved:
                meta.saves.append(
                    BlockTransfer(
                        req_id, state.block_ids[state.saved : full], state.keys[state.saved : full]
                    )
                )
                state.saved = full
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._planned.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        layers = []
        for name, kv in kv_caches.items():
            dims = [d for d, n in enumerate(kv.shape[:2]) if n == num_blocks]
            if not dims:
                raise ValueError(
                    f"kvtier connector: layer {name} has KV shape {tuple(kv.shape)}, with no "
                    f"block dimension of size {num_blocks} in its first two dims"
                )
            layers.append((name, kv, dims[0]))
        self._layers = layers

    def _encode(self, key: str, block_id: int) -> bytes:
        parts = [kv.narrow(dim, block_id, 1) for _, kv, dim in self._layers]
        data = torch.stack([p.contiguous().reshape(-1) for p in parts]).cpu()
        per_layer = data.shape[1]
        nominal = data.view(len(parts), 2, self.block_size, 1, per_layer // (2 * self.block_size))
        return encode_chunk(key, self.fingerprint, nominal)

    def _decode_into(self, key: str, blob: bytes, block_id: int) -> None:
        _, t = decode_chunk(blob, key, self.fingerprint, any_namespace=True)
        flat = t.reshape(len(self._layers), -1)
        for li, (_, kv, dim) in enumerate(self._layers):
            dst = kv.narrow(dim, block_id, 1)
            if flat.shape[1] != dst.numel():
                raise ChunkError(f"chunk {key} holds {flat.shape[1]} elements per layer, "
                                 f"the cache block {dst.numel()}")  # fmt: skip
            dst.copy_(flat[li].view(dst.shape).to(dst.device, dst.dtype))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierConnectorMetadata)
        for load in meta.loads:
            try:
                blobs = self.store.get(load.keys)
            except Exception as exc:  # noqa: BLE001 - every block of the load is an error
                log.warning("kvtier get failed: %s", exc)
                blobs = [None] * len(load.keys)
            for key, blob, block_id in zip(load.keys, blobs, load.block_ids, strict=True):
                try:
                    if blob is None:
                        raise ChunkError(f"chunk {key} is gone")
                    self._decode_into(key, blob, block_id)
                    self.stats["loaded_blocks"] += 1
                except ChunkError as exc:
                    log.warning("kvtier load of block %d failed (recomputed): %s", block_id, exc)
                    self._load_errors.add(block_id)
                    self.stats["load_errors"] += 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:  # fmt: skip
        return  # whole blocks of every layer are saved together in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierConnectorMetadata)
        chunks: dict[str, bytes] = {}
        for save in meta.saves:
            for key, block_id in zip(save.keys, save.block_ids, strict=True):
                chunks[key] = self._encode(key, block_id)
        if not chunks:
            return
        try:
            failed = self.store.put(chunks)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss
            log.warning("kvtier put of %d blocks failed: %s", len(chunks), exc)
            return
        self.stats["saved_blocks"] += len(chunks) - len(failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._store is not None:
            self._store.close()
