"""Paged decode attention: Triton (interpreter on CPU, compiled on CUDA) against the torch
reference and against SDPA over the same K/V laid out contiguously."""

from __future__ import annotations

import pytest
import torch

from kvtier.gpu_pool.kernels import choose_num_splits, paged_decode_attention
from tests.gpu_pool.kernel_cases import make_paged_kv, sdpa_reference, triton_devices

# Max abs / rel error against the fp32 oracle: the kernel rounds softmax weights to the KV
# dtype before the PV matmul and rounds its output, so bf16 (8-bit mantissa) is loosest.
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
DEVICES = triton_devices()


def _lens(block_size: int) -> list[int]:
    """Ragged: one token, exactly a block, a block plus one, several blocks."""
    return [1, block_size, block_size + 1, 3 * block_size + 5]


def _run(case, q, **kw):
    return paged_decode_attention(q, case.kv_layer, case.block_tables, case.context_lens, **kw)



def _case_id(dtype, block_size, group, head_dim, kv_heads) -> str:
    return f"{str(dtype).removeprefix('torch.')}-bs{block_size}-g{group}-d{head_dim}-kvh{kv_heads}"


# (dtype, block_size, group = num_heads / kv_heads, head_dim, kv_heads): every value of every
# axis at least once, not the cartesian product (the interpreter is slow).
CASES = [
    (torch.float32, 16, 1, 64, 2),
    (torch.float16, 8, 4, 128, 1),
    (torch.bfloat16, 32, 8, 64, 1),
    (torch.float16, 16, 8, 128, 2),
    (torch.bfloat16, 8, 1, 128, 1),
    (torch.float32, 32, 4, 64, 1),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "block_size", "group", "head_dim", "kv_heads"), CASES,
                         ids=[_case_id(*c) for c in CASES])
def test_decode_matches_reference(device, dtype, block_size, group, head_dim, kv_heads):
    case = make_paged_kv(_lens(block_size), kv_heads, head_dim, block_size, dtype, device,
                         seed=block_size + group)
    q = torch.randn(len(case.keys), kv_heads * group, head_dim, device=device).to(dtype)
    ref = _run(case, q, backend="torch")
    assert not ref.isnan().any()
    single = _run(case, q, backend="triton", split_kv=False)
    split = _run(case, q, backend="triton", num_splits=3)
    torch.testing.assert_close(single.float(), ref.float(), **TOL[dtype])
    torch.testing.assert_close(split.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "num_splits"), [(torch.bfloat16, None), (torch.float32, 5)])
def test_decode_long_context_split_kv(device, dtype, num_splits):
    """Long contexts with few sequences take the flash-decoding path (splits + reduction)."""
    lens = [2000, 1100]
    case = make_paged_kv(lens, 1, 64, 16, dtype, device, seed=7)
    q = torch.randn(2, 4, 64, device=device).to(dtype)
    ref = _run(case, q, backend="torch")
    out = _run(case, q, backend="triton", split_kv=True, num_splits=num_splits)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize(("dtype", "group"), [(torch.float16, 4), (torch.float32, 1)])
def test_decode_equals_sdpa_on_contiguous_kv(device, backend, dtype, group):
    case = make_paged_kv([5, 16, 40], 2, 64, 16, dtype, device, seed=3)
    q = torch.randn(3, 2 * group, 64, device=device).to(dtype)
    out = _run(case, q, backend=backend, scale=0.1)
    for b, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        expected = sdpa_reference(q[b : b + 1], k, v, scale=0.1)[0]
        torch.testing.assert_close(out[b].float(), expected, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_decode_out_argument_and_empty_context(device):
    """``out`` is filled in place; a sequence with no context attends to nothing (zeros)."""
    case = make_paged_kv([0, 9], 1, 64, 8, torch.float16, device, seed=1)
    q = torch.randn(2, 2, 64, device=device).half()
    for backend in ("triton", "torch"):
        out = torch.full_like(q, 7.0)
        got = _run(case, q, backend=backend, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        torch.testing.assert_close(out[1].float(), _run(case, q, backend="torch")[1].float(),
                                   **TOL[torch.float16])


def test_decode_auto_backend_on_cpu_is_reference():
    case = make_paged_kv([3, 20], 1, 64, 8, torch.float32, "cpu")
    q = torch.randn(2, 1, 64)
    assert torch.equal(_run(case, q), _run(case, q, backend="torch"))


def test_split_heuristic():
    # Few sequences, long context: split to fill the GPU.
    assert choose_num_splits(batch=1, kv_heads=8, max_context_len=16384, num_sms=132) > 1
    # Short context never splits; enough programs already never splits.
    assert choose_num_splits(batch=1, kv_heads=8, max_context_len=512, num_sms=132) == 1
    assert choose_num_splits(batch=128, kv_heads=8, max_context_len=16384, num_sms=132) == 1
    # Splits stay long enough to be worth their reduction.
    assert choose_num_splits(batch=1, kv_heads=1, max_context_len=1024, num_sms=132) == 4
