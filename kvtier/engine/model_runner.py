"""Runs model steps over sequences of the paged pool: the engine's compute half.

The runner owns the model and a :class:`PagedKVPool` sized for it. A step takes, per
sequence, how many of its not-yet-computed tokens to feed; it packs them, builds the
attention metadata from the pool's block tables and slot mapping, runs the model (which
writes the new K/V into the pool) and marks the tokens computed, so their full blocks enter
the prefix cache. What to run each step (batching, budgets, preemption) is the scheduler's
job, not this module's.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import torch

from kvtier.chunk_format import DTYPE_NAMES
from kvtier.errors import InvalidArgumentError
from kvtier.gpu_pool import AddResult, KVStorage, PagedKVPool
from kvtier.gpu_pool.kv_storage import resolve_device, resolve_dtype
from kvtier.models.checkpoint import checkpoint_files, load_state_dict
from kvtier.models.config import ModelConfig
from kvtier.models.llama import AttentionMetadata, CausalLM
from kvtier.models.weights_digest import state_dict_digest, weights_digest
from kvtier.transfer.layer_load import LayerLoad

SeqId = Hashable


@dataclass
class _PackedStep:
    """One step's sequences packed in batch order: token ids, their positions and KV
    slots, cumulative query lengths, and each sequence's end (its context length, and
    what is computed once the step ran)."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    cu: list[int] = field(default_factory=lambda: [0])
    ends: list[int] = field(default_factory=list)


