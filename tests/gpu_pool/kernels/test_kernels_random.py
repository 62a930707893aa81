"""Randomised shapes (hypothesis, few examples: the interpreter is slow) and the kernels
driven through the real paged pool, the way the engine calls them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.gpu_pool import KVStorage, PagedKVPool
from kvtier.gpu_pool.kernels import (
    gather_blocks,
    paged_decode_attention,
    paged_prefill_attention,
    scatter_blocks,
    write_kv,
)
from tests.gpu_pool.kernel_cases import make_paged_kv, sdpa_reference, triton_devices

TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
DEVICES = triton_devices()
SETTINGS = settings(max_examples=15, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

shapes = st.fixed_dictionaries({
    "dtype": st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    "block_size": st.sampled_from([8, 16, 32]),
    "group": st.sampled_from([1, 2, 4, 8]),
    "kv_heads": st.integers(1, 2),
    "head_dim": st.sampled_from([32, 64, 96, 128]),  # 96: padded to a 128-wide tile
    "seed": st.integers(0, 2**16),
})


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(shape=shapes, lens=st.lists(st.integers(0, 150), min_size=1, max_size=4),
       num_splits=st.sampled_from([1, 2, 7]))
def test_decode_random(device, shape, lens, num_splits):
    case = make_paged_kv(lens, shape["kv_heads"], shape["head_dim"], shape["block_size"],
                         shape["dtype"], device, seed=shape["seed"])
    q = torch.randn(len(lens), shape["kv_heads"] * shape["group"], shape["head_dim"],
                    device=device).to(shape["dtype"])
    args = (q, case.kv_layer, case.block_tables, case.context_lens)
    ref = paged_decode_attention(*args, backend="torch")
    out = paged_decode_attention(*args, backend="triton", num_splits=num_splits)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[shape["dtype"]])


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(shape=shapes, data=st.data())
def test_prefill_random(device, shape, data):
    ctx = data.draw(st.lists(st.integers(1, 100), min_size=1, max_size=3), label="ctx")
    q_lens = [data.draw(st.integers(0, n), label="q_len") for n in ctx]
    case = make_paged_kv(ctx, shape["kv_heads"], shape["head_dim"], shape["block_size"],
                         shape["dtype"], device, seed=shape["seed"])
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    q = torch.randn(sum(q_lens), shape["kv_heads"] * shape["group"], shape["head_dim"],
                    device=device).to(shape["dtype"])
    args = (q, case.kv_layer, case.block_tables, case.context_lens, cu)
    ref = paged_prefill_attention(*args, backend="torch")
    out = paged_prefill_attention(*args, backend="triton")
    torch.testing.assert_close(out.float(), ref.float(), **TOL[shape["dtype"]])


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(block_size=st.sampled_from([1, 8, 16, 32]), n_blocks=st.integers(1, 5),
       cut=st.integers(0, 31), layers=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_gather_scatter_random(device, block_size, n_blocks, cut, layers, seed):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(layers, 8, 2, block_size, 2, 32, generator=gen).to(device)
    ids = torch.randperm(8, generator=gen)[:n_blocks].to(device)
    tokens = max(0, n_blocks * block_size - cut % block_size)
    got = gather_blocks(pool, ids, num_tokens=tokens, backend="triton")
    assert torch.equal(got, gather_blocks(pool, ids, num_tokens=tokens, backend="torch"))
    a, b = torch.zeros_like(pool), torch.zeros_like(pool)
    scatter_blocks(got, a, ids, backend="triton")
    scatter_blocks(got, b, ids, backend="torch")
    assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_kernels_through_the_paged_pool(device):
    """Prefill two prompts with a shared prefix (prefix cache), decode a step, compare to SDPA
    over the same K/V held contiguously; then offload one sequence's blocks as a chunk and
    restore them into fresh blocks."""
    torch.manual_seed(0)
    dtype, bs, hkv, d, hq = torch.float16, 16, 2, 64, 8
    pool = PagedKVPool(KVStorage(2, 32, bs, hkv, d, dtype, torch.device(device)))
    layer = pool.storage.layer(1)
    prompts = {"a": list(range(40)), "b": list(range(32)) + [99] * 5}
    kv_of: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    k_shared = torch.randn(32, hkv, d, device=device).to(dtype)
    v_shared = torch.randn(32, hkv, d, device=device).to(dtype)
    for sid, toks in prompts.items():
        res = pool.add_sequence(sid, toks)
        cached = res.num_cached_tokens  # "b" finds the shared 32-token prefix cached
        k = torch.cat([k_shared, torch.randn(len(toks) - 32, hkv, d, device=device).to(dtype)])
        v = torch.cat([v_shared, torch.randn(len(toks) - 32, hkv, d, device=device).to(dtype)])
        kv_of[sid] = (k, v)
        slots = pool.slot_mapping(sid, cached, len(toks))
        write_kv(k[cached:], v[cached:], layer, slots, backend="triton", debug=True)
        pool.mark_computed(sid)
    ids = list(prompts)
    tables, lens = pool.block_tables(ids), pool.context_lens(ids)
    q = torch.randn(len(ids), hq, d, device=device).to(dtype)
    out = paged_decode_attention(q, layer, tables, lens, backend="triton", debug=True)
    for i, sid in enumerate(ids):
        k, v = kv_of[sid]
        torch.testing.assert_close(out[i].float(), sdpa_reference(q[i : i + 1], k, v)[0],
                                   **TOL[dtype])
    # Offload "a" as one chunk (all layers), restore it into other blocks, attend again.
    seq = pool.sequence("a")
    chunk = gather_blocks(pool.storage.kv, seq.block_ids, num_tokens=seq.num_tokens,
                          backend="triton", debug=True)
    assert chunk.shape == (2, 2, 40, hkv, d)
    assert torch.equal(chunk[1, 0], kv_of["a"][0]) and torch.equal(chunk[1, 1], kv_of["a"][1])
    pool.free_sequence("a")
    pool.add_sequence("a2", [7] * 40)
    restored = pool.sequence("a2")
    scatter_blocks(chunk, pool.storage.kv, restored.block_ids, backend="triton", debug=True)
    again = paged_decode_attention(q[:1], layer, pool.block_tables(["a2"]),
                                   pool.context_lens(["a2"]), backend="triton")
    torch.testing.assert_close(again[0].float(), out[0].float(), atol=0, rtol=0)
