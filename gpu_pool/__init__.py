"""The paged KV pool: block allocator, block tables, prefix cache, KV storage and kernels.

Knows nothing of the lower tiers or of policies; works on CPU and CUDA tensors alike.
"""

from kvtier.gpu_pool.block_manager import AddResult, AppendResult, KVBlockManager, Sequence
from kvtier.gpu_pool.block_pool import BlockPool
from kvtier.gpu_pool.kv_storage import KVStorage
from kvtier.gpu_pool.paged_pool import PagedKVPool
from kvtier.gpu_pool.stats import PoolStats

__all__ = [
    "AddResult",
    "AppendResult",
    "BlockPool",
    "KVBlockManager",
    "KVStorage",
    "PagedKVPool",
    "PoolStats",
    "Sequence",
]
