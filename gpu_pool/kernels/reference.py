"""Torch reference of every pool kernel: the test oracle and the CPU implementation.

Written for clarity first (plain indexing, fp32 attention), vectorised over tokens so the
CPU engine can run on it; attention loops over sequences only where lengths are ragged.
Prefill gathers each sequence's K/V contiguously and calls torch's SDPA, which runs a fused
(flash) kernel on CPU: the engine's prefill is then bound by its matmuls, not by attention.
Inputs are assumed validated (see ``validation.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``kv_layer[slot // bs, 0|1, slot % bs] = key|value`` for every slot >= 0."""
    block_size = kv_layer.shape[2]
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_layer[blocks, 0, offsets] = key
    kv_layer[blocks, 1, offsets] = value


def _softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """fp32 attention of ``R`` query rows per KV head: q ``[..., Hkv, R, D]``, k/v
    ``[..., Hkv, N, D]``, mask broadcastable to ``[..., Hkv, R, N]`` (True = attend).

    GQA puts the ``G`` query heads of a KV head among the rows, so K and V are never
    repeated. Rows that attend to nothing give zeros.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.matmul(probs, v)


def _gather_tokens(kv_layer: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """K and V of the first ``length`` positions of one sequence: ``[2, length, Hkv, D]``."""
    block_size = kv_layer.shape[2]
    nblocks = -(-length // block_size)
    blocks = kv_layer[table[:nblocks].long()]  # [nblocks, 2, bs, Hkv, D]
    return blocks.transpose(0, 1).reshape(2, nblocks * block_size, *kv_layer.shape[3:])[:, :length]


def paged_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence attends to all of its ``context_lens[b]`` cached tokens.

    The batch is padded to the longest context and masked, so the whole batch is two matmuls.
    """
    batch, num_heads, head_dim = q.shape
    block_size, kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    group = num_heads // kv_heads
    lens = context_lens.long()
    max_len = int(lens.max()) if batch else 0
    if max_len == 0:
        return torch.zeros_like(q)
    nblocks = -(-max_len // block_size)
    table = block_tables[:, :nblocks].long()
    used = torch.arange(nblocks, device=q.device)[None, :] * block_size < lens[:, None]
    table = torch.where(used, table, torch.zeros_like(table))  # padding may hold anything
    kv = kv_layer[table]  # [B, nblocks, 2, bs, Hkv, D]
    kv = kv.permute(2, 0, 4, 1, 3, 5).reshape(2, batch, kv_heads, nblocks * block_size, head_dim)
    mask = torch.arange(nblocks * block_size, device=q.device)[None, :] < lens[:, None]
    # Slots past a sequence's end may hold anything, even NaN: masking the scores covers K,
    # but 0 * NaN in the PV product would leak, so V is zeroed there.
    k = kv[0].float()
    v = torch.where(mask[:, None, :, None], kv[1], 0).float()
    qf = q.float().view(batch, kv_heads, group, head_dim)  # the group is the query rows
    out = _softmax_attention(qf, k, v, mask[:, None, None, :], scale)  # [B, Hkv, G, D]
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each sequence's new query tokens attend causally to its cached prefix and to themselves.

    Query ``i`` of a sequence with context ``L`` and ``n`` new tokens sits at position
    ``L - n + i`` and sees positions ``<= L - n + i``.
    """
    _, num_heads, head_dim = q.shape
    kv_heads = kv_layer.shape[3]
    group = num_heads // kv_heads
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for b, length in enumerate(lens):
        start, end = cu[b], cu[b + 1]
        n = end - start
        if n == 0 or length == 0:
            continue
        kv = _gather_tokens(kv_layer, block_tables[b], length).float()  # [2, L, Hkv, D]
        k, v = kv[0].transpose(0, 1), kv[1].transpose(0, 1)  # [Hkv, L, D]
        qf = q[start:end].float().transpose(0, 1)  # [H, n, D]
        if n == length:  # no cached prefix: plain causal attention
            mask, causal = None, True
        else:  # query i sits at position L - n + i and sees positions <= its own
            qpos = torch.arange(length - n, length, device=q.device)
            mask, causal = torch.arange(length, device=q.device)[None, :] <= qpos[:, None], False
        if group > 1:  # CPU's fused SDPA kernel takes no GQA: give each query head its K/V
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        o = F.scaled_dot_product_attention(
            qf[None], k[None], v[None], attn_mask=mask, is_causal=causal, scale=scale
        )[0]  # [H, n, D]
        out[start:end] = o.transpose(0, 1).to(q.dtype)
    return out


def _token_index(block_ids: torch.Tensor, block_size: int, num_tokens: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(block id, offset in block) of each of the first ``num_tokens`` tokens of a block list."""
    t = torch.arange(num_tokens, device=block_ids.device)
    return block_ids.long()[t // block_size], t % block_size


def _whole_blocks(chunk: torch.Tensor, n: int, block_size: int) -> torch.Tensor | None:
    """The first ``n`` whole blocks of a chunk ``[L, 2, tokens, H, D]`` seen as
    ``[L, 2, n, block_size, H, D]`` (None where the chunk's tokens are not dense)."""
    part = chunk[:, :, : n * block_size]
    try:
        return part.view(*part.shape[:2], n, block_size, *part.shape[3:])
    except RuntimeError:
        return None


def gather_blocks(
    kv: torch.Tensor, block_ids: torch.Tensor, num_tokens: int, out: torch.Tensor
) -> torch.Tensor:
    """Copy the first ``num_tokens`` tokens of ``block_ids`` (all layers) into chunk layout:
    whole blocks with one ``index_select`` straight into ``out`` (no temporary), the
    partial tail block with one copy."""
    bs = kv.shape[3]
    full, rest = divmod(num_tokens, bs)
    ids = block_ids.long()
    dest = _whole_blocks(out, full, bs)
    if dest is None:  # a strided out: index the tokens one by one
        blocks, offsets = _token_index(block_ids, bs, num_tokens)
        kv_index = torch.arange(2, device=kv.device)[:, None]
        out[:, :, :num_tokens] = kv[:, blocks[None, :], kv_index, offsets[None, :]]
        return out
    if full:
        torch.index_select(kv.transpose(1, 2), 2, ids[:full], out=dest)
    if rest:
        out[:, :, full * bs : num_tokens] = kv[:, int(ids[full]), :, :rest]
    return out


def scatter_blocks(
    buffer: torch.Tensor, kv: torch.Tensor, block_ids: torch.Tensor, num_tokens: int
) -> None:
    """Inverse of :func:`gather_blocks`: chunk-layout tokens back into the pool's blocks
    (one copy per whole block: on a CPU, twice as fast as one ``index_copy_``, which
    does not run in parallel over a strided destination)."""
    bs = kv.shape[3]
    full, rest = divmod(num_tokens, bs)
    ids = block_ids.long()
    src = _whole_blocks(buffer, full, bs)
    if src is None:
        blocks, offsets = _token_index(block_ids, bs, num_tokens)
        kv_index = torch.arange(2, device=kv.device)[:, None]
        kv[:, blocks[None, :], kv_index, offsets[None, :]] = buffer[:, :, :num_tokens]
        return
    for j, block in enumerate(ids[:full].tolist()):
        kv[:, block].copy_(src[:, :, j])
    if rest:
        kv[:, int(ids[full]), :, :rest] = buffer[:, :, full * bs : num_tokens]
