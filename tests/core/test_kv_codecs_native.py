"""The native host kernels of the KV codecs give the torch reference's bytes and values,
bit for bit: random KV of every dtype and shape kind, values at the edges (zeros,
subnormals, a dtype's largest, ties), and payloads no encoder writes refused alike."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import kv_codecs
from kvtier.errors import ChunkFormatError, InvalidArgumentError
from kvtier.kv_codecs import Codec, decode, encode, layout, reference_decode, reference_encode

LOSSY = [Codec.FP8, Codec.INT8, Codec.INT4]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

pytestmark = pytest.mark.skipif(not kv_codecs.NATIVE, reason="the native codec kernels were "
                                "not built (no C compiler at install): the reference serves")


def _same(kv: torch.Tensor, codec: Codec) -> None:
    ref = reference_encode(kv, codec)
    got = encode(kv, codec)
    assert torch.equal(got, ref), f"{codec} {kv.dtype}: {(got != ref).sum()} bytes differ"
    shape = tuple(kv.shape)
    back_ref = reference_decode(ref, codec, shape, kv.dtype)
    back = decode(ref, codec, shape, kv.dtype)
    assert torch.equal(back.view(torch.uint8), back_ref.view(torch.uint8))


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 2, 64, 2, 64), (2, 2, 40, 3, 24), (1, 2, 1, 1, 2)])
def test_random_kv(codec, dtype, shape):
    g = torch.Generator().manual_seed(hash((codec, str(dtype), shape)) % 1000)
    kv = torch.randn(shape, generator=g) * torch.logspace(-6, 3, shape[-1])
    kv[..., :1] *= 50  # an outlier channel
    _same(kv.to(dtype), codec)


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_values(codec, dtype):
    info = torch.finfo(dtype)
    specials = torch.tensor([0.0, -0.0, info.max, -info.max, info.tiny, info.tiny / 4,
                             info.smallest_normal * 3, 0.5, 1.5, 2.5, -2.5, 448.0, 464.0,
                             127.5, 7.5, 1e-30, 3.0, -info.max * 0.999]).to(dtype)
    kv = specials[torch.randint(len(specials), (2, 2, 32, 2, 32),
                                generator=torch.Generator().manual_seed(1))]
    _same(kv, codec)
    _same(torch.zeros(1, 2, 32, 1, 32, dtype=dtype), codec)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("log2_scale", [-104, -108, -110, -111, -112, -114, -118])
def test_fp8_groups_near_the_dtypes_smallest(dtype, log2_scale):
    """Groups whose scale exponent lies around the one where fp8's bf16 decode leaves its
    integer path (values near the dtype's smallest normals, and fp8 subnormals in them)."""
    g = torch.Generator().manual_seed(-log2_scale)
    kv = torch.randn((1, 2, 16, 2, 64), generator=g) * torch.logspace(0, -4, 64, base=2.0)
    _same((kv * 2.0 ** log2_scale).to(dtype), Codec.FP8)


@settings(max_examples=60, deadline=None)
@given(codec=st.sampled_from(LOSSY), dtype=st.sampled_from(DTYPES),
       tokens=st.integers(1, 70), heads=st.integers(1, 3), half_dim=st.integers(1, 40),
       scale=st.floats(1e-8, 1e4), seed=st.integers(0, 1 << 16))
def test_any_shape_and_scale(codec, dtype, tokens, heads, half_dim, scale, seed):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((2, 2, tokens, heads, 2 * half_dim), generator=g) * scale
    _same(kv.to(dtype), codec)


@pytest.mark.parametrize("codec", LOSSY)
def test_bad_payloads_are_refused_like_the_reference(codec):
    shape, dtype = (1, 2, 32, 1, 32), torch.float16
    payload = encode(torch.randn(shape).to(dtype), codec)
    lay = layout(codec, shape, dtype)
    bad_exp = payload.clone()
    bad_exp[lay.values_nbytes] = 0x80  # -128
    bad_val = payload.clone()
    bad_val[0] = 0x7F if codec is Codec.FP8 else (0x00 if codec is Codec.INT4 else 0x80)
    huge = payload.clone()
    huge[lay.values_nbytes:] = 127  # every scale 2**127: past fp16's range
    for p in (bad_exp, huge) + ((bad_val,) if codec is not Codec.INT8 else ()):
        with pytest.raises(ChunkFormatError):
            reference_decode(p, codec, shape, dtype)
        with pytest.raises(ChunkFormatError):
            decode(p, codec, shape, dtype)
    nan = torch.randn(shape).to(dtype)
    nan[0, 1, 5, 0, 7] = float("nan")
    with pytest.raises(InvalidArgumentError):
        encode(nan, codec)


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_encoded_apart_decode_in_one_call(codec, dtype):
    """A chunk's payload (each layer encoded alone, one after another) decoded in one
    native call equals each layer's reference decode."""
    from kvtier.kv_codecs import decode_layers_into

    kv = torch.randn((5, 2, 48, 2, 32), generator=torch.Generator().manual_seed(9)).to(dtype)
    payload = torch.cat([reference_encode(kv[i : i + 1], codec) for i in range(5)])
    out = torch.empty_like(kv)
    decode_layers_into(payload, codec, out)
    for i in range(5):
        want = reference_decode(reference_encode(kv[i : i + 1], codec), codec,
                                (1, 2, 48, 2, 32), dtype)
        assert torch.equal(out[i : i + 1].view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ChunkFormatError):
        decode_layers_into(payload[:-1], codec, out)
