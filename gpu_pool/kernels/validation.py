"""Input checks run before any kernel launch.

A Triton kernel handed a wrong shape or an out-of-range block id does not fail: it reads or
writes someone else's memory. The cheap checks (ranks, shapes, dtypes, devices) run on every
call and never synchronise with the GPU; the bounds scan reads index tensors back to the
host, so it runs only in debug mode (``debug=True`` or ``KVTIER_DEBUG_KERNELS=1``).
"""

from __future__ import annotations

import math

import torch

from kvtier.chunk_format import DTYPES
from kvtier.errors import KernelInputError

KV_DTYPES = tuple(DTYPES.values())
INDEX_DTYPES = (torch.int32, torch.int64)


def fail(msg: str) -> None:
    raise KernelInputError(msg)


def tensor(name: str, t: object, ndim: int, what: str) -> torch.Tensor:
    """``t`` is a tensor of rank ``ndim``; ``what`` names its dimensions for the message."""
    if not isinstance(t, torch.Tensor):
        fail(f"{name} must be a torch.Tensor {what}, got {type(t).__name__}")
    assert isinstance(t, torch.Tensor)
    if t.dim() != ndim:
        fail(f"{name} must have {ndim} dimensions {what}, got shape {tuple(t.shape)}")
    return t


def index_tensor(name: str, t: object, ndim: int, what: str) -> torch.Tensor:
    t = tensor(name, t, ndim, what)
    if t.dtype not in INDEX_DTYPES:
        fail(f"{name} must be an int32 or int64 tensor, got {t.dtype}; convert it with .int()")
    return t


def kv_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in KV_DTYPES:
        fail(f"{name} has dtype {t.dtype}; KV kernels take float32, float16 or bfloat16")


def same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        fail(
            f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; "
            f"cast {name} with .to({ref.dtype})"
        )


