"""Paged prefill/extend attention: new query chunks attend causally to their cached prefix
and to themselves, all K/V read through the block table."""

from __future__ import annotations

import pytest
import torch

from kvtier.gpu_pool.kernels import paged_prefill_attention, write_kv
from tests.gpu_pool.kernel_cases import make_paged_kv, sdpa_reference, triton_devices

# Max abs / rel error against the fp32 oracle (softmax weights and output rounded to dtype).
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
DEVICES = triton_devices()


def _queries(case, q_lens, num_heads, device, dtype):
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    q = torch.randn(int(cu[-1]), num_heads, case.kv_layer.shape[-1], device=device).to(dtype)
    return q, cu


def _run(case, q, cu, **kw):
    return paged_prefill_attention(q, case.kv_layer, case.block_tables, case.context_lens, cu,
                                   **kw)



def _case_id(dtype, block_size, group, head_dim, kv_heads) -> str:
    return f"{str(dtype).removeprefix('torch.')}-bs{block_size}-g{group}-d{head_dim}-kvh{kv_heads}"


# (dtype, block_size, group, head_dim, kv_heads)
CASES = [
    (torch.float32, 16, 4, 64, 1),
    (torch.float16, 8, 1, 128, 2),
    (torch.bfloat16, 32, 8, 64, 1),
    (torch.float16, 16, 8, 128, 1),
    (torch.bfloat16, 8, 4, 128, 1),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "block_size", "group", "head_dim", "kv_heads"), CASES,
                         ids=[_case_id(*c) for c in CASES])
def test_prefill_matches_reference(device, dtype, block_size, group, head_dim, kv_heads):
    # (context length, new query tokens): whole prompt of 1 token, a chunk that fills exactly
    # a block, a block plus one behind a prefix, a chunk longer than one 64-row query tile.
    ctx_q = [(1, 1), (block_size, block_size), (2 * block_size + 1, block_size + 1),
             (80, 70), (45, 3)]
    case = make_paged_kv([c for c, _ in ctx_q], kv_heads, head_dim, block_size, dtype, device,
                         seed=block_size * group)
    q, cu = _queries(case, [n for _, n in ctx_q], kv_heads * group, device, dtype)
    ref = _run(case, q, cu, backend="torch")
    assert not ref.isnan().any()
    out = _run(case, q, cu, backend="triton")
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(("dtype", "group"), [(torch.bfloat16, 4), (torch.float32, 1)])
def test_prefill_equals_sdpa_on_contiguous_kv(device, backend, dtype, group):
    ctx_q = [(30, 30), (50, 7), (17, 1)]
    case = make_paged_kv([c for c, _ in ctx_q], 2, 64, 16, dtype, device, seed=5)
    q, cu = _queries(case, [n for _, n in ctx_q], 2 * group, device, dtype)
    out = _run(case, q, cu, backend=backend, max_seqlen_q=30)
    for b, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        torch.testing.assert_close(out[rows].float(), sdpa_reference(q[rows], k, v),
                                   **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_prefill_through_write_kv(device):
    """The engine's order: write a chunk's K/V into the pool, then attend; chunk by chunk the
    result equals one causal pass over the whole prompt."""
    dtype, block_size, length, chunk = torch.float16, 8, 37, 16
    full = make_paged_kv([length], 2, 64, block_size, dtype, device, seed=11)
    table = full.block_tables
    pool = torch.zeros_like(full.kv_layer)
    q_all = torch.randn(length, 4, 64, device=device).to(dtype)
    k, v = full.keys[0], full.values[0]
    outs = []
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        pos = torch.arange(start, end, device=device)
        slots = table[0, pos // block_size].long() * block_size + pos % block_size
        write_kv(k[start:end], v[start:end], pool, slots, backend="triton")
        cu = torch.tensor([0, end - start], dtype=torch.int32, device=device)
        lens = torch.tensor([end], dtype=torch.int32, device=device)
        outs.append(paged_prefill_attention(q_all[start:end], pool, table, lens, cu,
                                            backend="triton"))
    torch.testing.assert_close(torch.cat(outs).float(), sdpa_reference(q_all, k, v),
                               **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_empty_chunk_and_out(device):
    """A sequence with no new tokens in the batch is skipped; ``out`` is written in place."""
    case = make_paged_kv([10, 20], 1, 64, 16, torch.float32, device, seed=2)
    q, cu = _queries(case, [0, 4], 2, device, torch.float32)
    for backend in ("triton", "torch"):
        out = torch.empty_like(q)
        assert _run(case, q, cu, backend=backend, out=out).data_ptr() == out.data_ptr()
        torch.testing.assert_close(out, _run(case, q, cu, backend="torch"), **TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_long_chunks_span_query_tiles(device):
    """Chunks of 130 and 200 new tokens span several query tiles, behind prefixes long
    enough that whole key tiles take the loop without the causal mask."""
    dtype = torch.bfloat16
    ctx_q = [(300, 200), (140, 130), (9, 2)]
    case = make_paged_kv([c for c, _ in ctx_q], 1, 64, 16, dtype, device, seed=9)
    q, cu = _queries(case, [n for _, n in ctx_q], 2, device, dtype)
    out = _run(case, q, cu, backend="triton")
    torch.testing.assert_close(out.float(), _run(case, q, cu, backend="torch").float(),
                               **TOL[dtype])
