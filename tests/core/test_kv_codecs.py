"""KV codecs at rest (issue 33, the torch reference): sizes, error bounds against the exact
KV, no compounding (a second round trip changes no value, whatever the data), and payloads
that are not what they claim refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ChunkFormatError, InvalidArgumentError
from kvtier.kv_codecs import Codec, decode, encode, layout

LOSSY = [Codec.FP8, Codec.INT8, Codec.INT4]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _kv(shape=(3, 2, 64, 2, 64), dtype=torch.float32, seed=0, outlier_channel=True):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(shape, generator=g)
    if outlier_channel:  # keys have a few large channels (what KIVI groups keys by)
        kv[:, 0, :, :, 3] *= 20
    return kv.to(dtype)


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_round_trip_has_the_shape_dtype_and_size_the_layout_says(codec, dtype):
    kv = _kv(dtype=dtype)
    payload = encode(kv, codec)
    lay = layout(codec, tuple(kv.shape), dtype)
    assert payload.dtype == torch.uint8 and payload.numel() == lay.nbytes
    back = decode(payload, codec, tuple(kv.shape), dtype)
    assert back.shape == kv.shape and back.dtype == dtype
    if codec is Codec.NONE:
        assert torch.equal(back, kv)


def test_bytes_per_value_at_a_real_heads_shape():
    shape = (32, 2, 256, 8, 128)  # Llama-3-8B, one 256-token chunk
    per = {c: layout(c, shape, torch.bfloat16).bytes_per_value() for c in Codec}
    assert per[Codec.NONE] == 2
    assert 1.0 < per[Codec.FP8] <= 1.04 and 1.0 < per[Codec.INT8] <= 1.01
    assert 0.5 < per[Codec.INT4] <= 0.54  # 3.7x smaller than bf16


@pytest.mark.parametrize("codec,bound", [(Codec.FP8, 2.0**-4), (Codec.INT8, 1 / 127),
                                         (Codec.INT4, 1 / 7)])
def test_the_error_is_bounded_by_each_groups_scale(codec, bound):
    """fp8 (3 mantissa bits): within 2^-4 of each value; int8 and int4: within half a step
    of the group's scale (at most twice the ideal one, a power of two)."""
    kv = _kv()
    back = decode(encode(kv, codec), codec, tuple(kv.shape), torch.float32)
    err = (back - kv).abs()
    if codec is Codec.FP8:
        big = kv.abs() > 1e-2
        assert (err[big] / kv.abs()[big]).max() <= bound + 1e-6
    elif codec is Codec.INT8:
        amax = kv.abs().amax(-1, keepdim=True)  # per token and head
        assert (err <= amax * bound + 1e-7).all()
    else:  # int4: keys per channel over 32 tokens, values per token over 32 channels
        k, v = kv[:, 0], kv[:, 1]
        kmax = k.reshape(3, 2, 32, 2, 64).abs().amax(2, keepdim=True).expand(3, 2, 32, 2, 64)
        vmax = v.reshape(3, 64, 2, 2, 32).abs().amax(-1, keepdim=True).expand(3, 64, 2, 2, 32)
        assert (err[:, 0] <= kmax.reshape(k.shape) * bound + 1e-7).all()
        assert (err[:, 1] <= vmax.reshape(v.shape) * bound + 1e-7).all()
    assert err.max() > 0  # lossy: a test that could not fail would prove nothing


def test_grouping_keys_per_channel_keeps_an_outlier_channel_from_drowning_the_rest():
    kv = _kv()
    back = decode(encode(kv, Codec.INT4), Codec.INT4, tuple(kv.shape), torch.float32)
    normal = [c for c in range(64) if c != 3]
    rel = (back[:, 0, ..., normal] - kv[:, 0, ..., normal]).norm() / kv[:, 0, ..., normal].norm()
    assert rel < 0.2


@settings(max_examples=60, deadline=None)
@given(codec=st.sampled_from(LOSSY), dtype=st.sampled_from(DTYPES),
       tokens=st.sampled_from([16, 32, 64, 48]), dim=st.sampled_from([16, 32, 64]),
       scale=st.sampled_from([0.0, 1e-30, 1e-6, 1e-3, 1.0, 300.0, 6e4]),
       seed=st.integers(0, 2**16))
def test_a_second_round_trip_changes_no_value(codec, dtype, tokens, dim, scale, seed):
    shape = (2, 2, tokens, 2, dim)
    kv = (_kv(shape, torch.float32, seed, outlier_channel=seed % 2 == 0) * scale)
    kv = kv.clamp(-6e4, 6e4).to(dtype)
    once = decode(encode(kv, codec), codec, shape, dtype)
    twice = decode(encode(once, codec), codec, shape, dtype)
    assert torch.equal(once, twice)


@pytest.mark.parametrize("codec", LOSSY)
def test_payloads_that_are_not_what_they_claim_are_refused(codec):
    kv = _kv()
    payload = encode(kv, codec)
    with pytest.raises(ChunkFormatError, match="expected"):
        decode(payload[:-1], codec, tuple(kv.shape), torch.float32)
    with pytest.raises(ChunkFormatError, match="expected"):
        decode(payload, codec, (3, 2, 32, 2, 64), torch.float32)
    bad = payload.clone()
    bad[-1] = 0x80  # exponent -128: no encoder writes it
    with pytest.raises(ChunkFormatError, match="exponent"):
        decode(bad, codec, tuple(kv.shape), torch.float32)


def test_bad_input_gets_a_clear_error():
    with pytest.raises(InvalidArgumentError, match="unknown KV codec"):
        Codec.parse("fp4")
    with pytest.raises(InvalidArgumentError, match="expected"):
        encode(torch.zeros(2, 3, 4, 2, 8), Codec.INT8)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        encode(torch.zeros(1, 2, 4, 2, 8, dtype=torch.int32), Codec.FP8)
    nan = _kv()
    nan[0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(InvalidArgumentError, match="NaN"):
        encode(nan, Codec.FP8)
    with pytest.raises(InvalidArgumentError, match="odd"):
        encode(torch.zeros(1, 2, 4, 2, 7), Codec.INT4)


@pytest.mark.parametrize("codec", LOSSY)
def test_values_near_the_dtypes_largest_never_decode_past_it(codec):
    """fp16 KV at 6e4: rounding to the nearest step would decode past 65,504 (an infinity);
    such values round toward zero instead (found by the no-compounding property)."""
    kv = torch.full((1, 2, 32, 1, 32), 6.0e4, dtype=torch.float16)
    kv[..., ::2] = -6.5e4
    back = decode(encode(kv, codec), codec, tuple(kv.shape), torch.float16)
    assert torch.isfinite(back).all()


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [64, 20])  # whole groups, and a tail chunk's one group
def test_every_layer_encoded_in_one_pass_is_each_layer_encoded_apart(codec, dtype, tokens):
    """What a GPU writer stores (all layers in one pass of torch ops) is byte for byte the
    chunk payload of each layer encoded apart."""
    from kvtier.kv_codecs import encode_each_layer, reference_encode

    kv = (torch.randn(3, 2, tokens, 2, 64, generator=torch.Generator().manual_seed(7)) * 3).to(dtype)
    kv[1, 0, 3] = 0  # an all-zero group
    apart = torch.cat([encode(kv[i : i + 1], codec) for i in range(3)])
    assert torch.equal(encode_each_layer(kv, codec), apart)
    assert torch.equal(torch.cat([reference_encode(kv[i : i + 1], codec) for i in range(3)]), apart)
