"""Public entry points of the pool kernels: validate, then run Triton or the torch reference.

Every function checks shapes, dtypes and devices before anything is launched (an invalid
launch corrupts memory instead of failing), scans indices for bounds in debug mode, and then
dispatches: Triton for CUDA tensors, the torch reference for CPU tensors, or what
``backend=`` forces.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.errors import ChunkFormatError
from kvtier.gpu_pool.kernels import reference
from kvtier.gpu_pool.kernels import validation as check
from kvtier.gpu_pool.kernels.dispatch import debug_enabled, device_guard, resolve_backend, sm_count
from kvtier.gpu_pool.kernels.heuristics import choose_num_splits
from kvtier.kv_codecs import Codec, decode_layers_into, groups, layer_exponents_at, layout


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str = "auto",
    debug: bool | None = None,
) -> None:
    """Write new tokens' K/V ``[num_tokens, kv_heads, head_dim]`` into one pool layer.

    ``slot_mapping[t]`` is token ``t``'s slot ``block_id * block_size + offset``; -1 skips it.
    """
    layer = check.kv_layer(kv_layer)
    num_blocks, _, block_size, kv_heads, head_dim = layer.shape
    what = "[num_tokens, kv_heads, head_dim]"
    k = check.tensor("key", key, 3, what)
    v = check.tensor("value", value, 3, what)
    slots = check.index_tensor("slot_mapping", slot_mapping, 1, "[num_tokens]")
    device = check.same_device({"key": k, "value": v, "kv_layer": layer, "slot_mapping": slots})
    check.same_dtype("key", k, "kv_layer", layer)
    check.same_dtype("value", v, "kv_layer", layer)
    if k.shape != v.shape:
        check.fail(f"key {tuple(k.shape)} and value {tuple(v.shape)} must have the same shape")
    check.dim("key", k, 1, kv_heads, "the pool's kv_heads")
    check.dim("key", k, 2, head_dim, "the pool's head_dim")
    check.dim("slot_mapping", slots, 0, k.shape[0], "one slot per token of key/value")
    if debug_enabled(debug):
        check.scan_slots(slots, num_blocks * block_size)
    if resolve_backend(backend, device) == "torch":
        reference.write_kv(k, v, layer, slots)
        return
    from kvtier.gpu_pool.kernels import triton_kv_write

    with device_guard(device):
        triton_kv_write.write_kv(k, v, layer, slots)


def _attention_inputs(q: object, kv_layer: object, rows: str
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks shared by decode and prefill: q against the pool layer."""
    layer = check.kv_layer(kv_layer)
    qt = check.tensor("q", q, 3, f"[{rows}, num_heads, head_dim]")
    check.same_dtype("q", qt, "kv_layer", layer)
    check.head_dim(qt, layer)
    check.heads(qt.shape[1], layer.shape[3])
    return qt, layer


