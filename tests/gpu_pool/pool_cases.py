"""Small paged pools and KV writes for the pool's example tests (errors and sharing)."""

from __future__ import annotations

from kvtier.gpu_pool import KVStorage, PagedKVPool


def make_pool(num_blocks: int = 8, block_size: int = 4, caching: bool = True) -> PagedKVPool:
    return PagedKVPool(
        KVStorage(2, num_blocks, block_size, 1, 2, "float32", "cpu"),
        enable_prefix_caching=caching,
    )



def write_and_compute(pool: PagedKVPool, seq_id: object, value: float) -> None:
    """Fill the sequence's uncomputed positions with ``value + position`` and publish them."""
    seq = pool.sequence(seq_id)
    start = seq.num_computed_tokens
    slots = pool.slot_mapping(seq_id, start, seq.num_tokens)
    bs = pool.block_size
    for i, s in enumerate(slots.tolist()):
        pool.storage.kv[:, s // bs, :, s % bs] = value + start + i
    pool.mark_computed(seq_id)