class ModelRunner:
    """A model plus its paged KV pool; feeds sequences' tokens through the model.

    Give either ``model_dir`` (a Hugging Face checkpoint directory) or ``config`` and
    ``state_dict``. The pool takes ``num_blocks`` blocks of ``block_size`` tokens, or as many
    as fit in ``memory_bytes``; the KV dtype is the model dtype.
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        config: ModelConfig | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "auto",
        num_blocks: int | None = None,
        memory_bytes: int | None = None,
        block_size: int = 16,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        fingerprint_salt: str | None = None,
    ):
        self.device = resolve_device(device) if isinstance(device, str) else torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if (model_dir is None) == (config is None):
            raise InvalidArgumentError("give ModelRunner either model_dir or config + state_dict")
        if model_dir is not None:
            config = ModelConfig.from_pretrained(model_dir)
            state_dict = load_state_dict(model_dir, config, self.dtype, self.device)
            files = sorted(set(checkpoint_files(Path(model_dir)).values()))
            self.weights_digest = weights_digest(model_dir, files)
        elif state_dict is None:
            raise InvalidArgumentError("ModelRunner(config=...) needs state_dict too")
        else:
            self.weights_digest = state_dict_digest(state_dict)
            state_dict = {k: v.to(self.device, self.dtype) for k, v in state_dict.items()}
        assert config is not None
        self.config = config
        limit = config.max_model_len
        if max_model_len is not None and not 0 < max_model_len <= limit:
            raise InvalidArgumentError(
                f"max_model_len={max_model_len} must be in [1, {limit}] for this model "
                "(max_position_embeddings, capped by a sliding window)"
            )
        self.max_model_len = max_model_len or limit
        self.model = CausalLM.from_state_dict(config, state_dict, self.max_model_len)
        self.pool = PagedKVPool(
            self._storage(num_blocks, memory_bytes, block_size), enable_prefix_caching
        )
        self.kv_dtype_name = DTYPE_NAMES[self.dtype]
        self.fingerprint = config.fingerprint(
            self.kv_dtype_name, self.weights_digest, fingerprint_salt
        )
        """Chained-hash ``extra`` of every sequence: KV of another model (other weights, or
        the same config with other weights) or another salt never matches."""
        self.layer_loads: list[LayerLoad] = []
        """Streamed restores in progress: every step waits for each layer's KV."""

    def _storage(self, num_blocks: int | None, memory_bytes: int | None, block_size: int
                 ) -> KVStorage:
        cfg = self.config
        shape = (cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim)
        if (num_blocks is None) == (memory_bytes is None):
            raise InvalidArgumentError("size the KV pool with num_blocks or memory_bytes (one)")
        if num_blocks is None:
            assert memory_bytes is not None
            num_blocks = memory_bytes // KVStorage.bytes_per_block(*shape, self.dtype)
            if num_blocks < 1:
                raise InvalidArgumentError(
                    f"memory_bytes={memory_bytes} holds no KV block of this model "
                    f"({KVStorage.bytes_per_block(*shape, self.dtype)} bytes each)"
                )
        return KVStorage(cfg.num_hidden_layers, num_blocks, block_size,
                         cfg.num_key_value_heads, cfg.head_dim, self.dtype, self.device)

    # ------------------------------------------------------------- sequences
    def add_sequence(self, seq_id: SeqId, token_ids: Sequence[int]) -> AddResult:
        """Add a sequence to the pool under this model's fingerprint (prefix cache aware)."""
        if len(token_ids) > self.max_model_len:
            raise InvalidArgumentError(
                f"sequence {seq_id!r} has {len(token_ids)} tokens, over max_model_len "
                f"{self.max_model_len}"
            )
        bad = [t for t in token_ids if not 0 <= int(t) < self.config.vocab_size]
        if bad:
            raise InvalidArgumentError(
                f"token id {bad[0]} of sequence {seq_id!r} is outside the vocabulary "
                f"[0, {self.config.vocab_size})"
            )
        return self.pool.add_sequence(seq_id, token_ids, self.fingerprint)

    def append_tokens(self, seq_id: SeqId, token_ids: Sequence[int]) -> None:
        """Append tokens (e.g. the sampled one) to feed in a later step."""
        seq = self.pool.sequence(seq_id)
        if seq.num_tokens + len(token_ids) > self.max_model_len:
            raise InvalidArgumentError(
                f"sequence {seq_id!r} would grow to {seq.num_tokens + len(token_ids)} tokens, "
                f"over max_model_len {self.max_model_len}"
            )
        self.pool.append_tokens(seq_id, token_ids)

    def free_sequence(self, seq_id: SeqId) -> None:
        self.pool.free_sequence(seq_id)

    # --------------------------------------------------------- streamed restores
    def add_layer_load(self, load: LayerLoad) -> None:
        self.layer_loads.append(load)

    def take_poisoned_blocks(self) -> set[int]:
        """Take the blocks of chunks that streamed restores lost out of the prefix cache and
        return them: whoever references them must be recomputed before the next step."""
        bad: set[int] = set()
        for load in self.layer_loads:
            bad.update(load.take_poisoned_blocks())
        for b in bad:
            self.pool.block_pool.uncache_block(b)
        return bad

    def reap_layer_loads(self, wait: bool = False) -> None:
        """Release finished restores (their poison must have been taken first)."""
        keep: list[LayerLoad] = []
        for load in self.layer_loads:
            if wait:
                load.wait()
            if load.done and not load.unhandled_poison():
                if load.release is not None:
                    load.release(load)
            else:
                keep.append(load)
        self.layer_loads = keep

    def _wait_layer(self, layer: int) -> None:
        for load in self.layer_loads:
            load.wait_layer(layer)

    # ------------------------------------------------------------------ steps
    def run(self, batch: Sequence[tuple[SeqId, int]], all_positions: bool = False
            ) -> torch.Tensor:
        """Feed each sequence's next ``n`` uncomputed tokens; fp32 logits of each one's last
        fed token ``[B, vocab]`` (``all_positions``: of every fed token, packed in batch
        order, ``[sum n, vocab]``).

        A sequence whose tokens are all computed already (a full prefix-cache hit) may ask
        for ``n = 1``: its last token is fed again for its logits, its KV not rewritten.
        """
        if not batch:
            raise InvalidArgumentError("run() needs at least one (seq_id, num_new_tokens)")
        if self.layer_loads:
            self.reap_layer_loads()
        seq_ids = [s for s, _ in batch]
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidArgumentError(f"a sequence appears twice in one step: {seq_ids}")
        step = self._pack(batch)
        dev = self.device
        max_q = max(b - a for a, b in pairwise(step.cu))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(step.slots, dtype=torch.int64, device=dev),
            block_tables=self.pool.block_tables(seq_ids),
            context_lens=torch.tensor(step.ends, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(step.cu, dtype=torch.int32, device=dev),
            max_seqlen_q=max_q,
            max_context_len=max(step.ends),
            is_decode=max_q == 1,
        )
        rows = None if all_positions else torch.tensor([c - 1 for c in step.cu[1:]], device=dev)
        logits = self.model(
            torch.tensor(step.ids, dtype=torch.int64, device=dev),
            torch.tensor(step.positions, dtype=torch.int64, device=dev),
            self.pool.storage.kv,
            meta,
            rows,
            self._wait_layer if self.layer_loads else None,
        )
        for seq_id, end in zip(seq_ids, step.ends, strict=True):
            self.pool.mark_computed(seq_id, end)
        return logits

    def _pack(self, batch: Sequence[tuple[SeqId, int]]) -> _PackedStep:
        """The step's tokens, positions and KV slots, packed in batch order."""
        step = _PackedStep()
        for seq_id, n in batch:
            seq = self.pool.sequence(seq_id)
            start = seq.num_computed_tokens
            left = seq.num_tokens - start
            if left == 0 and n == 1 and seq.num_tokens > 0:
                start, rewrite = seq.num_tokens - 1, False  # full cache hit: logits only
            elif isinstance(n, int) and 1 <= n <= left:
                rewrite = True
            else:
                raise InvalidArgumentError(
                    f"sequence {seq_id!r}: cannot feed {n!r} tokens, {left} are uncomputed "
                    f"({seq.num_computed_tokens} of {seq.num_tokens} computed)"
                )
            end = start + n
            step.ids += seq.token_ids[start:end]
            step.positions += range(start, end)
            step.slots += self.pool.manager.slot_mapping(seq_id, start, end) if rewrite else [-1] * n
            step.cu.append(step.cu[-1] + n)
            step.ends.append(end)
        return step

    def generate_greedy(self, token_ids: Sequence[int], max_new_tokens: int,
                        seq_id: SeqId = "__generate_greedy__",
                        eos_token_ids: Sequence[int] = ()) -> list[int]:
        """Prefill then decode one sequence greedily (a test and demo path); returns the
        new tokens. The sequence is freed afterwards, its full blocks stay cached."""
        self.add_sequence(seq_id, token_ids)
        out: list[int] = []
        try:
            seq = self.pool.sequence(seq_id)
            n = max(seq.num_tokens - seq.num_computed_tokens, 1)
            for _ in range(max_new_tokens):
                token = int(self.run([(seq_id, n)])[0].argmax())
                out.append(token)
                if token in eos_token_ids or len(out) == max_new_tokens:
                    break
                self.append_tokens(seq_id, [token])
                n = 1
        finally:
            self.free_sequence(seq_id)
        return out
