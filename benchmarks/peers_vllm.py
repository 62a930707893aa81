"""``kvtier bench peers``' vLLM connector rows: the worker side of kvtier's vLLM connector
storing and loading the same bytes as the engine's rows, laid out as vLLM keeps them (one
cache tensor per layer, ``[2, num_blocks, block_size, kv_heads, head_dim]``, 16-token
blocks, in chunks of ``--chunk-tokens``), into and out of an in-process CPU tier: every
chunk's blocks gathered straight into an arena slot and checksummed there, then scattered
from the slot into a second cache, each group of layers checked right before it is copied;
checked bit-exact. The save is timed until it has landed (the connector runs it off vLLM's
forward path; here its speed is what is measured). Its speed is
compared with the engine's own CPU-tier rows of the same run and with the raw copy."""

from __future__ import annotations

import time
from typing import Any

VLLM_BLOCK = 16
REQUEST_BLOCKS = 256
"""Blocks per transfer (a request's prompt blocks in one step)."""


def _caches(layers: int, blocks: int, heads: int, dim: int, seed: int | None) -> dict[str, Any]:
    """vLLM-layout bf16 caches, random bits (``seed``) or zeros."""
    import torch

    shape = (2, blocks, VLLM_BLOCK, heads, dim)
    out = {}
    g = None if seed is None else torch.Generator().manual_seed(seed)
    for i in range(layers):
        t = torch.empty(shape, dtype=torch.bfloat16)
        t.view(torch.int16).fill_(0)  # touched: a serving engine's cache exists already
        if g is not None:
            bits = t.view(torch.int16)
            bits.copy_(torch.randint(-(1 << 14), 1 << 14, bits.shape, generator=g, dtype=torch.int16))
        out[f"model.layers.{i}.self_attn"] = t
    return out


def connector_run(layers: int, heads: int, dim: int, tokens: int, chunk_tokens: int = 256
                  ) -> dict[str, Any]:
    """Save ``tokens`` worth of blocks from one cache, load them into another: times,
    bytes and whether every bit came back."""
    import torch

    from kvtier.chunk_format import max_chunk_bytes
    from kvtier.connectors.chunk_store import LocalChunkStore
    from kvtier.connectors.tiers.cpu_tier import CPUTier
    from kvtier.connectors.tiers.host_buffers import round_up
    from kvtier.connectors.tiers.manager import TierManager
    from kvtier.connectors.vllm_blocks import ChunkGrid, ChunkSpan, ChunkTransfer
    from kvtier.connectors.vllm_worker import WorkerSide

    blocks = tokens // VLLM_BLOCK
    src, dst = _caches(layers, blocks, heads, dim, 1), _caches(layers, blocks, heads, dim, None)
    block_bytes = layers * 2 * VLLM_BLOCK * heads * dim * 2
    grid = ChunkGrid.of(VLLM_BLOCK, b"bench-peers-vllm", chunk_tokens)
    per = grid.chunk_blocks
    slot = round_up(max_chunk_bytes(layers, block_bytes * per))
    store = LocalChunkStore(TierManager([CPUTier(slot * (blocks // per + 1), slot)]))
    keys = [k.key for k in grid.keys(list(range(blocks * VLLM_BLOCK)))]
    spans = [ChunkSpan(k, tuple(range(i * per, min((i + 1) * per, blocks)))) for i, k in enumerate(keys)]
    step = max(1, REQUEST_BLOCKS // per)
    plan = [ChunkTransfer(f"r{i}", spans[i : i + step]) for i in range(0, len(spans), step)]
    writer = WorkerSide(lambda: store, grid, background=True)
    reader = WorkerSide(lambda: store, grid)
    writer.register(src, blocks)
    reader.register(dst, blocks)
    try:
        t0 = time.perf_counter()
        writer.save(plan)
        writer.wait_saves()  # until the background save has landed
        store_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        reader.load(plan)
        retrieve_s = time.perf_counter() - t0
        exact = (writer.stats.saved_blocks == blocks and not reader.take_load_errors()
                 and all(torch.equal(src[n].view(torch.int16), dst[n].view(torch.int16)) for n in src))
    finally:
        writer.close()
        store.manager.close()
    return {"store_s": store_s, "retrieve_s": retrieve_s, "bytes": blocks * block_bytes,
            "bit_exact": exact, "blocks": blocks, "block_bytes": block_bytes, "chunk_blocks": per}


def connector_rows(runs: list[dict[str, Any]], engine_runs: list[dict[str, Any]],
                   engine_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The connector's store and load rows: the best of its runs, and its speed over the
    engine's restore (and store) of the same round, the median over rounds (this VM's
    memory speed drifts by tens of percent within minutes: only a round's own pair is
    comparable). ``engine_rows``: the engine's CPU rows of the run (for the raw copy)."""
    import statistics

    raw = {r["op"]: r["raw_GBps"] for r in engine_rows if r["tier"] == "cpu"}
    out = []
    for op in ("store", "retrieve"):
        best = min(run[f"{op}_s"] for run in runs)
        gbps = runs[0]["bytes"] / best / 1e9
        per_round = {
            f"vs_engine_{what}": [round((e[f"{what}_s"] / e["bytes"]) / (c[f"{op}_s"] / c["bytes"]), 3)
                                  for c, e in zip(runs, engine_runs, strict=True)]
            for what in ("store", "retrieve")
        }
        out.append({
            "tier": "cpu", "op": f"vllm connector {op}", "kvtier_GBps": round(gbps, 3),
            "lmcache_GBps": None, "raw_GBps": raw[op], "raw": "torch copy into existing memory",
            "kvtier_vs_raw": round(gbps / raw[op], 3), "kvtier_vs_lmcache": None,
            "kvtier_bit_exact": all(run["bit_exact"] for run in runs), "lmcache_bit_exact": None,
            "vs_engine_restore": statistics.median(per_round["vs_engine_retrieve"]),
            "vs_engine_store": statistics.median(per_round["vs_engine_store"]),
            "round_ratios": per_round,
            "kvtier_notes": f"{runs[0]['blocks']} vLLM blocks of {runs[0]['block_bytes']} bytes "
                            f"([2, blocks, {VLLM_BLOCK}, heads, dim] per layer) in chunks of "
                            f"{runs[0]['chunk_blocks']} blocks",
        })
    return out
