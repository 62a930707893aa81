"""The Triton kernels on the device at a real model's head layout (Llama-3-8B: 32 query heads,
8 KV heads, head_dim 128; a few small heads on the CPU dry run), against the torch reference
on the same device: bf16 and fp16, GQA, block sizes 16 and 32, split-KV on long contexts,
prefill over a cached prefix, the KV write and block gather/scatter (exact copies).

The broader per-axis matrix (``tests/gpu_pool/kernels``) runs on CUDA too: those tests are
parametrized with ``device="cuda"`` whenever a GPU is present and carry the same marker.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.gpu_pool.kernels import (
    gather_blocks,
    paged_decode_attention,
    paged_prefill_attention,
    scatter_blocks,
    write_kv,
)
from tests.cuda.conftest import sync
from tests.gpu_pool.kernel_cases import make_paged_kv

# Against the torch reference on the same inputs (both accumulate in fp32; the kernel rounds
# softmax weights to the KV dtype before the PV product), as in tests/gpu_pool/kernels.
TOL = {torch.float16: {"atol": 2e-3, "rtol": 2e-3},
       torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2}}
HALF = [torch.bfloat16, torch.float16]


def _poisoned(shape, dtype, device):
    """An output buffer full of NaN: an element the kernel does not write fails the check."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_matches_reference(device, sizes, dtype, block_size):
    s = sizes
    lens = [1, block_size, block_size + 1, 3 * block_size + 5, s.long_context // 2 + 7]
    case = make_paged_kv(lens, s.kv_heads, s.head_dim, block_size, dtype, device,
                         seed=block_size)
    q = torch.randn(len(lens), s.num_heads, s.head_dim, device=device).to(dtype)
    ref = paged_decode_attention(q, case.kv_layer, case.block_tables, case.context_lens,
                                 backend="torch")
    assert not ref.isnan().any()
    for kw in ({"split_kv": False}, {"num_splits": 4}, {}):
        out = _poisoned(ref.shape, dtype, device)
        paged_decode_attention(q, case.kv_layer, case.block_tables, case.context_lens,
                               out=out, backend="triton", **kw)
        sync(device)
        torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_split_kv_on_a_long_context(device, sizes, dtype):
    """Few sequences over a long context take the flash-decoding path (splits + reduction)."""
    s = sizes
    case = make_paged_kv([s.long_context, s.long_context // 3], s.kv_heads, s.head_dim, 16,
                         dtype, device, seed=5)
    q = torch.randn(2, s.num_heads, s.head_dim, device=device).to(dtype)
    ref = paged_decode_attention(q, case.kv_layer, case.block_tables, case.context_lens,
                                 backend="torch")
    out = paged_decode_attention(q, case.kv_layer, case.block_tables, case.context_lens,
                                 split_kv=True, backend="triton")
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_over_a_cached_prefix_matches_reference(device, sizes, dtype, block_size):
    s = sizes
    # (context, new tokens): a whole prompt, a chunk behind a prefix, a block plus one.
    ctx_q = [(block_size + 1, block_size + 1), (s.tokens, s.tokens // 3),
             (2 * block_size + 1, 3)]
    case = make_paged_kv([c for c, _ in ctx_q], s.kv_heads, s.head_dim, block_size, dtype,
                         device, seed=block_size + 1)
    q_lens = [n for _, n in ctx_q]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    q = torch.randn(int(cu[-1]), s.num_heads, s.head_dim, device=device).to(dtype)
    ref = paged_prefill_attention(q, case.kv_layer, case.block_tables, case.context_lens, cu,
                                  backend="torch")
    assert not ref.isnan().any()
    out = _poisoned(ref.shape, dtype, device)
    paged_prefill_attention(q, case.kv_layer, case.block_tables, case.context_lens, cu,
                            out=out, backend="triton")
    sync(device)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_gather_scatter_are_exact(device, sizes, dtype, block_size):
    s = sizes
    layers, num_blocks = 4, 3 * s.tokens // block_size + 8
    gen = torch.Generator().manual_seed(block_size)
    pool = torch.randn(layers, num_blocks, 2, block_size, s.kv_heads, s.head_dim,
                       generator=gen).to(dtype).to(device)
    # KV write: one layer, shuffled slots, some skipped (-1).
    n = s.tokens
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n].to(device)
    slots[::7] = -1
    k = torch.randn(n, s.kv_heads, s.head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(n, s.kv_heads, s.head_dim, generator=gen).to(dtype).to(device)
    want, got = pool[0].clone(), pool[0].clone()
    write_kv(k, v, want, slots, backend="torch")
    write_kv(k, v, got, slots, backend="triton")
    sync(device)
    assert torch.equal(got, want)
    # Gather a chunk of shuffled blocks with a partial tail, scatter it elsewhere.
    ids = torch.randperm(num_blocks, generator=gen)[: -(-n // block_size)].to(device)
    chunk = gather_blocks(pool, ids, num_tokens=n, backend="triton")
    assert torch.equal(chunk, gather_blocks(pool, ids, num_tokens=n, backend="torch"))
    other = torch.randperm(num_blocks, generator=gen)[: ids.numel()].to(device)
    want, got = pool.clone(), pool.clone()
    scatter_blocks(chunk, want, other, backend="torch")
    scatter_blocks(chunk, got, other, backend="triton")
    sync(device)
    assert torch.equal(got, want)
    assert torch.equal(gather_blocks(got, other, num_tokens=n), chunk)


def test_the_device_hash_equals_the_host_hash(device):
    """The block path's device check: XXH3-64 of many ranges in one call on the device,
    bit-exact with the xxhash package, short, mid-size and long ranges (1 MiB layers of a
    window too), aligned and not, in one buffer."""
    import numpy as np
    import xxhash

    from kvtier.gpu_pool.kernels.triton_xxh3 import check_ranges, xxh3_ranges

    rng = np.random.default_rng(7)
    small = device.type == "cpu"
    lengths = np.concatenate([np.arange(0, 300), rng.integers(241, 1 << 16, 40 if small else 400),
                              [1 << 20, (1 << 20) + 3] if not small else [5000]]).astype(np.int64)
    gaps = rng.integers(0, 9, len(lengths)).astype(np.int64)
    starts = np.cumsum(np.concatenate([[0], (lengths + gaps)[:-1]])).astype(np.int64)
    total = int(starts[-1] + lengths[-1])
    host = torch.from_numpy(rng.integers(0, 256, total, dtype=np.uint8))
    buf = host.to(device)
    st, ln = torch.from_numpy(starts).to(device), torch.from_numpy(lengths).to(device)
    got = xxh3_ranges(buf, st, ln, host_ranges=(starts, lengths)).cpu().numpy().view(np.uint64)
    mem = memoryview(host.numpy())
    want = np.array([xxhash.xxh3_64_intdigest(mem[s : s + n]) for s, n in zip(starts, lengths, strict=True)],
                    dtype=np.uint64)
    assert (got == want).all()
    expected = torch.from_numpy(want.view(np.int64)).to(device)
    buf[int(starts[-1])] ^= 1  # the last range's first byte
    bad = check_ranges(buf, st, ln, expected, host_ranges=(starts, lengths)).cpu()
    assert bad.tolist() == [0] * (len(lengths) - 1) + [1]
