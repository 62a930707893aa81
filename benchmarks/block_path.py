"""``kvtier bench block-path``: the restore profile of the one block path, against the
physical copy of the same bytes in the same run.

A CPU tier (its arena pinned on CUDA) holds ``--gib`` of chunks of ``--chunk-tokens``
tokens of one model's KV (32 MiB a chunk at Llama-3.1-8B's 32,8,128 in bf16); a pool
``[layers, blocks, 2, 16, heads, dim]`` on the device has room for all of them, each chunk's
blocks at places drawn once at random. Each round, interleaved:

- ``h2d``: one ``copy_`` of all those bytes from a pinned host tensor into an existing
  device tensor (the reference), and ``h2d_chunks``: the same bytes as one copy per chunk,
  back to back;
- ``restore``: every chunk leased from the tier (``TierManager.lease_chunks``) and moved
  into the pool by :func:`kvtier.transfer.block_path.scatter` (staged on the device,
  checked there, scattered);
- the restore's device phases, each alone: ``staging`` (the leased chunks' stored bytes
  copied to the device back to back), ``hash`` (the check launches over those bytes, a
  window of chunks a call as the restore makes them, bounds checked on the host),
  ``scatter`` (one window's pieces moved into the pool by one launch,
  its address tables' copies included);
- ``d2h``: one ``copy_`` of all the bytes from the device into pinned memory (the
  reference), and ``save``: every chunk's blocks gathered out of the pool into that same
  pinned memory by :func:`kvtier.transfer.block_path.gather` (gathered and hashed on the
  device, then one copy a chunk).

A warm-up round first (Triton's compiles, first touches of memory) checks, off the clock,
that the pool holds every chunk bit for bit after the restore, that the hash launches
found every layer sound, and that the saved bytes and sums are the stored ones. Copies,
restores and saves are timed on the wall clock between device synchronisations; the
phases with CUDA events (on a CPU, the wall clock). Each round's ratios use that round's
references; the top level holds their medians, with min and max beside them.

On a CPU the run is tiny (CI's dry run of the GPU kit covers it): the block path takes
its host route, or with ``--device-copies`` its device route under Triton's interpreter
(``TRITON_INTERPRET=1``). The host route has no device phases (they are null).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BLOCK = 16
"""The pool's block size in tokens."""
FP = b"bench-block-path"
PAGE = 4096
GPU_SHAPE = "32,8,128"
CPU_SHAPE = "2,2,32"
GPU_GIB = 4.0
CPU_CHUNKS = 4
"""Chunks on a CPU without ``--gib``: a few, so that the interpreter's run stays short."""
TIMED = ("h2d", "h2d_chunks", "restore", "staging", "hash", "scatter", "d2h", "save")
"""What a round times (``<name>_s``); ``scatter`` moves one window, the others every byte."""
RATIOS = {"restore_vs_h2d": ("h2d", "restore"), "save_vs_d2h": ("d2h", "save")}
"""Each ratio: (reference, measured); reference seconds over measured seconds."""


@dataclass(frozen=True)
class Setup:
    layers: int
    kv_heads: int
    head_dim: int
    chunk_tokens: int
    dtype: str
    chunks: int
    rounds: int
    device_copies: bool
    """The block path's device route on a host pool (Triton's interpreter on a CPU)."""

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.chunk_tokens, self.kv_heads, self.head_dim)

    def chunk_bytes(self, itemsize: int) -> int:
        return 2 * self.layers * self.chunk_tokens * self.kv_heads * self.head_dim * itemsize

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // BLOCK


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "block-path",
        help="restores and saves through the block path vs the pinned copy of the same bytes",
        description="Lease chunks from a CPU tier and scatter them into a device pool "
        "through the block path (and gather them back out), against copy_ of the same "
        "bytes between pinned memory and the device, same run; the device phases (staging, "
        "hash, scatter) each alone.",
    )
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--shape", default=None, help="layers,kv_heads,head_dim (default GPU "
                   f"{GPU_SHAPE}: Llama-3.1-8B; CPU {CPU_SHAPE})")
    p.add_argument("--chunk-tokens", type=int, default=256,
                   help=f"tokens a chunk (a multiple of the pool's {BLOCK}-token blocks)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--gib", type=float, default=None,
                   help=f"GiB of chunks restored a round (default GPU {GPU_GIB:g}; CPU "
                   f"{CPU_CHUNKS} chunks)")
    p.add_argument("--chunks", type=int, default=None,
                   help="chunks restored a round (instead of --gib)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device-copies", action="store_true",
                   help="on a CPU: the block path's device route (needs TRITON_INTERPRET=1)")
    p.add_argument("--out", type=Path, default=None, help="JSON result file")
    p.set_defaults(func=run)


