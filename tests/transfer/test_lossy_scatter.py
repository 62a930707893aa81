"""The fused check + decode + scatter of a compressed chunk into a host pool gives the
same pool as decoding with the reference and scattering, for every codec, dtype, offset
and a partial last block; a corrupted layer stops it before anything of that layer is
written."""

from __future__ import annotations

import pytest
import torch

from kvtier.chunk_format import encode_chunk, parse_header
from kvtier.gpu_pool.kernels import host_native
from kvtier.gpu_pool.kernels.host_blocks import scatter_blocks_host
from kvtier.kv_codecs import Codec, layer_exponents_at, native_id, reference_decode

pytestmark = pytest.mark.skipif(not host_native.CODEC_AVAILABLE,
                                reason="the native codec kernels were not built")

LAYERS, TOKENS, HEADS, DIM, BS = 3, 72, 2, 64, 16  # 72 tokens: 5 blocks, the last of 8 tokens


def _chunk(codec: Codec, dtype: torch.dtype):
    kv = torch.randn((LAYERS, 2, TOKENS, HEADS, DIM), generator=torch.Generator().manual_seed(4))
    kv[:, 0, :, :, 7] *= 40
    blob = bytearray(encode_chunk("k" * 8, b"fp", kv.to(dtype), codec))
    header, offset = parse_header(blob)
    return header, torch.frombuffer(blob, dtype=torch.uint8)[offset:]


def _reference(header, payload, codec, dtype, offset, pool, ids, tokens=TOKENS):
    step = header.layer_nbytes
    one = (1, 2, tokens, HEADS, DIM)
    for layer in range(LAYERS):
        kv = reference_decode(payload[layer * step : (layer + 1) * step], codec, one, dtype)
        scatter_blocks_host(kv[:, :, offset:], pool[layer : layer + 1], ids, tokens - offset)


@pytest.mark.parametrize("codec", [Codec.FP8, Codec.INT8, Codec.INT4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0, 16])
def test_fused_equals_decode_then_scatter(codec, dtype, offset):
    header, payload = _chunk(codec, dtype)
    ids = [9, 2, 5, 0, 7][offset // BS :]
    got = torch.zeros((LAYERS, 10, 2, BS, HEADS, DIM), dtype=dtype)
    want = got.clone()
    at = layer_exponents_at(codec, (2, TOKENS, HEADS, DIM), dtype)
    bad = host_native.scatter_decoded_verified(payload, native_id(codec), header.layer_checksums,
                                               offset, got, ids, TOKENS, at)
    assert bad == (-1, 0)
    _reference(header, payload, codec, dtype, offset, want, ids)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_a_partial_last_block_and_a_corrupt_layer():
    codec, dtype = Codec.INT8, torch.bfloat16
    header, payload = _chunk(codec, dtype)
    step = header.layer_nbytes
    payload = payload.clone()
    payload[2 * step + 5] ^= 1  # layer 2's bytes
    got = torch.zeros((LAYERS, 10, 2, BS, HEADS, DIM), dtype=dtype)
    at = layer_exponents_at(codec, (2, TOKENS, HEADS, DIM), dtype)
    layer, status = host_native.scatter_decoded_verified(
        payload, native_id(codec), header.layer_checksums, 0, got, [1, 2, 3, 4, 5], TOKENS, at)
    assert (layer, status) == (2, -1)
    assert got[:2].abs().sum() > 0 and got[2].abs().sum() == 0  # nothing of layer 2 written
    with pytest.raises(ValueError):  # an offset inside a block
        host_native.scatter_decoded_verified(payload, native_id(codec), header.layer_checksums,
                                             8, got, [1, 2, 3, 4, 5], TOKENS, at)
