"""The numpy block copies the data path's worker threads use agree with the torch
reference bit for bit: every dtype size, tail blocks, layer ranges of the pool."""

from __future__ import annotations

import pytest
import torch

from kvtier.gpu_pool.kernels import (
    copy_host,
    gather_blocks,
    gather_blocks_host,
    scatter_blocks,
    scatter_blocks_host,
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens", [16, 40, 48, 1])
@pytest.mark.parametrize("layers", [(0, 3), (1, 2)])
def test_host_gather_and_scatter_match_the_reference(dtype, num_tokens, layers):
    g = torch.Generator().manual_seed(num_tokens)
    kv = torch.randint(0, 255, (3, 9, 2, 16, 2, 4), generator=g).to(dtype)
    ids = [7, 2, 5]
    a, b = layers
    want = gather_blocks(kv[a:b], ids, num_tokens=num_tokens, backend="torch")
    got = torch.full((b - a, 2, num_tokens + 5, 2, 4), 3).to(dtype)  # room past the tokens
    gather_blocks_host(kv[a:b], ids, num_tokens, got)
    assert torch.equal(got[:, :, :num_tokens], want)
    assert (got[:, :, num_tokens:] == 3).all()  # nothing written past them

    src = torch.randint(0, 255, want.shape, generator=g).to(dtype)
    ref, out = kv.clone(), kv.clone()
    scatter_blocks(src, ref[a:b], ids, backend="torch")
    scatter_blocks_host(src, out[a:b], ids, num_tokens)
    assert torch.equal(out, ref)  # tail slots past num_tokens and other layers kept


def test_host_copies_refuse_mismatched_buffers():
    kv = torch.zeros(2, 4, 2, 16, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gather into"):
        gather_blocks_host(kv, [0], 16, torch.zeros(2, 2, 16, 1, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="scatter of"):
        scatter_blocks_host(torch.zeros(2, 2, 16, 1, 8), kv, [0], 16)
    with pytest.raises(ValueError, match="copy of"):
        copy_host(torch.zeros(4), torch.zeros(5))
    dst = torch.zeros(4, dtype=torch.bfloat16)
    copy_host(dst, torch.arange(4).to(torch.bfloat16))
    assert dst.tolist() == [0, 1, 2, 3]