# ------------------------------------------------------------------------------ checks
def int_view(dtype: Any) -> Any:
    """The integer dtype of ``dtype``'s size: bits compared as bits (NaN equals itself)."""
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]


def check_pool(pool: Any, stored: Any, spans: list[Any], shape: tuple[int, ...]) -> None:
    """Raises RuntimeError unless each chunk's blocks in ``pool`` hold its stored bytes
    (``stored``: the chunks' payloads back to back, on the pool's device)."""
    import torch

    layers, _, tokens, heads, dim = shape
    bits = int_view(pool.dtype)
    words = pool.view(bits)
    per = stored.numel() // len(spans)
    for i, span in enumerate(spans):
        want = stored[i * per : (i + 1) * per].view(bits).view(
            layers, 2, tokens // BLOCK, BLOCK, heads, dim).transpose(1, 2)
        got = words[:, list(span.blocks)]
        if not torch.equal(got, want):
            raise RuntimeError(f"chunk {i}: the pool's blocks after the restore are not its "
                               "stored bytes")


def check_saved(saved: Any, stored: Any, sums: list[tuple[int, ...]],
                expected: list[tuple[int, ...]]) -> None:
    """Raises RuntimeError unless the gathered bytes and each layer's sum are the stored
    ones."""
    import torch

    if not torch.equal(saved, stored):
        raise RuntimeError("the saved bytes are not the stored chunks")
    for i, (got, want) in enumerate(zip(sums, expected, strict=True)):
        if tuple(got) != tuple(want):
            raise RuntimeError(f"chunk {i}: the save's layer sums are not the stored ones")


# ------------------------------------------------------------------------------ bench
def windows(chunks: int, chunk_bytes: int, window_bytes: int) -> list[tuple[int, int]]:
    """The restore's windows over chunks of one size: as many as fit ``window_bytes``, at
    least one each (as :mod:`kvtier.transfer.block_path.device_copies` cuts them)."""
    per = max(1, window_bytes // chunk_bytes)
    return [(a, min(a + per, chunks)) for a in range(0, chunks, per)]


class _Bench:
    """The tier full of chunks, the pool, the reference buffers and one round's timings."""

    def __init__(self, setup: Setup, device: Any) -> None:
        import torch

        from kvtier.transfer.block_path import BlockSpan, CacheBlocks, device_copies

        self.torch, self.setup, self.device = torch, setup, device
        self.gpu = device.type == "cuda"
        self.dtype = getattr(torch, setup.dtype)
        self.chunk_bytes = setup.chunk_bytes(self.dtype.itemsize)
        self.total = setup.chunks * self.chunk_bytes
        self.host_ref = torch.empty(self.total, dtype=torch.uint8, pin_memory=self.gpu)
        self.host_save = torch.empty(self.total, dtype=torch.uint8, pin_memory=self.gpu)
        self.dev_ref = torch.empty(self.total, dtype=torch.uint8, device=device)
        gen = torch.Generator(device=device).manual_seed(0)
        self.dev_ref.view(self.dtype).normal_(generator=gen)
        self.host_ref.copy_(self.dev_ref)
        blocks = setup.chunks * setup.blocks_per_chunk
        self.pool = torch.zeros((setup.layers, blocks, 2, BLOCK, setup.kv_heads, setup.head_dim),
                                dtype=self.dtype, device=device)
        self.cache = CacheBlocks.of_pool(self.pool, on_device=True if setup.device_copies else None)
        order = torch.randperm(blocks, generator=torch.Generator().manual_seed(1)).tolist()
        per = setup.blocks_per_chunk
        self.spans = [BlockSpan.of(order[i * per : (i + 1) * per]) for i in range(setup.chunks)]
        self.keys = [f"{i:040x}" for i in range(setup.chunks)]
        self._fill_tier()
        self.window_ranges = windows(setup.chunks, self.chunk_bytes, device_copies.WINDOW_BYTES)
        self._hash_tables = [self._hash_table(a, b) for a, b in self.window_ranges]
        a, b = self.window_ranges[0]
        self.scatter_bytes = (b - a) * self.chunk_bytes
        self._pieces = self._window_pieces(a, b)

    # -- setup
    def _fill_tier(self) -> None:
        """The chunks stored in a CPU tier of exactly their size, from ``host_ref``."""
        from kvtier.chunk_format import chunk_layout, encode_into, max_chunk_bytes
        from kvtier.connectors.tiers.base import ChunkWrite
        from kvtier.connectors.tiers.cpu_tier import CPUTier
        from kvtier.connectors.tiers.manager import TierManager

        s = self.setup
        unit = -(-max_chunk_bytes(s.layers, self.chunk_bytes) // PAGE) * PAGE
        self.tier = CPUTier(s.chunks * unit, unit)
        self.manager = TierManager([self.tier], fingerprint=FP, promote_on_hit=False)
        shape, dtype = s.chunk_shape, self.dtype

        def write(i: int, key: str) -> ChunkWrite:
            src = self.payload(self.host_ref, i).view(dtype).view(shape)

            def fill(dest: Any) -> int:
                return encode_into(dest, key, FP, dtype, shape, lambda kv: kv.copy_(src))

            return ChunkWrite(key, chunk_layout(key, FP, dtype, shape)[1], fill=fill)

        report = self.manager.store([write(i, k) for i, k in enumerate(self.keys)])
        if not report.ok:
            raise RuntimeError(f"the CPU tier did not take the chunks: {report.failed}")
        with self.leased() as lent:
            self.expected_sums = [tuple(c.header.layer_checksums) for c in lent]

    def payload(self, buf: Any, i: int) -> Any:
        return buf[i * self.chunk_bytes : (i + 1) * self.chunk_bytes]

    def _hash_table(self, a: int, b: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """One window's check call, as the restore makes it: the window's bytes (a view of
        ``dev_ref``, as large as a staging buffer), device tables of every layer's start in
        it, length and stored sum, the flags it writes; and the host copies of the starts
        and lengths (its bounds checked on them: nothing read back)."""
        import numpy as np

        torch, layers = self.torch, self.setup.layers
        step = self.chunk_bytes // layers
        starts = np.concatenate([i * self.chunk_bytes + np.arange(layers, dtype=np.int64) * step
                                 for i in range(b - a)])
        lengths = np.full(len(starts), step, dtype=np.int64)
        sums = np.array([self.expected_sums[i] for i in range(a, b)], dtype=np.uint64).reshape(-1)
        on = [torch.from_numpy(x).to(self.device) for x in (starts, lengths, sums.view(np.int64))]
        window = self.dev_ref[a * self.chunk_bytes : b * self.chunk_bytes]
        bad = torch.zeros(len(starts), dtype=torch.int32, device=self.device)
        return (window, *on, bad), {"host_ranges": (starts, lengths)}

    def _window_pieces(self, a: int, b: int) -> tuple[Any, Any, Any]:
        """One window's pieces (source in ``dev_ref``, destination in the pool, length), as
        the restore's scatter launch takes them."""
        import numpy as np

        from kvtier.transfer.block_path.pieces import chunk_pieces

        s = self.setup
        plans = [chunk_pieces(self.cache, self.spans[i], s.chunk_tokens, 0, s.layers)
                 for i in range(a, b)]
        base = self.dev_ref.data_ptr()
        srcs = np.concatenate([np.uint64(base + i * self.chunk_bytes) + p.offsets.reshape(-1)
                               for i, p in zip(range(a, b), plans, strict=True)])
        dsts = np.concatenate([p.cache.reshape(-1) for p in plans])
        lens = np.concatenate([p.lens.reshape(-1) for p in plans])
        return srcs, dsts, lens

    @property
    def route(self) -> str:
        return "device" if self.cache.on_device else "host"

    @contextlib.contextmanager
    def leased(self) -> Iterator[list[Any]]:
        """Every chunk leased; a missing one is an error."""
        with self.manager.lease_chunks(self.keys) as lent:
            if any(c is None for c in lent):
                raise RuntimeError("a chunk left the CPU tier")
            yield lent

    def close(self) -> None:
        self.manager.close()

    # -- timing
    def sync(self) -> None:
        if self.gpu:
            self.torch.cuda.synchronize(self.device)

    def timed(self, work: Callable[[], Any]) -> tuple[float, Any]:
        """Wall seconds of ``work`` between device synchronisations, and what it returned."""
        self.sync()
        t0 = time.perf_counter()
        got = work()
        self.sync()
        return time.perf_counter() - t0, got

    def phase(self, work: Callable[[], Any]) -> float:
        """Seconds of ``work``'s device work between two CUDA events (on a CPU, wall)."""
        if not self.gpu:
            return self.timed(work)[0]
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.sync()
        start.record()
        work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    # -- what a round does
    def copy_chunks(self) -> None:
        for i in range(self.setup.chunks):
            self.payload(self.dev_ref, i).copy_(self.payload(self.host_ref, i), non_blocking=True)

    def restore(self) -> None:
        from kvtier.transfer.block_path import scatter

        with self.leased() as lent:
            done = scatter(lent, self.spans, self.cache)
        if done.reason is not None or done.served != len(self.keys):
            raise RuntimeError(f"the restore served {done.served} of {len(self.keys)} chunks: "
                               f"{done.reason}")

    def save(self) -> list[tuple[int, ...]]:
        from kvtier.transfer.block_path import gather

        tokens = self.setup.chunk_tokens
        gathered = gather(self.cache, self.spans, [tokens] * len(self.spans))
        return [gathered.into(i, self.payload(self.host_save, i)) for i in range(len(self.spans))]

    def staging(self) -> float:
        """The leased chunks' stored bytes to the device, one copy each, back to back."""
        with self.leased() as lent:
            return self.phase(lambda: [self.payload(self.dev_ref, i).copy_(c.payload,
                                                                           non_blocking=True)
                                       for i, c in enumerate(lent)])

    def hash(self) -> float:
        """The check launches over the staged bytes; raises where one found a bad layer.
        (The block path's own ``check_ranges``: only it imports the kernels.)"""
        from kvtier.transfer.block_path.device_copies import check_ranges

        seconds = self.phase(lambda: [check_ranges(*args, **kw) for args, kw in self._hash_tables])
        if any(bool(args[-1].any()) for args, _ in self._hash_tables):
            raise RuntimeError("the hash launches found a stored layer whose sum differs")
        return seconds

    def scatter(self) -> float:
        from kvtier.transfer.block_path.device_copies import move_pieces

        return self.phase(lambda: move_pieces(*self._pieces, self.device))

    def round(self, check: bool) -> dict[str, float | None]:
        """Every timing of one round (``check``: and the results checked, off the clock)."""
        row: dict[str, float | None] = {}
        row["h2d_s"] = self.timed(lambda: self.dev_ref.copy_(self.host_ref, non_blocking=True))[0]
        row["h2d_chunks_s"] = self.timed(self.copy_chunks)[0]
        row["restore_s"] = self.timed(self.restore)[0]
        if check:
            check_pool(self.pool, self.dev_ref, self.spans, self.setup.chunk_shape)
        device = self.route == "device"
        row["staging_s"] = self.staging() if device else None
        row["hash_s"] = self.hash() if device else None
        row["scatter_s"] = self.scatter() if device else None
        row["d2h_s"] = self.timed(lambda: self.host_save.copy_(self.dev_ref, non_blocking=True))[0]
        row["save_s"], sums = self.timed(self.save)
        if check:
            check_saved(self.host_save, self.host_ref, sums, self.expected_sums)
        return row


def summarize(rows: list[dict[str, float | None]], total: int, scatter_bytes: int
              ) -> dict[str, Any]:
    """Per-round GB/s and ratios added to ``rows``; their medians (with min and max)."""
    moved = {name: scatter_bytes if name == "scatter" else total for name in TIMED}
    gbps: dict[str, dict[str, float] | None] = {}
    for name in TIMED:
        for r in rows:
            s = r.get(f"{name}_s")
            r[f"{name}_GBps"] = moved[name] / s / 1e9 if s else None
        gbps[name] = _spread([r[f"{name}_GBps"] for r in rows])
    ratios = {}
    for name, (ref, got) in RATIOS.items():
        for r in rows:
            r[name] = r[f"{ref}_s"] / r[f"{got}_s"] if r[f"{ref}_s"] and r[f"{got}_s"] else None
        ratios[name] = _spread([r[name] for r in rows])
    top = {name: None if v is None else v["median"] for name, v in ratios.items()}
    top |= {f"{name}_GBps": None if v is None else v["median"] for name, v in gbps.items()}
    return {**top, "ratios": ratios, "GBps": gbps, "rows": rows}


def _spread(values: list[float | None]) -> dict[str, float] | None:
    got = [v for v in values if v is not None]
    if not got:
        return None
    return {"median": statistics.median(got), "min": min(got), "max": max(got)}


def measure(setup: Setup, device: Any) -> dict[str, Any]:
    from kvtier.transfer.block_path import device_copies

    bench = _Bench(setup, device)
    try:
        bench.round(check=True)  # warm-up: compiles, first touches; the results checked
        rows = []
        for i in range(setup.rounds):
            rows.append({"round": i, **bench.round(check=False)})
        return {
            "route": bench.route,
            "chunk_bytes": bench.chunk_bytes,
            "chunks": setup.chunks,
            "total_bytes": bench.total,
            "window_bytes": device_copies.WINDOW_BYTES,
            "windows": len(bench.window_ranges),
            "scatter_bytes": bench.scatter_bytes,
            "cpu_tier_pinned": bench.tier.pinned,
            "host_pinned": bool(bench.host_ref.is_pinned()) if bench.gpu else False,
            "exact": True,
            **summarize(rows, bench.total, bench.scatter_bytes),
        }
    finally:
        bench.close()


# ------------------------------------------------------------------------------ report
def print_report(payload: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if Console().is_terminal else Console(width=140)
    t = Table(title=f"block path on {payload['device_name']} ({payload['route']} route): "
              f"{payload['chunks']} chunks of {payload['chunk_bytes'] / 2**20:.2f} MiB a round, "
              f"medians of {payload['rounds']} rounds (min..max)", title_justify="left")
    for col in ("what", "GB/s", "min..max", "bytes"):
        t.add_column(col, justify="left" if col == "what" else "right")
    for name in TIMED:
        spread = payload["GBps"].get(name)
        if spread is None:
            continue
        nbytes = payload["scatter_bytes"] if name == "scatter" else payload["total_bytes"]
        t.add_row(name, f"{spread['median']:.2f}", f"{spread['min']:.2f}..{spread['max']:.2f}",
                  f"{nbytes / 2**20:.1f} MiB")
    console.print(t)
    for name, spread in payload["ratios"].items():
        if spread is not None:
            console.print(f"{name}: {spread['median']:.3f} ({spread['min']:.3f}..{spread['max']:.3f})")


def run(args: argparse.Namespace) -> int:
    import torch

    from kvtier.benchmarks.machine import bench_device
    from kvtier.benchmarks.results import write_result
    from kvtier.errors import InvalidArgumentError

    device = bench_device(args.device)
    gpu = device.type == "cuda"
    try:
        layers, heads, dim = (int(x) for x in (args.shape or (GPU_SHAPE if gpu else CPU_SHAPE)).split(","))
    except ValueError as exc:
        raise InvalidArgumentError(f"--shape must be layers,kv_heads,head_dim: {args.shape!r}") from exc
    if min(layers, heads, dim, args.rounds) < 1:
        raise InvalidArgumentError("--shape and --rounds must be positive")
    if args.chunk_tokens < BLOCK or args.chunk_tokens % BLOCK:
        raise InvalidArgumentError(f"--chunk-tokens must be a positive multiple of {BLOCK}")
    if args.device_copies and not gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise InvalidArgumentError("--device-copies on a CPU runs the Triton kernels in the "
                                   "interpreter: set TRITON_INTERPRET=1")
    setup = Setup(layers, heads, dim, args.chunk_tokens, args.dtype, 1, args.rounds,
                  bool(args.device_copies))
    chunk_bytes = setup.chunk_bytes(getattr(torch, args.dtype).itemsize)
    if args.chunks is not None:
        if args.chunks < 1:
            raise InvalidArgumentError("--chunks must be positive")
        chunks = args.chunks
    elif args.gib is not None:
        if args.gib <= 0:
            raise InvalidArgumentError("--gib must be positive")
        chunks = max(1, round(args.gib * 2**30 / chunk_bytes))
    else:
        chunks = max(1, round(GPU_GIB * 2**30 / chunk_bytes)) if gpu else CPU_CHUNKS
    setup = Setup(**{**asdict(setup), "chunks": chunks})
    if gpu:
        _check_room(device, chunks * chunk_bytes)
    payload: dict[str, Any] = {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if gpu else "CPU",
        "shape": {"layers": layers, "kv_heads": heads, "head_dim": dim, "block_size": BLOCK,
                  "chunk_tokens": args.chunk_tokens, "dtype": args.dtype},
        "rounds": args.rounds,
        "timing": "copies, restores and saves: wall clock between device synchronisations; "
                  "staging, hash and scatter: CUDA events on a GPU, wall clock on a CPU",
        **measure(setup, device),
    }
    print_report(payload)
    if args.out:
        print(f"wrote {write_result(args.out, 'block-path', payload)}")
    return 0


def _check_room(device: Any, total: int) -> None:
    """The pool, the reference buffer and the restore's staging must fit the device's free
    memory: a clear error before anything is allocated, not an out-of-memory midway."""
    import torch

    from kvtier.errors import InvalidArgumentError
    from kvtier.transfer.block_path import device_copies

    free, _ = torch.cuda.mem_get_info(device)
    need = 2 * total + 3 * device_copies.WINDOW_BYTES
    if need > 0.9 * free:
        raise InvalidArgumentError(f"--gib asks for {need / 2**30:.1f} GiB of device memory, "
                                   f"{free / 2**30:.1f} GiB are free: lower --gib")
