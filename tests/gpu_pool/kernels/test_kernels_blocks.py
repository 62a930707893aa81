"""KV write (reshape-and-cache) and block gather/scatter: exact copies, so exact equality."""

from __future__ import annotations

import pytest
import torch

from kvtier.gpu_pool.kernels import gather_blocks, scatter_blocks, write_kv
from tests.gpu_pool.kernel_cases import triton_devices

DEVICES = triton_devices()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _pool(layers, num_blocks, block_size, kv_heads, head_dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (layers, num_blocks, 2, block_size, kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "block_size", "kv_heads", "head_dim"),
                         [(torch.float32, 8, 2, 64), (torch.float16, 16, 1, 128),
                          (torch.bfloat16, 32, 3, 64)])
def test_write_kv_matches_reference(device, dtype, block_size, kv_heads, head_dim):
    pool = _pool(1, 12, block_size, kv_heads, head_dim, dtype, device)[0]
    n = 2 * block_size + 3
    slots = torch.randperm(12 * block_size)[:n].to(device)
    slots[[1, n - 1]] = -1  # padding tokens are skipped
    # Non-contiguous K/V, as sliced out of a fused QKV projection.
    qkv = torch.randn(n, 3, kv_heads, head_dim, device=device).to(dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    expected, got = pool.clone(), pool.clone()
    write_kv(key, value, expected, slots, backend="torch")
    write_kv(key, value, got, slots, backend="triton")
    assert torch.equal(got, expected)
    keep = slots >= 0
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    assert torch.equal(got[blocks, 0, offsets], key[keep])
    assert torch.equal(got[blocks, 1, offsets], value[keep])
    untouched = torch.ones(12, block_size, dtype=torch.bool, device=device)
    untouched[blocks, offsets] = False
    assert torch.equal(got[:, 0][untouched], pool[:, 0][untouched])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(("dtype", "block_size", "num_tokens"),
                         [(torch.float32, 8, None), (torch.float16, 16, 37),
                          (torch.bfloat16, 32, 65), (torch.float16, 8, 1)])
def test_gather_blocks_chunk_layout(device, backend, dtype, block_size, num_tokens):
    layers, kv_heads, head_dim = 3, 2, 64
    pool = _pool(layers, 20, block_size, kv_heads, head_dim, dtype, device)
    ids = [13, 2, 7] if num_tokens != 1 else [5]
    out = gather_blocks(pool, ids, num_tokens=num_tokens, backend=backend)
    tokens = len(ids) * block_size if num_tokens is None else num_tokens
    assert out.shape == (layers, 2, tokens, kv_heads, head_dim)
    for t in range(tokens):
        assert torch.equal(out[:, :, t], pool[:, ids[t // block_size], :, t % block_size])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "block_size", "num_tokens"),
                         [(torch.bfloat16, 8, None), (torch.float32, 16, 40),
                          (torch.float16, 32, 33)])
def test_scatter_matches_reference_and_keeps_tail(device, dtype, block_size, num_tokens):
    layers, kv_heads, head_dim = 2, 1, 128
    pool = _pool(layers, 10, block_size, kv_heads, head_dim, dtype, device, seed=1)
    ids = torch.tensor([9, 0, 4], device=device, dtype=torch.int32)
    tokens = 3 * block_size if num_tokens is None else num_tokens
    chunk = torch.randn(layers, 2, tokens, kv_heads, head_dim, device=device).to(dtype)
    expected, got = pool.clone(), pool.clone()
    scatter_blocks(chunk, expected, ids, backend="torch")
    scatter_blocks(chunk, got, ids, backend="triton")
    assert torch.equal(got, expected)
    # Round trip: what was scattered gathers back; the tail block's unused slots are intact.
    assert torch.equal(gather_blocks(got, ids, num_tokens=tokens, backend="triton"), chunk)
    tail = tokens - 2 * block_size
    assert torch.equal(got[:, 4, :, tail:], pool[:, 4, :, tail:])
    others = [b for b in range(10) if b not in (9, 0, 4)]
    assert torch.equal(got[:, others], pool[:, others])


@pytest.mark.parametrize("device", DEVICES)
def test_gather_into_larger_out_and_scatter_prefix_of_buffer(device):
    """A fixed-size chunk slot (e.g. 256 tokens) may hold a shorter tail chunk."""
    pool = _pool(2, 8, 16, 2, 64, torch.float16, device, seed=2)
    slot = torch.zeros(2, 2, 64, 2, 64, dtype=torch.float16, device=device)
    got = gather_blocks(pool, [3, 6], num_tokens=20, out=slot, backend="triton")
    assert got.data_ptr() == slot.data_ptr()
    assert torch.equal(slot[:, :, :20], gather_blocks(pool, [3, 6], num_tokens=20,
                                                      backend="torch"))
    assert not slot[:, :, 20:].any()
    fresh = torch.zeros_like(pool)
    scatter_blocks(slot, fresh, [1, 2], num_tokens=20, backend="triton")
    assert torch.equal(gather_blocks(fresh, [1, 2], num_tokens=20), slot[:, :, :20])
