"""``kvtier bench kernels``: the pool kernels against the hardware and against a peer.

Decode attention is memory-bound, so its yardstick is bandwidth: KV bytes read per second
next to a plain device-to-device copy timed in the same run. Paging must cost next to
nothing, so paged decode and prefill are timed next to SDPA on the same K/V laid out
contiguously (and decode also next to our own kernel on a contiguous layout). Block
gather/scatter are copies, so they are held to the copy too.

On a GPU: CUDA events, warm-up, L2 flushed before every timed call, median of repeats,
Llama-3-8B-like shapes (32 query heads, 8 KV heads, head_dim 128, bf16, block 16). Without
one: a small CPU run of the torch reference (labelled CPU, written only with ``--out``).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TARGETS = {
    "decode_bw_vs_copy": 0.80,
    "paged_vs_contiguous_max_slowdown": 0.05,
    "gather_scatter_bw_vs_copy": 0.80,
}
"""GPU targets: decode >= 80 % of copy bandwidth at batch >= 32 and context >= 4K; paged
within 5 % of contiguous; gather/scatter >= 80 % of copy bandwidth."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "kernels",
        help="bandwidth and paging overhead of the pool's attention and copy kernels",
        description=(
            "Time paged decode and prefill attention and block gather/scatter against a "
            "device-to-device copy and against SDPA on contiguous K/V. On CPU, a small run "
            "of the torch reference."
        ),
    )
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: CUDA when present")
    p.add_argument("--quick", action="store_true", help="few small shapes (smoke test)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (median)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up calls")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON result file (default on GPU: benchmarks/results/"
                        "kernels-<gpu>.json; on CPU nothing is written unless given)")
    p.set_defaults(func=run)


# ------------------------------------------------------------------------------ shapes
def _plan(gpu: bool, quick: bool) -> dict[str, Any]:
    if gpu:
        model = {"num_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16",
                 "block_size": 16, "layers": 32}
        if quick:
            return {**model, "decode": [(1, 1024), (32, 4096)],
                    "prefill": [(1, 0, 1024), (2, 1024, 512)], "chunks": [256],
                    "repeats": 5, "warmup": 2}
        return {**model,
                "decode": [(b, c) for b in (1, 8, 32, 64) for c in (1024, 4096, 16384)],
                "prefill": [(1, 0, 4096), (4, 0, 1024), (4, 3072, 1024), (16, 2048, 128)],
                "chunks": [256, 2048], "repeats": 20, "warmup": 5}
    model = {"num_heads": 8, "kv_heads": 2, "head_dim": 64, "dtype": "float32",
             "block_size": 16, "layers": 4}
    if quick:
        return {**model, "decode": [(1, 256), (4, 512)], "prefill": [(1, 0, 128)],
                "chunks": [256], "repeats": 3, "warmup": 1}
    return {**model, "decode": [(b, c) for b in (1, 8) for c in (512, 2048)],
            "prefill": [(1, 0, 512), (2, 512, 256)], "chunks": [256, 1024],
            "repeats": 5, "warmup": 1}


# ------------------------------------------------------------------------------ timing
class Timer:
    """Median milliseconds of a call: CUDA events with an L2 flush before each call on GPU,
    perf_counter on CPU."""

    def __init__(self, device: Any, repeats: int, warmup: int):
        import torch

        self.torch = torch
        self.gpu = device.type == "cuda"
        self.repeats, self.warmup = max(1, repeats), max(0, warmup)
        # Bigger than any L2 (50 MB on H100): a call never finds its inputs still cached.
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if self.gpu else None

    def __call__(self, fn: Callable[[], Any]) -> float:
        for _ in range(self.warmup):
            fn()
        if not self.gpu:
            times = []
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        cuda = self.torch.cuda
        cuda.synchronize()
        events = []
        for _ in range(self.repeats):
            assert self.flush is not None
            self.flush.zero_()
            start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)


def _gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("inf")


def copy_bandwidth(timer: Timer, device: Any, nbytes: int) -> dict[str, float]:
    """Device-to-device copy: bytes read + written per second, the physical reference."""
    torch = timer.torch
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return {"bytes": nbytes, "ms": ms, "gbps": _gbps(2 * nbytes, ms)}