def same_device(tensors: dict[str, torch.Tensor]) -> torch.device:
    devices = {n: t.device for n, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        fail(f"all tensors must be on one device, got {listing}; move them with .to(device)")
    return first


def dim(name: str, t: torch.Tensor, axis: int, expected: int, why: str) -> None:
    if t.shape[axis] != expected:
        fail(f"{name}.shape[{axis}] is {t.shape[axis]} but must be {expected} ({why})")


def kv_layer(t: object) -> torch.Tensor:
    """One layer of the pool ``[num_blocks, 2, block_size, kv_heads, head_dim]``."""
    t = tensor("kv_layer", t, 5, "[num_blocks, 2, block_size, kv_heads, head_dim]")
    kv_dtype("kv_layer", t)
    dim("kv_layer", t, 1, 2, "index 0 holds K, 1 holds V")
    _unit_inner_stride("kv_layer", t)
    return t


def kv_pool(t: object) -> torch.Tensor:
    """The whole pool ``[layers, num_blocks, 2, block_size, kv_heads, head_dim]``."""
    t = tensor("kv", t, 6, "[layers, num_blocks, 2, block_size, kv_heads, head_dim]")
    kv_dtype("kv", t)
    dim("kv", t, 2, 2, "index 0 holds K, 1 holds V")
    dense_tail("kv", t, 3)
    return t


def _unit_inner_stride(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        fail(f"{name} must have a contiguous last (head_dim) dimension; pass {name}.contiguous()")


def dense_tail(name: str, t: torch.Tensor, from_dim: int) -> None:
    """Dimensions ``from_dim..`` are densely packed, so a kernel can copy them as one run."""
    expected = 1
    for axis in range(t.dim() - 1, from_dim - 1, -1):
        if t.shape[axis] > 1 and t.stride(axis) != expected:
            fail(
                f"{name} must be densely packed in its last {t.dim() - from_dim} dimensions "
                f"(strides {t.stride()}); pass {name}.contiguous()"
            )
        expected *= t.shape[axis]


def heads(q_heads: int, kv_heads: int) -> int:
    """GQA group size; ``num_heads`` must be a multiple of ``kv_heads``."""
    if q_heads % kv_heads != 0:
        fail(
            f"q has {q_heads} heads, not a multiple of the pool's {kv_heads} KV heads; "
            "grouped-query attention needs num_heads % kv_heads == 0"
        )
    return q_heads // kv_heads


def head_dim(q: torch.Tensor, kv: torch.Tensor) -> None:
    if q.shape[-1] != kv.shape[-1]:
        fail(f"q has head_dim {q.shape[-1]} but the pool has {kv.shape[-1]}; they must match")


def scale(value: float | None, head_dim_: int) -> float:
    """Softmax scale; ``None`` means ``1/sqrt(head_dim)``."""
    if value is None:
        return 1.0 / math.sqrt(head_dim_)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        fail(f"scale must be a positive finite number, got {value!r}")
    return float(value)


def output(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
           device: torch.device) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        fail(f"out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        fail(
            f"out is {tuple(out.shape)} {out.dtype} on {out.device} but must be {shape} "
            f"{dtype} on {device}; pass out=None to have it allocated"
        )
    _unit_inner_stride("out", out)


def batch_tables(block_tables: object, context_lens: object, batch: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    bt = index_tensor("block_tables", block_tables, 2, "[batch, max_blocks]")
    cl = index_tensor("context_lens", context_lens, 1, "[batch]")
    dim("block_tables", bt, 0, batch, "one row per sequence of the batch")
    dim("context_lens", cl, 0, batch, "one length per sequence of the batch")
    return bt, cl


def optional_int(name: str, value: object, minimum: int) -> None:
    """``value`` is None or an int ``>= minimum`` (a host-side launch parameter)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        fail(f"{name} must be an int >= {minimum} (or None), got {value!r}")


def num_tokens(value: int | None, default: int, limit: int, name: str) -> int:
    """``num_tokens`` of a gather/scatter: default and range check (host ints only)."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        fail(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= limit:
        fail(f"{name}={value} is outside [0, {limit}]: the blocks hold at most {limit} tokens")
    return value


# --------------------------------------------------------------------------- bounds scan
def scan_slots(slot_mapping: torch.Tensor, num_slots: int) -> None:
    if slot_mapping.numel() == 0:
        return
    lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
    if lo < -1 or hi >= num_slots:
        fail(
            f"slot_mapping holds values in [{lo}, {hi}] but slots must be -1 (skip) or in "
            f"[0, {num_slots}) (num_blocks * block_size of the pool)"
        )


def scan_block_ids(name: str, ids: torch.Tensor, num_blocks: int) -> None:
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_blocks:
        fail(f"{name} holds block ids in [{lo}, {hi}] but the pool has blocks [0, {num_blocks})")


def scan_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                num_blocks: int) -> None:
    """Lengths fit the tables, and every table entry a kernel will read is a real block."""
    if context_lens.numel() == 0:
        return
    capacity = block_tables.shape[1] * block_size
    lens = context_lens.long()
    if int(lens.min()) < 0 or int(lens.max()) > capacity:
        fail(
            f"context_lens hold values in [{int(lens.min())}, {int(lens.max())}] but must be in "
            f"[0, {capacity}] (block_tables width {block_tables.shape[1]} x block_size {block_size})"
        )
    cols = torch.arange(block_tables.shape[1], device=lens.device)[None, :]
    used = cols * block_size < lens[:, None]
    scan_block_ids("block_tables (entries within context_lens)", block_tables[used], num_blocks)


def scan_cu_seqlens(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, total: int) -> None:
    cu = cu_seqlens_q.long()
    if int(cu[0]) != 0 or int(cu[-1]) != total:
        fail(f"cu_seqlens_q must start at 0 and end at the {total} packed query tokens, "
              f"got {int(cu[0])} .. {int(cu[-1])}")
    q_lens = cu[1:] - cu[:-1]
    if bool((q_lens < 0).any()):
        fail("cu_seqlens_q must be non-decreasing (it is the prefix sum of query lengths)")
    if bool((q_lens > context_lens.long()).any()):
        fail("a sequence has more new query tokens than its context length; context_lens "
              "counts the cached prefix plus the new tokens, which must already be in the pool")