def _decode_splits(split_kv: bool | None, num_splits: int | None, batch: int, kv_heads: int,
                   bound: int, device: torch.device) -> int:
    """Splits for the Triton decode: forced by the caller, else the heuristic's choice."""
    if split_kv is False:
        return 1
    if num_splits is not None:
        return num_splits
    splits = choose_num_splits(batch, kv_heads, bound, sm_count(device))
    if split_kv and splits == 1:  # forced on where the heuristic would not split
        splits = max(2, min(8, -(-bound // 256)))
    return splits


def paged_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    split_kv: bool | None = None,
    num_splits: int | None = None,
    max_context_len: int | None = None,
    backend: str = "auto",
    debug: bool | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged KV.

    q ``[batch, num_heads, head_dim]`` (GQA: ``num_heads`` a multiple of the pool's
    ``kv_heads``), block_tables ``[batch, max_blocks]``, context_lens ``[batch]``; returns
    ``[batch, num_heads, head_dim]``. ``split_kv``/``num_splits`` force the flash-decoding
    path (``None`` lets the heuristic decide); ``max_context_len`` (host int) sharpens that
    heuristic, otherwise ``max_blocks * block_size`` bounds it without a GPU sync.
    """
    qt, layer = _attention_inputs(q, kv_layer, "batch")
    batch, num_heads, head_dim = qt.shape
    num_blocks, _, block_size, kv_heads, _ = layer.shape
    bt, cl = check.batch_tables(block_tables, context_lens, batch)
    device = check.same_device({"q": qt, "kv_layer": layer, "block_tables": bt,
                                "context_lens": cl})
    sm_scale = check.scale(scale, head_dim)
    check.output(out, (batch, num_heads, head_dim), qt.dtype, device)
    check.optional_int("num_splits", num_splits, 1)
    check.optional_int("max_context_len", max_context_len, 0)
    if debug_enabled(debug):
        check.scan_tables(bt, cl, block_size, num_blocks)
    if resolve_backend(backend, device) == "torch":
        result = reference.paged_decode_attention(qt, layer, bt, cl, sm_scale)
        if out is None:
            return result
        out.copy_(result)
        return out
    bound = max_context_len if max_context_len is not None else bt.shape[1] * block_size
    splits = _decode_splits(split_kv, num_splits, batch, kv_heads, bound, device)
    from kvtier.gpu_pool.kernels import triton_decode

    result = out if out is not None else torch.empty_like(qt)
    with device_guard(device):
        return triton_decode.paged_decode_attention(qt, layer, bt, cl, sm_scale, result, splits)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    backend: str = "auto",
    debug: bool | None = None,
) -> torch.Tensor:
    """Causal attention of packed new query chunks over their sequences' paged KV.

    q ``[total_q_tokens, num_heads, head_dim]``; sequence ``b`` owns rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``; its new tokens' K/V must already be written to the
    pool, and ``context_lens[b]`` counts cached prefix plus new tokens. ``max_seqlen_q`` (host
    int) avoids one GPU sync to size the grid.
    """
    qt, layer = _attention_inputs(q, kv_layer, "total_q_tokens")
    total, num_heads, head_dim = qt.shape
    num_blocks, _, block_size, _, _ = layer.shape
    cu = check.index_tensor("cu_seqlens_q", cu_seqlens_q, 1, "[batch + 1]")
    if cu.shape[0] < 1:
        check.fail("cu_seqlens_q must hold batch + 1 offsets, starting with 0")
    bt, cl = check.batch_tables(block_tables, context_lens, cu.shape[0] - 1)
    device = check.same_device({"q": qt, "kv_layer": layer, "block_tables": bt,
                                "context_lens": cl, "cu_seqlens_q": cu})
    sm_scale = check.scale(scale, head_dim)
    check.output(out, (total, num_heads, head_dim), qt.dtype, device)
    check.optional_int("max_seqlen_q", max_seqlen_q, 0)
    if debug_enabled(debug):
        check.scan_tables(bt, cl, block_size, num_blocks)
        check.scan_cu_seqlens(cu, cl, total)
        if max_seqlen_q is not None and cu.shape[0] > 1 \
                and int((cu[1:] - cu[:-1]).max()) > max_seqlen_q:
            check.fail(f"max_seqlen_q={max_seqlen_q} is below the longest query chunk")
    if resolve_backend(backend, device) == "torch":
        result = reference.paged_prefill_attention(qt, layer, bt, cl, cu, sm_scale)
        if out is None:
            return result
        out.copy_(result)
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu[1:] - cu[:-1]).max()) if cu.shape[0] > 1 else 0
    from kvtier.gpu_pool.kernels import triton_prefill

    result = out if out is not None else torch.empty_like(qt)
    with device_guard(device):
        return triton_prefill.paged_prefill_attention(qt, layer, bt, cl, cu, sm_scale, result,
                                                      max_seqlen_q)


def _block_ids(block_ids: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    if isinstance(block_ids, torch.Tensor):
        return check.index_tensor("block_ids", block_ids, 1, "[n_blocks]")
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in block_ids):
        check.fail("block_ids must be a 1-D int tensor or a sequence of ints")
    ids = torch.tensor(list(block_ids), dtype=torch.int64)
    if device.type != "cuda":
        return ids.to(device)
    # From pinned memory without a wait: a plain copy from pageable memory would make the
    # host wait for the stream, so a caller could not queue the next chunk's copy behind
    # this launch (the restore pipeline does).
    return ids.pin_memory().to(device, non_blocking=True)


def _chunk_inputs(kv: object, block_ids: torch.Tensor | Sequence[int], num_tokens: int | None
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    pool = check.kv_pool(kv)
    ids = _block_ids(block_ids, pool.device)
    capacity = ids.shape[0] * pool.shape[3]
    tokens = check.num_tokens(num_tokens, capacity, capacity, "num_tokens")
    return pool, ids, tokens


def _chunk_buffer(name: str, buf: object, pool: torch.Tensor, min_tokens: int) -> torch.Tensor:
    """A chunk ``[layers, 2, tokens >= min_tokens, kv_heads, head_dim]`` matching the pool."""
    b = check.tensor(name, buf, 5, "[layers, 2, tokens, kv_heads, head_dim]")
    check.same_dtype(name, b, "kv", pool)
    check.dim(name, b, 0, pool.shape[0], "the pool's layers")
    check.dim(name, b, 1, 2, "index 0 holds K, 1 holds V")
    check.dim(name, b, 3, pool.shape[4], "the pool's kv_heads")
    check.dim(name, b, 4, pool.shape[5], "the pool's head_dim")
    if b.shape[2] < min_tokens:
        check.fail(f"{name} holds {b.shape[2]} tokens but {min_tokens} are to be copied")
    check.dense_tail(name, b, 2)
    return b


def gather_blocks(
    kv: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    *,
    num_tokens: int | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    debug: bool | None = None,
) -> torch.Tensor:
    """Copy blocks of one sequence, all layers, into chunk layout in one launch.

    kv is the whole pool ``[layers, num_blocks, 2, block_size, kv_heads, head_dim]``; returns
    ``[layers, 2, num_tokens, kv_heads, head_dim]`` (default ``num_tokens`` =
    ``len(block_ids) * block_size``; fewer leaves out the tail block's unused slots). With
    ``out`` (at least ``num_tokens`` tokens), the first ``num_tokens`` of it are written.
    """
    pool, ids, tokens = _chunk_inputs(kv, block_ids, num_tokens)
    layers, num_blocks, _, _, kv_heads, head_dim = pool.shape
    if out is None:
        result = torch.empty((layers, 2, tokens, kv_heads, head_dim), dtype=pool.dtype,
                             device=pool.device)
    else:
        result = _chunk_buffer("out", out, pool, tokens)
    check.same_device({"kv": pool, "block_ids": ids, "out": result})
    if debug_enabled(debug):
        check.scan_block_ids("block_ids", ids, num_blocks)
    if resolve_backend(backend, pool.device) == "torch":
        return reference.gather_blocks(pool, ids, tokens, result)
    from kvtier.gpu_pool.kernels import triton_blocks

    with device_guard(pool.device):
        triton_blocks.copy_blocks(pool, result, ids, tokens, to_pool=False)
    return result


def scatter_blocks(
    buffer: torch.Tensor,
    kv: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    *,
    num_tokens: int | None = None,
    backend: str = "auto",
    debug: bool | None = None,
) -> None:
    """Copy a chunk-layout buffer back into blocks of the pool (all layers, one launch).

    The first ``num_tokens`` tokens of ``buffer`` (default: all of them) go to
    ``block_ids`` in order; slots past ``num_tokens`` in the tail block are left as they are.
    """
    pool = check.kv_pool(kv)
    buf = check.tensor("buffer", buffer, 5, "[layers, 2, tokens, kv_heads, head_dim]")
    ids = _block_ids(block_ids, pool.device)
    capacity = ids.shape[0] * pool.shape[3]
    tokens = check.num_tokens(num_tokens, buf.shape[2], capacity, "num_tokens")
    if num_tokens is None and tokens > capacity:
        check.fail(f"buffer holds {tokens} tokens but {ids.shape[0]} blocks hold only "
                    f"{capacity}; pass more block_ids or num_tokens")
    buf = _chunk_buffer("buffer", buf, pool, tokens)
    check.same_device({"kv": pool, "block_ids": ids, "buffer": buf})
    if debug_enabled(debug):
        check.scan_block_ids("block_ids", ids, pool.shape[1])
    if resolve_backend(backend, pool.device) == "torch":
        reference.scatter_blocks(buf, pool, ids, tokens)
        return
    from kvtier.gpu_pool.kernels import triton_blocks

    with device_guard(pool.device):
        triton_blocks.copy_blocks(pool, buf, ids, tokens, to_pool=True)


DECODE_ERRORS = {
    2: "payload holds an exponent no encoder writes",
    3: "payload holds a value no encoder writes",
    4: "payload decodes to a value past its dtype's range",
}
"""What a nonzero status of :func:`scatter_decoded` means (the highest code found)."""


def scatter_decoded(
    payload: torch.Tensor,
    codec: Codec | str,
    kv: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    *,
    tokens: int,
    offset: int = 0,
    status: torch.Tensor | None = None,
    backend: str = "auto",
    debug: bool | None = None,
) -> torch.Tensor:
    """Decode a compressed chunk into blocks of the pool in one pass (all layers, one
    launch): ``payload`` (uint8, on the pool's device) holds ``kv.shape[0]`` layers one
    after another, each encoded apart for ``[2, tokens, kv_heads, head_dim]``
    (:mod:`kvtier.kv_codecs`); its tokens from ``offset`` on go to ``block_ids`` in order.

    Bytes only a foreign writer puts in a payload are not raised (a launch cannot): the
    highest code found (:data:`DECODE_ERRORS`) is written into ``status`` (an int32 ``[1]``
    on the device, made when None, and returned); read it once the stream's work is done,
    and treat the blocks as garbage where it is nonzero. Several chunks may share one."""
    pool, name, ids, status = _decoded_inputs(payload, codec, kv, block_ids, tokens, offset,
                                              status)
    layers, _, _, _, kv_heads, head_dim = pool.shape
    if debug_enabled(debug):
        check.scan_block_ids("block_ids", ids, pool.shape[1])
    if resolve_backend(backend, pool.device) == "torch":
        out = torch.empty((layers, 2, tokens, kv_heads, head_dim), dtype=pool.dtype,
                          device=pool.device)
        try:
            decode_layers_into(payload, name, out)
        except ChunkFormatError:
            status.fill_(max(status.item(), 3))
            return status
        reference.scatter_blocks(out[:, :, offset:].contiguous(), pool, ids, tokens - offset)
        return status
    from kvtier.gpu_pool.kernels import triton_codec

    at = layer_exponents_at(name, (2, tokens, kv_heads, head_dim), pool.dtype)
    with device_guard(pool.device):
        triton_codec.decode_scatter(payload, name.value, pool, ids, tokens, offset, at,
                                    groups(name, tokens, head_dim), status)
    return status


def _decoded_inputs(payload: object, codec: Codec | str, kv: object,
                    block_ids: torch.Tensor | Sequence[int], tokens: int, offset: int,
                    status: torch.Tensor | None
                    ) -> tuple[torch.Tensor, Codec, torch.Tensor, torch.Tensor]:
    """:func:`scatter_decoded`'s arguments checked: the pool, the codec, the block ids and
    the status word (made where None)."""
    pool = check.kv_pool(kv)
    layers, _, _, block_size, kv_heads, head_dim = pool.shape
    try:
        name = Codec(codec)
    except ValueError:
        check.fail(f"codec {codec!r} is not one of {[c.value for c in Codec]}")
    if name is Codec.NONE:
        check.fail("codec 'none' is not compressed: scatter the KV with scatter_blocks")
    if pool.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        check.fail(f"a codec decodes into float32, bf16 or fp16, not {pool.dtype}")
    if not 0 <= offset <= tokens:
        check.fail(f"offset {offset} lies outside a {tokens}-token chunk")
    one = layout(name, (1, 2, tokens, kv_heads, head_dim), pool.dtype)
    if (not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8
            or payload.dim() != 1 or not payload.is_contiguous()):
        check.fail("payload must be a contiguous 1-D uint8 tensor")
    if payload.numel() != layers * one.nbytes:
        check.fail(f"payload of {payload.numel()} bytes: {layers} layers of {name.value} KV "
                   f"{(2, tokens, kv_heads, head_dim)} take {layers * one.nbytes}")
    ids = _block_ids(block_ids, pool.device)
    need = -(-(tokens - offset) // block_size)
    if ids.shape[0] != need:
        check.fail(f"{tokens - offset} tokens from offset {offset} need {need} block ids, "
                   f"got {ids.shape[0]}")
    if status is None:
        status = torch.zeros(1, dtype=torch.int32, device=pool.device)
    elif status.dtype != torch.int32 or status.numel() != 1:
        check.fail("status must be an int32 tensor of one element")
    check.same_device({"kv": pool, "block_ids": ids, "payload": payload, "status": status})
    return pool, name, ids, status