def matmul_throughput(timer: Timer, device: Any, dtype: str, n: int) -> dict[str, float]:
    """An ``n x n x n`` matrix product in the model's dtype: the chip's attainable TFLOP/s,
    the reference for the prefill kernel (random data: zeros run faster than real data)."""
    torch = timer.torch
    a = torch.randn(n, n, device=device).to(getattr(torch, dtype))
    b = torch.randn(n, n, device=device).to(a.dtype)
    ms = timer(lambda: a @ b)
    return {"n": n, "dtype": dtype, "ms": ms, "tflops": 2 * n**3 / ms / 1e9}


# ------------------------------------------------------------------------------- cases
def _sdpa(q: Any, k: Any, v: Any, **kw: Any) -> tuple[Any, str]:
    """SDPA with native GQA when torch has it, else KV heads repeated (noted in the result)."""
    import torch.nn.functional as F

    try:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw), "sdpa-gqa"
    except (TypeError, RuntimeError):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        return F.scaled_dot_product_attention(q, k, v, **kw), "sdpa-repeat-kv"


def _paged_pool(torch: Any, batch: int, ctx: int, plan: dict[str, Any], device: Any
                ) -> tuple[Any, Any, Any, Any]:
    """A pool layer holding ``batch`` sequences of ``ctx`` tokens in shuffled blocks, plus the
    same K/V contiguous ``[batch, 2, ctx, kv_heads, head_dim]``."""
    bs, hkv, d = plan["block_size"], plan["kv_heads"], plan["head_dim"]
    dtype = getattr(torch, plan["dtype"])
    per = -(-ctx // bs)
    contig = torch.randn(batch, 2, per * bs, hkv, d, device=device).to(dtype)
    ids = torch.randperm(batch * per, device=device)
    pool = torch.empty(batch * per, 2, bs, hkv, d, dtype=dtype, device=device)
    pool[ids] = contig.view(batch, 2, per, bs, hkv, d).transpose(1, 2).reshape(
        batch * per, 2, bs, hkv, d)
    tables = ids.view(batch, per).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return pool, tables, lens, contig[:, :, :ctx]


def bench_decode(timer: Timer, plan: dict[str, Any], device: Any, backend: str
                 ) -> list[dict[str, Any]]:
    from kvtier.gpu_pool.kernels import choose_num_splits, paged_decode_attention
    from kvtier.gpu_pool.kernels.dispatch import sm_count

    torch = timer.torch
    rows = []
    for batch, ctx in plan["decode"]:
        pool, tables, lens, contig = _paged_pool(torch, batch, ctx, plan, device)
        q = torch.randn(batch, plan["num_heads"], plan["head_dim"], device=device).to(pool.dtype)
        kv_bytes = contig.numel() * contig.element_size()
        paged_ms = timer(partial(paged_decode_attention, q, pool, tables, lens,
                                 backend=backend, max_context_len=ctx))
        row: dict[str, Any] = {
            "batch": batch, "context": ctx, "kv_bytes": kv_bytes, "paged_ms": paged_ms,
            "paged_gbps": _gbps(kv_bytes, paged_ms),
            # What the heuristic picks for the Triton kernel; the torch reference never splits.
            "num_splits": (choose_num_splits(batch, plan["kv_heads"], ctx, sm_count(device))
                           if backend == "triton" else None),
        }
        if ctx & (ctx - 1) == 0:
            # Our kernel on a contiguous layout: one block of ``ctx`` tokens per sequence.
            ident = torch.arange(batch, dtype=torch.int32, device=device)[:, None]
            row["contiguous_ms"] = timer(partial(paged_decode_attention, q, contig, ident, lens,
                                                 backend=backend, max_context_len=ctx))
        k, v = contig[:, 0].transpose(1, 2), contig[:, 1].transpose(1, 2)
        _, row["sdpa_kind"] = _sdpa(q[:, :, None], k, v)
        row["sdpa_ms"] = timer(partial(_sdpa, q[:, :, None], k, v))
        rows.append(row)
    return rows


def bench_prefill(timer: Timer, plan: dict[str, Any], device: Any, backend: str
                  ) -> list[dict[str, Any]]:
    from torch.nn.attention.bias import causal_lower_right

    from kvtier.gpu_pool.kernels import paged_prefill_attention

    torch = timer.torch
    rows = []
    for batch, prefix, new in plan["prefill"]:
        ctx = prefix + new
        pool, tables, lens, contig = _paged_pool(torch, batch, ctx, plan, device)
        q = torch.randn(batch * new, plan["num_heads"], plan["head_dim"], device=device)
        q = q.to(pool.dtype)
        cu = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * new
        paged_ms = timer(partial(paged_prefill_attention, q, pool, tables, lens, cu,
                                 max_seqlen_q=new, backend=backend))
        flops = 4 * batch * plan["num_heads"] * plan["head_dim"] * (new * prefix
                                                                   + new * (new + 1) / 2)
        row: dict[str, Any] = {"batch": batch, "prefix": prefix, "new_tokens": new,
                               "paged_ms": paged_ms, "paged_tflops": flops / paged_ms / 1e9}
        qs = q.view(batch, new, plan["num_heads"], -1).transpose(1, 2)
        k, v = contig[:, 0].transpose(1, 2), contig[:, 1].transpose(1, 2)
        kw: dict[str, Any] = ({"is_causal": True} if prefix == 0 else
                              {"attn_mask": causal_lower_right(new, ctx)})
        _, row["sdpa_kind"] = _sdpa(qs, k, v, **kw)
        row["sdpa_ms"] = timer(partial(_sdpa, qs, k, v, **kw))
        rows.append(row)
    return rows


def bench_blocks(timer: Timer, plan: dict[str, Any], device: Any, backend: str
                 ) -> list[dict[str, Any]]:
    from kvtier.gpu_pool.kernels import gather_blocks, scatter_blocks

    torch = timer.torch
    bs = plan["block_size"]
    most = max(plan["chunks"]) // bs
    num_blocks = 4 * most
    pool = torch.randn(plan["layers"], num_blocks, 2, bs, plan["kv_heads"], plan["head_dim"],
                       device=device).to(getattr(torch, plan["dtype"]))
    rows = []
    for tokens in plan["chunks"]:
        ids = torch.randperm(num_blocks, device=device)[: tokens // bs]
        buf = gather_blocks(pool, ids, backend=backend)
        nbytes = buf.numel() * buf.element_size()
        g_ms = timer(partial(gather_blocks, pool, ids, out=buf, backend=backend))
        s_ms = timer(partial(scatter_blocks, buf, pool, ids, backend=backend))
        rows.append({"tokens": tokens, "bytes": nbytes, "gather_ms": g_ms, "scatter_ms": s_ms,
                     "gather_gbps": _gbps(2 * nbytes, g_ms),
                     "scatter_gbps": _gbps(2 * nbytes, s_ms)})
    return rows


def bench_codec_scatter(timer: Timer, plan: dict[str, Any], device: Any, backend: str
                        ) -> list[dict[str, Any]]:
    """A compressed chunk decoded into pool blocks (the device side of a lossy restore),
    per codec: KV written per second and the bytes read + written, next to the copy."""
    from kvtier.gpu_pool.kernels.api import scatter_decoded
    from kvtier.kv_codecs import Codec, encode

    torch = timer.torch
    bs, tokens = plan["block_size"], min(plan["chunks"])
    dtype = getattr(torch, plan["dtype"])
    shape = (plan["layers"], 2, tokens, plan["kv_heads"], plan["head_dim"])
    kv = torch.randn(shape).to(dtype)
    pool = torch.zeros(plan["layers"], 2 * tokens // bs, 2, bs, plan["kv_heads"],
                       plan["head_dim"], dtype=dtype, device=device)
    ids = torch.randperm(2 * tokens // bs, device=device)[: tokens // bs]
    status = torch.zeros(1, dtype=torch.int32, device=device)
    kv_bytes = kv.numel() * kv.element_size()
    rows = []
    for codec in (Codec.FP8, Codec.INT8, Codec.INT4):
        payload = torch.cat([encode(kv[i : i + 1], codec) for i in range(shape[0])]).to(device)
        ms = timer(partial(scatter_decoded, payload, codec, pool, ids, tokens=tokens,
                           status=status, backend=backend))
        rows.append({"codec": codec.value, "tokens": tokens, "kv_bytes": kv_bytes,
                     "stored_bytes": payload.numel(), "ms": ms,
                     "kv_gbps": _gbps(kv_bytes, ms),
                     "gbps": _gbps(kv_bytes + payload.numel(), ms)})
    if int(status.item()):
        raise RuntimeError("the codec bench's own chunks did not decode")
    return rows


# ----------------------------------------------------------------------------- verdicts
def summarise(payload: dict[str, Any]) -> dict[str, Any]:
    """Ratios next to their targets; targets judged only on a GPU."""
    copy = payload["copy"]["gbps"]
    for r in payload["decode"]:
        r["bw_vs_copy"] = r["paged_gbps"] / copy
        if "sdpa_ms" in r:
            r["paged_over_sdpa"] = r["paged_ms"] / r["sdpa_ms"]
        if "contiguous_ms" in r:
            r["paged_over_contiguous"] = r["paged_ms"] / r["contiguous_ms"]
    matmul = payload.get("matmul", {}).get("tflops")
    for r in payload["prefill"]:
        if "sdpa_ms" in r:
            r["paged_over_sdpa"] = r["paged_ms"] / r["sdpa_ms"]
        if matmul:
            r["tflops_vs_matmul"] = r["paged_tflops"] / matmul
    for r in payload["gather_scatter"]:
        r["gather_vs_copy"] = r["gather_gbps"] / copy
        r["scatter_vs_copy"] = r["scatter_gbps"] / copy
    for r in payload.get("codec_scatter", []):
        r["vs_copy"] = r["gbps"] / copy
    big = [r for r in payload["decode"] if r["batch"] >= 32 and r["context"] >= 4096]
    attn = [r for r in payload["decode"] + payload["prefill"] if "paged_over_sdpa" in r]
    longest = max((r["context"] for r in payload["decode"]), default=0)
    checks: dict[str, Any] = {
        "decode_bw_vs_copy_min": min((r["bw_vs_copy"] for r in big), default=None),
        "decode_bw_vs_copy_longest_context_max": max(
            (r["bw_vs_copy"] for r in payload["decode"] if r["context"] == longest),
            default=None),
        "prefill_tflops_vs_matmul_max": max(
            (r["tflops_vs_matmul"] for r in payload["prefill"] if "tflops_vs_matmul" in r),
            default=None),
        "paged_over_sdpa_max": max((r["paged_over_sdpa"] for r in attn), default=None),
        "gather_scatter_vs_copy_min": min(
            (min(r["gather_vs_copy"], r["scatter_vs_copy"]) for r in payload["gather_scatter"]),
            default=None),
    }
    gpu = payload["device"] == "cuda"

    def met(value: float | None, ok: Callable[[float], bool]) -> bool | None:
        return None if value is None or not gpu else bool(ok(value))

    checks["met"] = {
        "decode_bw_vs_copy": met(checks["decode_bw_vs_copy_min"],
                                 lambda x: x >= TARGETS["decode_bw_vs_copy"]),
        "paged_vs_contiguous": met(
            checks["paged_over_sdpa_max"],
            lambda x: x <= 1 + TARGETS["paged_vs_contiguous_max_slowdown"]),
        "gather_scatter_bw_vs_copy": met(checks["gather_scatter_vs_copy_min"],
                                         lambda x: x >= TARGETS["gather_scatter_bw_vs_copy"]),
    }
    return checks


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(payload: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if Console().is_terminal else Console(width=150)
    label = payload["device_name"] + (" (CPU: torch reference, small shapes; GPU targets "
                                      "not judged)" if payload["device"] == "cpu" else "")
    console.print(f"kernels on {label}; copy bandwidth {payload['copy']['gbps']:.1f} GB/s")
    t = Table(title="paged decode attention")
    for col in ("batch", "context", "ms", "GB/s", "vs copy", "splits", "vs SDPA",
                "vs contiguous"):
        t.add_column(col, justify="right")
    for r in payload["decode"]:
        t.add_row(str(r["batch"]), str(r["context"]), _fmt(r["paged_ms"], ".3f"),
                  _fmt(r["paged_gbps"], ".1f"), _fmt(r["bw_vs_copy"]), _fmt(r["num_splits"], "d"),
                  _fmt(r.get("paged_over_sdpa")), _fmt(r.get("paged_over_contiguous")))
    console.print(t)
    mm = payload.get("matmul")
    t = Table(title="paged prefill attention" + (
        f" (vs matmul: x the {mm['n']}^3 {mm['dtype']} product, {mm['tflops']:.1f} TFLOP/s)"
        if mm else ""))
    for col in ("batch", "prefix", "new", "ms", "TFLOP/s", "vs matmul", "vs SDPA"):
        t.add_column(col, justify="right")
    for r in payload["prefill"]:
        t.add_row(str(r["batch"]), str(r["prefix"]), str(r["new_tokens"]),
                  _fmt(r["paged_ms"], ".3f"), _fmt(r["paged_tflops"]),
                  _fmt(r.get("tflops_vs_matmul")), _fmt(r.get("paged_over_sdpa")))
    console.print(t)
    t = Table(title="block gather / scatter (all layers, one launch)")
    for col in ("tokens", "MiB", "gather GB/s", "vs copy", "scatter GB/s", "vs copy"):
        t.add_column(col, justify="right")
    for r in payload["gather_scatter"]:
        t.add_row(str(r["tokens"]), _fmt(r["bytes"] / 2**20, ".1f"),
                  _fmt(r["gather_gbps"], ".1f"), _fmt(r["gather_vs_copy"]),
                  _fmt(r["scatter_gbps"], ".1f"), _fmt(r["scatter_vs_copy"]))
    console.print(t)
    t = Table(title="compressed chunk decoded into blocks (a lossy restore's device side)")
    for col in ("codec", "tokens", "KV MiB", "KV GB/s", "read+write GB/s", "vs copy"):
        t.add_column(col, justify="right")
    for r in payload.get("codec_scatter", []):
        t.add_row(r["codec"], str(r["tokens"]), _fmt(r["kv_bytes"] / 2**20, ".1f"),
                  _fmt(r["kv_gbps"], ".1f"), _fmt(r["gbps"], ".1f"), _fmt(r.get("vs_copy")))
    console.print(t)
    s = payload["summary"]
    console.print(
        f"targets: decode >= {TARGETS['decode_bw_vs_copy']:.0%} of copy at batch>=32, ctx>=4K "
        f"(worst {_fmt(s['decode_bw_vs_copy_min'])}, met {s['met']['decode_bw_vs_copy']}); "
        f"paged <= {1 + TARGETS['paged_vs_contiguous_max_slowdown']:.2f}x contiguous SDPA "
        f"(worst {_fmt(s['paged_over_sdpa_max'])}, met {s['met']['paged_vs_contiguous']}); "
        f"gather/scatter >= {TARGETS['gather_scatter_bw_vs_copy']:.0%} of copy (worst "
        f"{_fmt(s['gather_scatter_vs_copy_min'])}, met {s['met']['gather_scatter_bw_vs_copy']})"
    )


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def run(args: argparse.Namespace) -> int:
    import torch

    from kvtier.benchmarks.results import write_result
    from kvtier.errors import InvalidArgumentError

    if args.device == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError("--device cuda asked for but CUDA is not available; "
                                   "use --device cpu or auto")
    gpu = args.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    plan = _plan(gpu, args.quick)
    timer = Timer(device, args.repeats or plan["repeats"], args.warmup
                  if args.warmup is not None else plan["warmup"])
    backend = "triton" if gpu else "torch"
    payload: dict[str, Any] = {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if gpu else "CPU",
        "backend": backend,
        "quick": bool(args.quick),
        "shapes": {k: plan[k] for k in ("num_heads", "kv_heads", "head_dim", "dtype",
                                        "block_size", "layers")},
        "timing": {"repeats": timer.repeats, "warmup": timer.warmup,
                   "statistic": "median", "l2_flush": gpu},
        "targets": TARGETS,
        "copy": copy_bandwidth(timer, device, (1 << 30) if gpu else (64 << 20)),
        "matmul": matmul_throughput(timer, device, plan["dtype"], 8192 if gpu else 256),
        "decode": bench_decode(timer, plan, device, backend),
        "prefill": bench_prefill(timer, plan, device, backend),
        "gather_scatter": bench_blocks(timer, plan, device, backend),
        "codec_scatter": bench_codec_scatter(timer, plan, device, backend),
    }
    payload["summary"] = summarise(payload)
    print_report(payload)
    out = args.out
    if out is None and gpu:
        out = RESULTS_DIR / f"kernels-{_slug(payload['device_name'])}.json"
    if out is not None:
        print(f"wrote {write_result(out, 'kernels', payload)}")
    return 0
