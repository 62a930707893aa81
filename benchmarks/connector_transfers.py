"""``kvtier bench connector``: the vLLM connector's worker moving vLLM's caches to and from
kvtier's CPU tier, against the plain pinned copy of the same bytes in the same run.

vLLM's per-layer cache tensors (FlashAttention's ``[2, blocks, block, kv_heads, head_dim]``
or ``[blocks, 2, ...]``) are made on ``--device`` and filled with random KV; the worker saves
``--chunks`` chunks of ``--chunk-blocks`` blocks into a CPU tier (pinned on CUDA; keeping
chunks compressed for a lossy ``--codecs`` entry) and loads them back into other blocks,
synchronously (as ``start_load_kv``) and on the loading thread (vLLM's async loads). Per
codec: the time a save holds the forward path (submitting it), the KV saved and loaded per
second (decoded bytes), each as a ratio to ``copy_`` between a ``pin_memory`` tensor and
the device of all those bytes at once (``d2h``/``h2d``); exact chunks are checked bit for
bit. Rounds interleave the codecs; medians are reported.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CODECS = ("none", "fp8", "int8", "int4")


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    chunk_blocks: int
    chunks: int
    kv_first: bool
    """FlashAttention's ``[2, blocks, ...]`` layout (else ``[blocks, 2, ...]``)."""

    @property
    def blocks(self) -> int:
        return self.chunks * self.chunk_blocks


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "connector",
        help="the vLLM connector's saves and loads of vLLM's caches vs the pinned copy",
        description="Save vLLM-layout caches through the connector's worker into the CPU "
        "tier and load them back (sync and async), per codec, against copy_ of the same "
        "bytes between pinned memory and the device, same run.",
    )
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--shape", default=None,
                   help="layers,kv_heads,head_dim (default GPU 32,8,128: Llama-3-8B; CPU 4,2,64)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-blocks", type=int, default=16, help="blocks per chunk (256 tokens)")
    p.add_argument("--chunks", type=int, default=None, help="chunks a round (GPU 16, CPU 4)")
    p.add_argument("--layout", choices=("kv-first", "blocks-first"), default="kv-first")
    p.add_argument("--codecs", default=",".join(CODECS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="JSON result file")
    p.set_defaults(func=run)


class _Bench:
    """One cache pair and a CPU tier sized for a round; the worker per codec."""

    def __init__(self, shape: Shape, dtype: Any, device: Any) -> None:
        import torch

        from kvtier.chunk_format import max_chunk_bytes
        from kvtier.connectors.vllm_blocks import ChunkGrid

        self.torch, self.shape, self.device = torch, shape, device
        s = shape
        dims = ((2, 2 * s.blocks) if s.kv_first else (2 * s.blocks, 2)) + (
            s.block_size, s.kv_heads, s.head_dim)
        g = torch.Generator(device=device).manual_seed(0)
        self.caches = {f"model.layers.{i}.self_attn": torch.randn(
            dims, generator=g, device=device, dtype=torch.float32).to(dtype) for i in range(s.layers)}
        self.grid = ChunkGrid(s.block_size, s.chunk_blocks, b"bench-connector")
        block = 2 * s.block_size * s.kv_heads * s.head_dim * self.caches["model.layers.0.self_attn"].element_size()
        self.kv_bytes = s.layers * block * s.blocks
        self.slot = max_chunk_bytes(s.layers, s.layers * block * s.chunk_blocks)
        tokens = list(range(s.blocks * s.block_size))
        self.keys = [k.key for k in self.grid.keys(tokens)]

    def transfers(self, first_block: int, req: str) -> list[Any]:
        from kvtier.connectors.vllm_blocks import ChunkSpan, ChunkTransfer

        per = self.shape.chunk_blocks
        return [ChunkTransfer(req, [ChunkSpan(k, tuple(range(first_block + i * per,
                                                                first_block + (i + 1) * per)))
                                    for i, k in enumerate(self.keys)])]

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def round(self, codec: str) -> dict[str, float]:
        """One save and two loads (sync, async) through a fresh CPU tier of ``codec``."""
        from kvtier.connectors.chunk_store import LocalChunkStore
        from kvtier.connectors.tiers.cpu_tier import CPUTier
        from kvtier.connectors.tiers.manager import TierManager
        from kvtier.connectors.vllm_worker import WorkerSide
        from kvtier.kv_codecs import Codec

        cpu = CPUTier(self.shape.chunks * self.slot, self.slot)
        cpu.codec = Codec(codec)
        store = LocalChunkStore(TierManager([cpu]))
        worker = WorkerSide(lambda: store, self.grid, background=True, async_loads=True)
        worker.register(self.caches, 2 * self.shape.blocks)
        n = self.shape.blocks
        try:
            self.sync()
            t0 = time.perf_counter()
            worker.save(self.transfers(0, "save"))
            submit = time.perf_counter() - t0
            worker.wait_saves()
            saved = time.perf_counter() - t0
            if worker.stats.saved_blocks != n:
                raise RuntimeError(f"{codec}: saved {worker.stats.saved_blocks} of {n} blocks")
            t0 = time.perf_counter()
            worker.load(self.transfers(n, "load"))
            self.sync()
            loaded = time.perf_counter() - t0
            self._check_loaded(worker, codec)
            t0 = time.perf_counter()
            worker.load_async(self.transfers(n, "async"))
            while worker.finished_loading() != {"async"}:
                if time.perf_counter() - t0 > 120:
                    raise RuntimeError(f"{codec}: the async load never finished")
                time.sleep(0.0002)
            async_loaded = time.perf_counter() - t0
            self._check_loaded(worker, codec)
            return {"save_submit_s": submit, "save_s": saved, "load_s": loaded,
                    "async_load_s": async_loaded, "cpu_pinned": float(cpu.pinned)}
        finally:
            worker.close()
            store.manager.close()

    def _check_loaded(self, worker: Any, codec: str) -> None:
        torch, n = self.torch, self.shape.blocks
        if worker.take_load_errors():
            raise RuntimeError(f"{codec}: load errors")
        dim = 1 if self.shape.kv_first else 0
        for kv in self.caches.values():
            src, dst = kv.narrow(dim, 0, n), kv.narrow(dim, n, n)
            same = torch.equal(src, dst) if codec == "none" else torch.allclose(
                src.float(), dst.float(), atol=0.5, rtol=0.25)
            if not same:
                raise RuntimeError(f"{codec}: the loaded blocks are not what was saved")
            dst.zero_()

    def pinned_copies(self, repeats: int = 5) -> dict[str, float]:
        """Seconds of copy_ of the round's KV bytes between pinned memory and the device."""
        torch = self.torch
        gpu = self.device.type == "cuda"
        host = torch.empty(self.kv_bytes, dtype=torch.uint8, pin_memory=gpu)
        dev = torch.empty(self.kv_bytes, dtype=torch.uint8, device=self.device)
        out = {}
        for name, (dst, src) in {"d2h_s": (host, dev), "h2d_s": (dev, host)}.items():
            samples = []
            for _ in range(repeats + 1):
                self.sync()
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                self.sync()
                samples.append(time.perf_counter() - t0)
            out[name] = statistics.median(samples[1:])
        return out


def measure(shape: Shape, dtype: Any, device: Any, codecs: list[str], rounds: int
            ) -> dict[str, Any]:
    bench = _Bench(shape, dtype, device)
    times: dict[str, list[dict[str, float]]] = {c: [] for c in codecs}
    copies = []
    for _ in range(rounds):
        copies.append(bench.pinned_copies())
        for codec in codecs:
            times[codec].append(bench.round(codec))
    ref = {k: statistics.median(c[k] for c in copies) for k in ("d2h_s", "h2d_s")}
    gbps = bench.kv_bytes / 1e9
    rows = []
    for codec, samples in times.items():
        med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
        rows.append({
            "codec": codec,
            "save_submit_ms": med["save_submit_s"] * 1e3,
            "save_GBps": gbps / med["save_s"],
            "save_vs_d2h": ref["d2h_s"] / med["save_s"],
            "load_GBps": gbps / med["load_s"],
            "load_vs_h2d": ref["h2d_s"] / med["load_s"],
            "async_load_GBps": gbps / med["async_load_s"],
            "async_load_vs_h2d": ref["h2d_s"] / med["async_load_s"],
            "cpu_tier_pinned": bool(med["cpu_pinned"]),
        })
    return {"kv_bytes": bench.kv_bytes, "d2h_GBps": gbps / ref["d2h_s"],
            "h2d_GBps": gbps / ref["h2d_s"], "rows": rows}


def print_report(payload: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if Console().is_terminal else Console(width=140)
    t = Table(title=f"vLLM connector <-> CPU tier on {payload['device_name']}: "
              f"{payload['kv_bytes'] / 2**20:.0f} MiB of KV a round (GB/s of KV; x = over "
              f"the pinned copy: D2H {payload['d2h_GBps']:.1f}, H2D {payload['h2d_GBps']:.1f} GB/s)",
              title_justify="left")
    for col in ("codec", "save submit ms", "save", "x D2H", "load", "x H2D", "async load", "x H2D"):
        t.add_column(col, justify="right")
    for r in payload["rows"]:
        t.add_row(r["codec"], f"{r['save_submit_ms']:.2f}", f"{r['save_GBps']:.2f}",
                  f"{r['save_vs_d2h']:.2f}", f"{r['load_GBps']:.2f}", f"{r['load_vs_h2d']:.2f}",
                  f"{r['async_load_GBps']:.2f}", f"{r['async_load_vs_h2d']:.2f}")
    console.print(t)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvtier.benchmarks.machine import bench_device
    from kvtier.benchmarks.results import write_result
    from kvtier.errors import InvalidArgumentError

    device = bench_device(args.device)
    gpu = device.type == "cuda"
    try:
        layers, heads, dim = (int(x) for x in (args.shape or ("32,8,128" if gpu else "4,2,64")).split(","))
    except ValueError as exc:
        raise InvalidArgumentError(f"--shape must be layers,kv_heads,head_dim: {args.shape!r}") from exc
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    if not codecs or any(c not in CODECS for c in codecs):
        raise InvalidArgumentError(f"--codecs must name some of {', '.join(CODECS)}")
    shape = Shape(layers, heads, dim, args.block_size, args.chunk_blocks,
                  args.chunks or (16 if gpu else 4), args.layout == "kv-first")
    if min(layers, heads, dim, shape.block_size, shape.chunk_blocks, shape.chunks, args.rounds) < 1:
        raise InvalidArgumentError("--shape, --block-size, --chunk-blocks, --chunks and --rounds "
                                   "must be positive")
    payload: dict[str, Any] = {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if gpu else "CPU",
        "shape": {**shape.__dict__, "dtype": args.dtype},
        "rounds": args.rounds,
        **measure(shape, getattr(torch, args.dtype), device, codecs, args.rounds),
    }
    print_report(payload)
    if args.out:
        print(f"wrote {write_result(args.out, 'connector', payload)}")
    return 0
