"""Builders for kernel tests and benchmarks: paged KV with a contiguous twin.

The pool is laid out the hostile way: block ids shuffled, every slot that no sequence owns
(unused blocks, the tail of each last block, block 0 that pads the tables) filled with NaN,
so a kernel that reads anything it should not turns the result into NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class PagedKV:
    """One pool layer plus the same K/V per sequence laid out contiguously."""

    kv_layer: torch.Tensor  # [num_blocks, 2, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor  # int32 [batch, max_blocks], padded with 0
    context_lens: torch.Tensor  # int32 [batch]
    keys: list[torch.Tensor]  # per sequence [len, kv_heads, head_dim]
    values: list[torch.Tensor]

    @property
    def block_size(self) -> int:
        return self.kv_layer.shape[2]


def triton_devices() -> list[str]:
    """Devices the Triton kernels can run on here: CUDA, and CPU under TRITON_INTERPRET=1."""
    from kvtier.gpu_pool.kernels.dispatch import triton_interpreted

    devices = ["cpu"] if triton_interpreted() else []
    if torch.cuda.is_available():
        devices.append("cuda")
    return devices


def make_paged_kv(
    lens: Sequence[int],
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    fill: float = float("nan"),
) -> PagedKV:
    """Random K/V for sequences of ``lens`` tokens, scattered over shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = 1 + sum(per_seq) + spare_blocks  # block 0 is never owned: tables pad with it
    kv = torch.full((num_blocks, 2, block_size, kv_heads, head_dim), fill, dtype=dtype)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros((len(lens), max(per_seq + [1])), dtype=torch.int32)
    keys, values = [], []
    for b, n in enumerate(lens):
        ids = [order.pop() for _ in range(per_seq[b])]
        tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn((n, kv_heads, head_dim), generator=gen).to(dtype)
        v = torch.randn((n, kv_heads, head_dim), generator=gen).to(dtype)
        for t in range(0, n, block_size):
            kv[ids[t // block_size], 0, : min(block_size, n - t)] = k[t : t + block_size]
            kv[ids[t // block_size], 1, : min(block_size, n - t)] = v[t : t + block_size]
        keys.append(k.to(device))
        values.append(v.to(device))
    return PagedKV(
        kv_layer=kv.to(device),
        block_tables=tables.to(device),
        context_lens=torch.tensor(list(lens), dtype=torch.int32, device=device),
        keys=keys,
        values=values,
    )


def sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
                   ) -> torch.Tensor:
    """Causal-to-the-end attention of ``q [n, Hq, D]`` (the last ``n`` positions) over
    contiguous ``k, v [L, Hkv, D]`` with torch's SDPA in fp32; GQA by repeating KV heads."""
    n, num_heads, _ = q.shape
    length, kv_heads, _ = k.shape
    group = num_heads // kv_heads
    kk = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, L, D]
    vv = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
    qpos = torch.arange(length - n, length, device=q.device)
    mask = torch.arange(length, device=q.device)[None, :] <= qpos[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), kk, vv, attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)  # [n, Hq, D]
