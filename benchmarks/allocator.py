"""``kvtier bench allocator``: amortised cost of allocating and freeing KV blocks.

The block allocator runs on the scheduler's critical path every step, so its cost per block
must stay far below the cost of the attention it feeds. This measures it on
:class:`BlockPool` (batch and single-block, with and without prefix-cache eviction) and on
the block-manager path the engine uses (add/free a 4K-token sequence, decode-style append),
next to the physical floor for a Python free list: one bare ``list.pop()`` / ``append``
pair per element, timed in the same run so the ratio is machine-independent.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TARGET_NS_PER_BLOCK = 1000.0
"""The goal: under 1 µs per block for allocate + free in batch mode."""
BATCH_SIZES = (1, 16, 64, 256, 1024)
QUICK_BATCH_SIZES = (1, 64)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "allocator.json"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "allocator",
        help="time block allocation and freeing in the paged KV pool",
        description=(
            "Measure amortised ns per block allocated and freed by the paged pool's block "
            "allocator (batch, single-block, with prefix-cache eviction, and through the "
            "block manager) against a bare Python list.pop/append floor."
        ),
    )
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per case (median)")
    p.add_argument(
        "--blocks-per-sample",
        type=int,
        default=65536,
        help="blocks allocated and freed in one timed sample of a batch case",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument(
        "--quick", action="store_true", help="few repeats and small samples (smoke test)"
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON result file")
    p.set_defaults(func=run)


# ----------------------------------------------------------------------------- timing
def _median_ns(sample: Callable[[], tuple[int, int]], repeats: int) -> float:
    """Median over ``repeats`` of (elapsed ns / units) from ``sample() -> (ns, units)``,
    after one untimed warm-up sample. GC is off while timing so a collection does not land
    in one sample."""
    sample()
    per: list[float] = []
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            ns, units = sample()
            per.append(ns / units)
    finally:
        if gc_was:
            gc.enable()
    return statistics.median(per)


def _fake_hash(i: int) -> bytes:
    return i.to_bytes(32, "little")


def bench_reference(total: int, repeats: int) -> float:
    """ns per element for one ``list.pop()`` + ``list.append()`` pair: the floor for any
    free list kept in a Python list."""
    free = list(range(total))

    def sample() -> tuple[int, int]:
        pop, app = free.pop, free.append
        t0 = time.perf_counter_ns()
        for _ in range(total):
            app(pop())
        return time.perf_counter_ns() - t0, total

    return _median_ns(sample, repeats)


def bench_batch(n: int, blocks_per_sample: int, repeats: int, block_size: int) -> float:
    """allocate(n) then free(those n), steady state with empty blocks available."""
    from kvtier.gpu_pool.block_pool import BlockPool

    pool = BlockPool(max(4 * n, 64), block_size)
    iters = max(1, blocks_per_sample // n)

    def sample() -> tuple[int, int]:
        alloc, free = pool.allocate, pool.free
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            free(alloc(n))
        return time.perf_counter_ns() - t0, iters * n

    return _median_ns(sample, repeats)


def bench_single(count: int, repeats: int, block_size: int) -> float:
    """``count`` blocks allocated one call each, then freed one call each."""
    from kvtier.gpu_pool.block_pool import BlockPool

    pool = BlockPool(count, block_size)

    def sample() -> tuple[int, int]:
        alloc, free = pool.allocate, pool.free
        held: list[list[int]] = []
        hold = held.append
        t0 = time.perf_counter_ns()
        for _ in range(count):
            hold(alloc(1))
        for b in held:
            free(b)
        return time.perf_counter_ns() - t0, count

    return _median_ns(sample, repeats)


def _evictable_pool(num_blocks: int, block_size: int) -> Any:
    """A pool whose every block is free but holds cached content, so each allocation must
    evict (the worst case: prefix cache full, no empty block left)."""
    from kvtier.gpu_pool.block_pool import BlockPool

    pool = BlockPool(num_blocks, block_size)
    blocks = pool.allocate(num_blocks)
    for b in blocks:
        pool.cache_block(b, _fake_hash(b))
    pool.free(blocks)
    return pool


def bench_evict(n: int, blocks_per_sample: int, repeats: int, block_size: int) -> float:
    """allocate(n) evicting n cached blocks, then free them; the setup that refills the
    prefix cache between samples is not timed. ``n=1`` is the single-block evicting path."""
    iters = max(1, blocks_per_sample // n)
    total = iters * n

    def sample() -> tuple[int, int]:
        pool = _evictable_pool(total, block_size)
        alloc, free = pool.allocate, pool.free
        out: list[list[int]] = []
        keep = out.append
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            keep(alloc(n))
        for blocks in out:
            free(blocks)
        ns = time.perf_counter_ns() - t0
        assert pool.evictions == total and pool.num_free == total
        return ns, total

    return _median_ns(sample, repeats)


def bench_add_free(num_tokens: int, repeats: int, block_size: int, prefix_hit: bool) -> float:
    """KVBlockManager.add_sequence + free_sequence of one ``num_tokens`` sequence, ns per
    block. With ``prefix_hit`` every full block comes from the prefix cache."""
    from kvtier.gpu_pool.block_manager import KVBlockManager
    from kvtier.gpu_pool.block_pool import BlockPool

    nblocks = -(-num_tokens // block_size)
    mgr = KVBlockManager(BlockPool(2 * nblocks, block_size))
    tokens = [(7 * i + 3) % 32000 for i in range(num_tokens)]
    if prefix_hit:
        mgr.add_sequence("warm", tokens)
        mgr.mark_computed("warm")
        mgr.free_sequence("warm")
    iters = 20
    hits_per_add = (num_tokens // block_size) * block_size if prefix_hit else 0

    def sample() -> tuple[int, int]:
        add, free = mgr.add_sequence, mgr.free_sequence
        hits0 = mgr.prefix_hit_tokens
        t0 = time.perf_counter_ns()
        for i in range(iters):
            add(i, tokens)
            free(i)
        ns = time.perf_counter_ns() - t0
        assert mgr.prefix_hit_tokens - hits0 == iters * hits_per_add, "unexpected prefix hits"
        return ns, iters * nblocks

    return _median_ns(sample, repeats)


def bench_decode(num_tokens: int, repeats: int, block_size: int) -> tuple[float, float]:
    """Decode-style growth: append_tokens of one token ``num_tokens`` times (a new block
    every ``block_size`` tokens), then free. Returns (ns per token, ns per block)."""
    from kvtier.gpu_pool.block_manager import KVBlockManager
    from kvtier.gpu_pool.block_pool import BlockPool

    nblocks = -(-(num_tokens + 1) // block_size)
    mgr = KVBlockManager(BlockPool(nblocks + 1, block_size))
    one = [11]

    def sample() -> tuple[int, int]:
        mgr.add_sequence("d", one)
        append = mgr.append_tokens
        t0 = time.perf_counter_ns()
        for _ in range(num_tokens):
            append("d", one)
        mgr.free_sequence("d")
        return time.perf_counter_ns() - t0, num_tokens

    per_token = _median_ns(sample, repeats)
    return per_token, per_token * num_tokens / nblocks


# ------------------------------------------------------------------------------- run
def measure(repeats: int, blocks_per_sample: int, block_size: int, quick: bool) -> dict[str, Any]:
    """Every case of the suite; the payload written to JSON."""
    sizes = QUICK_BATCH_SIZES if quick else BATCH_SIZES
    ref = bench_reference(blocks_per_sample, repeats)
    batch = []
    for n in sizes:
        ns = bench_batch(n, blocks_per_sample, repeats, block_size)
        batch.append(
            {
                "n": n,
                "ns_per_block": ns,
                "ns_per_call": ns * n,
                "ratio_vs_ref": ns / ref,
                "meets_target": ns < TARGET_NS_PER_BLOCK,
            }
        )
    evict = []
    for n in sizes:
        ns = bench_evict(n, blocks_per_sample, repeats, block_size)
        evict.append({"n": n, "ns_per_block": ns, "ratio_vs_ref": ns / ref})
    worst = max(b["ns_per_block"] for b in batch)
    return {
        "config": {
            "repeats": repeats,
            "blocks_per_sample": blocks_per_sample,
            "block_size": block_size,
            "quick": quick,
            "batch_sizes": list(sizes),
            "statistic": "median over repeats after one warm-up; GC disabled while timing",
        },
        "target": {
            "criterion": "allocate(n) + free(n) in batch mode (no eviction), every n, "
            f"under {TARGET_NS_PER_BLOCK:.0f} ns per block",
            "ns_per_block": TARGET_NS_PER_BLOCK,
            "worst_batch_ns_per_block": worst,
            "met": worst < TARGET_NS_PER_BLOCK,
        },
        "reference": {
            "what": "one bare Python list.pop() + list.append() pair per element",
            "ns_per_element": ref,
        },
        "batch": batch,
        "batch_evict": evict,
        **_single_and_manager(repeats, blocks_per_sample, block_size, quick, ref),
    }


def _single_and_manager(repeats: int, blocks_per_sample: int, block_size: int, quick: bool,
                        ref: float) -> dict[str, Any]:
    """One block at a time, and the block manager's sequence operations."""
    single_count = min(blocks_per_sample, 16384)
    single = bench_single(single_count, repeats, block_size)
    single_evict = bench_evict(1, single_count, repeats, block_size)
    seq_tokens = 1024 if quick else 4096
    add_free = bench_add_free(seq_tokens, repeats, block_size, prefix_hit=False)
    add_free_hit = bench_add_free(seq_tokens, repeats, block_size, prefix_hit=True)
    decode_tok, decode_blk = bench_decode(seq_tokens, repeats, block_size)
    return {
        "single": {
            "blocks": single_count,
            "ns_per_block": single,
            "ratio_vs_ref": single / ref,
        },
        "single_evict": {
            "blocks": single_count,
            "ns_per_block": single_evict,
            "ratio_vs_ref": single_evict / ref,
        },
        "manager": {
            "sequence_tokens": seq_tokens,
            "add_free_ns_per_block": add_free,
            "add_free_prefix_hit_ns_per_block": add_free_hit,
            "decode_append_ns_per_token": decode_tok,
            "decode_append_ns_per_block": decode_blk,
        },
    }


