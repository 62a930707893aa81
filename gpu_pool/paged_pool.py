"""The paged KV pool: block manager plus KV tensors, the surface the engine and tiers use.

It performs the copy-on-write copies the manager asks for, so a caller can never write
into a block another sequence still reads, and it turns block tables and slot mappings
into the int tensors the attention kernels take.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from kvtier.gpu_pool.block_manager import AddResult, AppendResult, KVBlockManager, SeqId, Sequence
from kvtier.gpu_pool.block_pool import BlockPool
from kvtier.gpu_pool.kv_storage import KVStorage, PoolSpec
from kvtier.gpu_pool.stats import PoolStats


class PagedKVPool:
    """Paged KV storage with block tables, prefix sharing and copy-on-write."""

    def __init__(self, storage: KVStorage, enable_prefix_caching: bool = True):
        self.storage = storage
        self.block_size = storage.block_size
        self.block_pool = BlockPool(storage.num_blocks, storage.block_size, enable_prefix_caching)
        self.manager = KVBlockManager(self.block_pool)

    @classmethod
    def from_config(cls, cfg: PoolSpec) -> PagedKVPool:
        return cls(KVStorage.from_config(cfg), cfg.enable_prefix_caching)

    @property
    def device(self) -> torch.device:
        return self.storage.device

    # ------------------------------------------------------------ sequences
    def add_sequence(self, seq_id: SeqId, token_ids: Seq[int], extra: bytes = b"") -> AddResult:
        return self.manager.add_sequence(seq_id, token_ids, extra)

    def append_tokens(self, seq_id: SeqId, token_ids: Seq[int]) -> AppendResult:
        result = self.manager.append_tokens(seq_id, token_ids)
        self.storage.copy_blocks(result.copies)
        return result

    def mark_computed(self, seq_id: SeqId, num_tokens: int | None = None) -> None:
        self.manager.mark_computed(seq_id, num_tokens)

    def fork(self, parent_id: SeqId, child_id: SeqId) -> Sequence:
        return self.manager.fork(parent_id, child_id)

    def free_sequence(self, seq_id: SeqId) -> None:
        self.manager.free_sequence(seq_id)

    def sequence(self, seq_id: SeqId) -> Sequence:
        return self.manager.sequence(seq_id)

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self.manager

    # ----------------------------------------------------------- addressing
    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> torch.Tensor:
        """int64 tensor of physical slots for positions [start, end) of a sequence."""
        slots = self.manager.slot_mapping(seq_id, start, end)
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def block_tables(self, seq_ids: Seq[SeqId], pad_to: int | None = None) -> torch.Tensor:
        """int32 ``[batch, max_blocks]`` block tables, padded with 0 (never read: kernels
        stop at each sequence's length)."""
        tables = [self.manager.sequence(s).block_ids for s in seq_ids]
        width = max([len(t) for t in tables] + [pad_to or 0, 1])
        out = torch.zeros((len(tables), width), dtype=torch.int32)
        for i, t in enumerate(tables):
            if t:
                out[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return out.to(self.device)

    def context_lens(self, seq_ids: Seq[SeqId]) -> torch.Tensor:
        lens = [self.manager.sequence(s).num_tokens for s in seq_ids]
        return torch.tensor(lens, dtype=torch.int32, device=self.device)

    # ----------------------------------------------------------------- stats
    def stats(self) -> PoolStats:
        bp, bs = self.block_pool, self.block_size
        fill: dict[int, int] = {}
        for seq in self.manager.sequences():
            n = seq.num_tokens
            for i, b in enumerate(seq.block_ids):
                f = min(bs, n - i * bs)
                if f > fill.get(b, 0):
                    fill[b] = f
        stored = sum(fill.values())
        held = len(fill) * bs
        q, h = self.manager.prefix_query_tokens, self.manager.prefix_hit_tokens
        return PoolStats(
            num_blocks=bp.num_blocks,
            block_size=bs,
            blocks_used=bp.num_used,
            blocks_free=bp.num_free,
            blocks_cached=bp.num_cached,
            blocks_evictable=bp.num_evictable,
            num_sequences=len(self.manager),
            tokens_stored=stored,
            utilisation=stored / held if held else 0.0,
            prefix_query_tokens=q,
            prefix_hit_tokens=h,
            prefix_hit_rate=h / q if q else 0.0,
            alloc_calls=bp.alloc_calls,
            alloc_blocks=bp.alloc_blocks,
            alloc_ns_per_block=bp.alloc_ns / bp.alloc_blocks if bp.alloc_blocks else 0.0,
            evictions=bp.evictions,
        )
