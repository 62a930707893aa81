"""Bad kernel inputs raise KernelInputError before anything is launched; the bounds scan runs
only in debug mode. Launchers are replaced by recorders, so a missed check shows up as a
recorded launch instead of an out-of-bounds access."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import KernelInputError, KVTierError
from kvtier.gpu_pool import kernels as K
from kvtier.gpu_pool.kernels import (
    dispatch,
    triton_blocks,
    triton_decode,
    triton_kv_write,
    triton_prefill,
)

NB, BS, HKV, D = 6, 8, 2, 16


@pytest.fixture
def launches(monkeypatch):
    """Replace every Triton launcher with a recorder; returns the list of launched names."""
    calls: list[str] = []

    def recorder(name):
        def fake(*args, **kwargs):
            calls.append(name)
        return fake

    monkeypatch.setattr(triton_decode, "paged_decode_attention", recorder("decode"))
    monkeypatch.setattr(triton_prefill, "paged_prefill_attention", recorder("prefill"))
    monkeypatch.setattr(triton_kv_write, "write_kv", recorder("write"))
    monkeypatch.setattr(triton_blocks, "copy_blocks", recorder("blocks"))
    monkeypatch.delenv(dispatch.DEBUG_ENV, raising=False)
    monkeypatch.setattr(dispatch, "triton_interpreted", lambda: True)
    return calls


def _layer(dtype=torch.float16):
    return torch.zeros(NB, 2, BS, HKV, D, dtype=dtype)


def _decode_args():
    return {
        "q": torch.zeros(2, 4, D, dtype=torch.float16),
        "kv_layer": _layer(),
        "block_tables": torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
        "context_lens": torch.tensor([9, 5], dtype=torch.int32),
    }


def _prefill_args():
    return {
        "q": torch.zeros(7, 4, D, dtype=torch.float16),
        "kv_layer": _layer(),
        "block_tables": torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
        "context_lens": torch.tensor([9, 5], dtype=torch.int32),
        "cu_seqlens_q": torch.tensor([0, 4, 7], dtype=torch.int32),
    }


def _write_args():
    return {
        "key": torch.zeros(3, HKV, D, dtype=torch.float16),
        "value": torch.zeros(3, HKV, D, dtype=torch.float16),
        "kv_layer": _layer(),
        "slot_mapping": torch.tensor([0, -1, 9]),
    }


def _pool():
    return torch.zeros(2, NB, 2, BS, HKV, D, dtype=torch.float16)


BAD_DECODE = {
    "q dtype": {"q": torch.zeros(2, 4, D, dtype=torch.float32)},
    "q device": {"q": torch.zeros(2, 4, D, dtype=torch.float16, device="meta")},
    "heads not multiple": {"q": torch.zeros(2, 3, D, dtype=torch.float16)},
    "head_dim": {"q": torch.zeros(2, 4, 2 * D, dtype=torch.float16)},
    "q rank": {"q": torch.zeros(2, 4 * D, dtype=torch.float16)},
    "q not tensor": {"q": [[0.0]]},
    "kv rank": {"kv_layer": torch.zeros(NB, 2, BS, HKV * D, dtype=torch.float16)},
    "kv not K/V": {"kv_layer": torch.zeros(NB, 3, BS, HKV, D, dtype=torch.float16)},
    "kv int dtype": {"kv_layer": torch.zeros(NB, 2, BS, HKV, D, dtype=torch.int8)},
    "kv strided head_dim": {"kv_layer": torch.zeros(NB, 2, BS, HKV, 2 * D,
                                                    dtype=torch.float16)[..., ::2]},
    "tables float": {"block_tables": torch.zeros(2, 2)},
    "tables rank": {"block_tables": torch.zeros(4, dtype=torch.int32)},
    "tables batch": {"block_tables": torch.zeros(3, 2, dtype=torch.int32)},
    "lens float": {"context_lens": torch.tensor([9.0, 5.0])},
    "lens batch": {"context_lens": torch.tensor([9], dtype=torch.int32)},
    "lens int16": {"context_lens": torch.tensor([9, 5], dtype=torch.int16)},
    "scale negative": {"scale": -1.0},
    "scale nan": {"scale": float("nan")},
    "out shape": {"out": torch.zeros(2, 4, D + 1, dtype=torch.float16)},
    "out dtype": {"out": torch.zeros(2, 4, D, dtype=torch.float32)},
    "backend": {"backend": "cuda"},
    "num_splits": {"num_splits": 0},
    "max_context_len": {"max_context_len": 1.5},
}


@pytest.mark.parametrize("bad", list(BAD_DECODE), ids=list(BAD_DECODE))
def test_decode_rejects(bad, launches):
    with pytest.raises(KernelInputError) as err:
        K.paged_decode_attention(**{"backend": "triton", **_decode_args(), **BAD_DECODE[bad]})
    assert launches == []
    assert len(str(err.value)) > 30  # says what was wrong and what to change


BAD_PREFILL = {
    "cu_seqlens batch": {"cu_seqlens_q": torch.tensor([0, 7], dtype=torch.int32)},
    "cu_seqlens float": {"cu_seqlens_q": torch.tensor([0.0, 4.0, 7.0])},
    "cu_seqlens rank": {"cu_seqlens_q": torch.tensor([[0, 4, 7]], dtype=torch.int32)},
    "q dtype": {"q": torch.zeros(7, 4, D, dtype=torch.bfloat16)},
    "heads": {"q": torch.zeros(7, 5, D, dtype=torch.float16)},
    "max_seqlen_q": {"max_seqlen_q": -1},
    "out shape": {"out": torch.zeros(6, 4, D, dtype=torch.float16)},
}


@pytest.mark.parametrize("bad", list(BAD_PREFILL), ids=list(BAD_PREFILL))
def test_prefill_rejects(bad, launches):
    with pytest.raises(KernelInputError):
        K.paged_prefill_attention(**{**_prefill_args(), **BAD_PREFILL[bad]}, backend="triton")
    assert launches == []


BAD_WRITE = {
    "value shape": {"value": torch.zeros(4, HKV, D, dtype=torch.float16)},
    "key heads": {"key": torch.zeros(3, HKV + 1, D, dtype=torch.float16)},
    "key dtype": {"key": torch.zeros(3, HKV, D, dtype=torch.float32)},
    "slots length": {"slot_mapping": torch.tensor([0, 1])},
    "slots float": {"slot_mapping": torch.tensor([0.0, 1.0, 2.0])},
    "kv layer is the whole pool": {"kv_layer": _pool()},
}


@pytest.mark.parametrize("bad", list(BAD_WRITE), ids=list(BAD_WRITE))
def test_write_rejects(bad, launches):
    with pytest.raises(KernelInputError):
        K.write_kv(**{**_write_args(), **BAD_WRITE[bad]}, backend="triton")
    assert launches == []


BAD_BLOCKS = {
    "ids float": {"block_ids": torch.tensor([1.0, 2.0])},
    "ids not ints": {"block_ids": [1, "2"]},
    "too many tokens": {"num_tokens": 2 * BS + 1},
    "negative tokens": {"num_tokens": -1},
    "pool is one layer": {"kv": _layer()},
    "out dtype": {"out": torch.zeros(2, 2, 2 * BS, HKV, D, dtype=torch.float32)},
    "out layers": {"out": torch.zeros(3, 2, 2 * BS, HKV, D, dtype=torch.float16)},
    "out too short": {"out": torch.zeros(2, 2, BS, HKV, D, dtype=torch.float16)},
    "out not dense": {"out": torch.zeros(2, 2, HKV, 2 * BS, D,
                                         dtype=torch.float16).transpose(2, 3)},
}


@pytest.mark.parametrize("bad", list(BAD_BLOCKS), ids=list(BAD_BLOCKS))
def test_gather_rejects(bad, launches):
    args = {"kv": _pool(), "block_ids": [1, 2], **BAD_BLOCKS[bad]}
    with pytest.raises(KernelInputError):
        K.gather_blocks(args.pop("kv"), args.pop("block_ids"), **args, backend="triton")
    assert launches == []


def test_scatter_rejects(launches):
    chunk = torch.zeros(2, 2, 2 * BS, HKV, D, dtype=torch.float16)
    for bad in (
        lambda: K.scatter_blocks(chunk, _pool(), [1]),  # 16 tokens into one 8-token block
        lambda: K.scatter_blocks(chunk.float(), _pool(), [1, 2]),
        lambda: K.scatter_blocks(chunk[:, :, :, :1], _pool(), [1, 2]),
        lambda: K.scatter_blocks(chunk, _pool(), [1, 2], num_tokens=17),
        lambda: K.scatter_blocks(chunk[:1], _pool(), [1, 2]),
    ):
        with pytest.raises(KernelInputError):
            bad()
    assert launches == []


def test_triton_backend_on_cpu_without_interpreter(launches, monkeypatch):
    monkeypatch.setattr(dispatch, "triton_interpreted", lambda: False)
    with pytest.raises(KernelInputError, match="TRITON_INTERPRET"):
        K.paged_decode_attention(**_decode_args(), backend="triton")
    assert launches == []


def test_kernel_input_error_is_a_kvtier_value_error():
    assert issubclass(KernelInputError, KVTierError)
    assert issubclass(KernelInputError, ValueError)


# ---------------------------------------------------------------------- debug bounds scan
def _decode_past_pool():
    args = _decode_args()
    args["block_tables"] = torch.tensor([[1, NB], [3, 0]], dtype=torch.int32)  # NB: past pool
    return args


def test_bounds_scan_only_in_debug_mode(launches):
    K.paged_decode_attention(**_decode_past_pool(), backend="triton")
    assert launches == ["decode"]  # not scanned: the caller vouches for the indices
    with pytest.raises(KernelInputError, match="block_tables"):
        K.paged_decode_attention(**_decode_past_pool(), backend="triton", debug=True)
    assert launches == ["decode"]


def test_bounds_scan_from_environment(launches, monkeypatch):
    monkeypatch.setenv(dispatch.DEBUG_ENV, "1")
    with pytest.raises(KernelInputError, match="block_tables"):
        K.paged_decode_attention(**_decode_past_pool(), backend="triton")
    # debug=False overrides the environment.
    K.paged_decode_attention(**_decode_past_pool(), backend="triton", debug=False)
    assert launches == ["decode"]


def test_bounds_scan_ignores_padding_past_context(launches):
    args = _decode_args()
    args["block_tables"] = torch.tensor([[1, 2, 99], [3, -5, 77]], dtype=torch.int32)
    K.paged_decode_attention(**args, backend="triton", debug=True)
    assert launches == ["decode"]


SCANNED = {
    "context past table": lambda: K.paged_decode_attention(
        **{**_decode_args(), "context_lens": torch.tensor([17, 5], dtype=torch.int32)},
        backend="triton", debug=True),
    "negative block id": lambda: K.paged_prefill_attention(
        **{**_prefill_args(), "block_tables": torch.tensor([[1, -2], [3, 0]],
                                                           dtype=torch.int32)},
        backend="triton", debug=True),
    "cu_seqlens total": lambda: K.paged_prefill_attention(
        **{**_prefill_args(), "cu_seqlens_q": torch.tensor([0, 4, 6], dtype=torch.int32)},
        backend="triton", debug=True),
    "queries past context": lambda: K.paged_prefill_attention(
        **{**_prefill_args(), "cu_seqlens_q": torch.tensor([0, 1, 7], dtype=torch.int32)},
        backend="triton", debug=True),
    "max_seqlen_q too small": lambda: K.paged_prefill_attention(
        **_prefill_args(), max_seqlen_q=3, backend="triton", debug=True),
    "slot past pool": lambda: K.write_kv(
        **{**_write_args(), "slot_mapping": torch.tensor([0, -1, NB * BS])},
        backend="triton", debug=True),
    "slot below -1": lambda: K.write_kv(
        **{**_write_args(), "slot_mapping": torch.tensor([0, -2, 1])},
        backend="triton", debug=True),
    "gather block past pool": lambda: K.gather_blocks(
        _pool(), [1, NB], backend="triton", debug=True),
    "scatter block past pool": lambda: K.scatter_blocks(
        torch.zeros(2, 2, BS, HKV, D, dtype=torch.float16), _pool(), [NB + 3],
        backend="triton", debug=True),
}


@pytest.mark.parametrize("bad", list(SCANNED), ids=list(SCANNED))
def test_bounds_scan_catches(bad, launches):
    with pytest.raises(KernelInputError):
        SCANNED[bad]()
    assert launches == []


def test_valid_inputs_pass_the_scan(launches):
    K.paged_decode_attention(**_decode_args(), backend="triton", debug=True)
    K.paged_prefill_attention(**_prefill_args(), backend="triton", debug=True)
    K.write_kv(**_write_args(), backend="triton", debug=True)
    K.gather_blocks(_pool(), [1, 2], num_tokens=9, backend="triton", debug=True)
    assert launches == ["decode", "prefill", "write", "blocks"]