def _table(payload: dict[str, Any]) -> Any:
    from rich.table import Table

    ref = payload["reference"]["ns_per_element"]
    t = Table(title="block allocator: ns per block (alloc + free), median")
    t.add_column("case")
    t.add_column("ns/block", justify="right")
    t.add_column("x ref", justify="right")
    t.add_column("< 1 µs", justify="center")

    def row(name: str, ns: float, judged: bool = False) -> None:
        mark = ("yes" if ns < TARGET_NS_PER_BLOCK else "NO") if judged else ""
        t.add_row(name, f"{ns:,.1f}", f"{ns / ref:.1f}", mark)

    row("reference list.pop+append", ref)
    for b in payload["batch"]:
        row(f"batch n={b['n']}", b["ns_per_block"], judged=True)
    for b in payload["batch_evict"]:
        row(f"batch n={b['n']}, evicting", b["ns_per_block"])
    row("single-block", payload["single"]["ns_per_block"])
    row("single-block, evicting", payload["single_evict"]["ns_per_block"])
    m = payload["manager"]
    k = m["sequence_tokens"]
    row(f"add+free {k}-token sequence", m["add_free_ns_per_block"])
    row(f"add+free {k}-token sequence, prefix hit", m["add_free_prefix_hit_ns_per_block"])
    row("decode append (per block)", m["decode_append_ns_per_block"])
    t.add_row("decode append (per token)", f"{m['decode_append_ns_per_token']:,.1f}", "", "")
    return t


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvtier.benchmarks.results import write_result
    from kvtier.errors import InvalidArgumentError

    repeats = 3 if args.quick else args.repeats
    per_sample = min(args.blocks_per_sample, 4096) if args.quick else args.blocks_per_sample
    if repeats < 1:
        raise InvalidArgumentError(f"--repeats must be >= 1, got {repeats}")
    if per_sample < max(QUICK_BATCH_SIZES if args.quick else BATCH_SIZES):
        raise InvalidArgumentError(
            f"--blocks-per-sample must be at least the largest batch size, got {per_sample}"
        )
    payload = measure(repeats, per_sample, args.block_size, args.quick)
    console = Console()
    console.print(_table(payload))
    target = payload["target"]
    verdict = "met" if target["met"] else "NOT met"
    console.print(
        f"target {target['criterion']}: {verdict} "
        f"(worst {target['worst_batch_ns_per_block']:.1f} ns/block)"
    )
    path = write_result(args.out, "allocator", payload)
    console.print(f"wrote {path}")
    return 0
