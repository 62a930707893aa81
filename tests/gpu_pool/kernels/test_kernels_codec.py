"""Decoding compressed chunks straight into pool blocks (Triton on CUDA, the interpreter on
CPU): bit for bit the torch reference's decode, and foreign bytes reported, not written as
KV silently."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import KernelInputError
from kvtier.gpu_pool.kernels.api import DECODE_ERRORS, scatter_decoded
from kvtier.kv_codecs import Codec, encode, layer_exponents_at, layout, reference_decode
from tests.gpu_pool.kernel_cases import triton_devices

DEVICES = triton_devices()
LOSSY = [Codec.FP8, Codec.INT8, Codec.INT4]


def _kv(layers, tokens, heads, dim, dtype, seed=0):
    """Random KV with the magnitudes a codec must keep exact: outlier channels, rows near
    the dtype's smallest and largest values, zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(layers, 2, tokens, heads, dim, generator=gen)
    x[:, 0, :, :, 1] *= 40  # an outlier key channel
    tiny = {torch.float32: 2.0**-120, torch.bfloat16: 2.0**-120, torch.float16: 2.0**-12}
    huge = {torch.float32: 2.0**100, torch.bfloat16: 2.0**100, torch.float16: 2.0**10}
    x[:, :, 1] *= tiny[dtype]
    x[:, :, 2] *= huge[dtype]
    x[:, 1, 3] = 0
    return x.to(dtype)


def _payload(kv, codec):
    """Each layer encoded apart, one after another (a chunk's payload)."""
    return torch.cat([encode(kv[i : i + 1], codec) for i in range(kv.shape[0])])


def _decoded(payload, codec, shape, dtype):
    layers = shape[0]
    one = layout(codec, (1, *shape[1:]), dtype).nbytes
    return torch.cat([reference_decode(payload[i * one : (i + 1) * one], codec, (1, *shape[1:]),
                                       dtype) for i in range(layers)])


def _pool(layers, blocks, bs, heads, dim, dtype, device):
    return torch.full((layers, blocks, 2, bs, heads, dim), 7.0, dtype=dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize(("dtype", "tokens", "heads", "dim", "bs", "offset"), [
    (torch.bfloat16, 64, 2, 64, 16, 0),
    (torch.float16, 40, 1, 16, 8, 8),  # a tail chunk (no 32-token groups), a tiny head
    (torch.float32, 32, 3, 32, 32, 0),
])
def test_triton_decode_scatter_matches_reference(device, codec, dtype, tokens, heads, dim, bs,
                                                 offset):
    layers = 2
    kv = _kv(layers, tokens, heads, dim, dtype)
    payload = _payload(kv, codec)
    want = _decoded(payload, codec, tuple(kv.shape), dtype)
    n_blocks = -(-(tokens - offset) // bs)
    ids = torch.randperm(n_blocks + 3)[:n_blocks]
    got = _pool(layers, n_blocks + 3, bs, heads, dim, dtype, device)
    status = scatter_decoded(payload.to(device), codec, got, ids.to(device), tokens=tokens,
                             offset=offset, backend="triton")
    ref = _pool(layers, n_blocks + 3, bs, heads, dim, dtype, device)
    scatter_decoded(payload.to(device), codec, ref, ids.to(device), tokens=tokens, offset=offset,
                    backend="torch")
    assert int(status.item()) == 0
    assert torch.equal(got, ref)
    for j in range(tokens - offset):
        block, slot = int(ids[j // bs]), j % bs
        assert torch.equal(got[:, block, :, slot].cpu(), want[:, :, offset + j])
    untouched = torch.ones(n_blocks + 3, dtype=torch.bool)
    untouched[ids] = False
    assert bool((got[:, untouched.to(device)] == 7).all())


def _corrupt(payload, codec, shape, dtype, what):
    """``payload`` with bytes only a foreign writer puts there (checksums would pass: the
    writer computed them over these bytes)."""
    bad = payload.clone()
    lay = layout(codec, (1, *shape[1:]), dtype)
    k_at, _ = layer_exponents_at(codec, shape[1:], dtype)
    if what == "exponent":
        bad[lay.nbytes + k_at] = 0x80  # -128, in layer 1's first key exponent
    elif what == "value":
        bad[lay.nbytes + 5] = 0x7F if codec is Codec.FP8 else 0x80 if codec is Codec.INT4 else 0
    else:  # a scale no fp16 holds
        bad[lay.nbytes + k_at] = 100
    return bad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("codec", "what"), [
    (Codec.FP8, "exponent"), (Codec.FP8, "value"), (Codec.INT8, "range"),
    (Codec.INT4, "value"), (Codec.INT4, "exponent"), (Codec.FP8, "range"),
])
def test_foreign_bytes_are_reported(device, codec, what):
    dtype, tokens, heads, dim, bs = torch.float16, 32, 2, 32, 16
    kv = _kv(2, tokens, heads, dim, dtype)
    payload = _corrupt(_payload(kv, codec), codec, tuple(kv.shape), dtype, what)
    ids = torch.arange(2)
    for backend in ("triton", "torch"):
        pool = _pool(2, 2, bs, heads, dim, dtype, device)
        status = scatter_decoded(payload.to(device), codec, pool, ids.to(device), tokens=tokens,
                                 backend=backend)
        code = int(status.item())
        assert code in DECODE_ERRORS, (backend, code)
        if backend == "triton":
            expect = {"exponent": 2, "value": 3, "range": 4}[what]
            assert code == expect


@pytest.mark.parametrize("device", DEVICES)
def test_one_status_serves_several_chunks(device):
    """A clean chunk after a bad one leaves the shared status as the bad one set it."""
    dtype, tokens, heads, dim, bs = torch.bfloat16, 32, 1, 32, 32
    kv = _kv(1, tokens, heads, dim, dtype)
    good = _payload(kv, Codec.INT8)
    bad = good.clone()
    bad[layout(Codec.INT8, tuple(kv.shape), dtype).values_nbytes] = 0x80
    status = torch.zeros(1, dtype=torch.int32, device=device)
    pool = _pool(1, 2, bs, heads, dim, dtype, device)
    scatter_decoded(bad.to(device), "int8", pool, [0], tokens=tokens, status=status,
                    backend="triton")
    scatter_decoded(good.to(device), "int8", pool, [1], tokens=tokens, status=status,
                    backend="triton")
    assert int(status.item()) == 2


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(codec="none"), "not compressed"),
    (dict(codec="zstd"), "not one of"),
    (dict(tokens=31), "take"),
    (dict(offset=48), "outside"),
    (dict(ids=[0, 1]), "need 1 block"),
])
def test_bad_calls_are_refused_before_launch(kwargs, match):
    dtype, heads, dim, bs = torch.bfloat16, 1, 32, 32
    kv = _kv(1, 32, heads, dim, dtype)
    payload = _payload(kv, Codec.INT8)
    pool = _pool(1, 2, bs, heads, dim, dtype, "cpu")
    with pytest.raises(KernelInputError, match=match):
        scatter_decoded(payload, kwargs.get("codec", "int8"), pool, kwargs.get("ids", [0]),
                        tokens=kwargs.get("tokens", 32), offset=kwargs.get("offset", 0))
