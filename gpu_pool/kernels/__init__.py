"""Pool kernels: KV write, paged attention, block gather/scatter.

Triton on CUDA tensors, the torch reference (``reference.py``) on CPU tensors; ``backend=``
forces one. See docs/kernels.md.
"""

from kvtier.gpu_pool.kernels.api import (
    gather_blocks,
    paged_decode_attention,
    paged_prefill_attention,
    scatter_blocks,
    write_kv,
)
from kvtier.gpu_pool.kernels.dispatch import BACKENDS, DEBUG_ENV
from kvtier.gpu_pool.kernels.heuristics import choose_num_splits
from kvtier.gpu_pool.kernels.host_blocks import (
    copy_host,
    gather_blocks_host,
    scatter_blocks_host,
)

__all__ = [
    "BACKENDS",
    "DEBUG_ENV",
    "choose_num_splits",
    "copy_host",
    "gather_blocks",
    "gather_blocks_host",
    "paged_decode_attention",
    "paged_prefill_attention",
    "scatter_blocks",
    "scatter_blocks_host",
    "write_kv",
]
