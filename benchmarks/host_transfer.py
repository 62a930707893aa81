"""``kvtier bench host-transfer``: chunk-sized copies between kvtier's host slots and the
device, against the plain copy of the same sizes measured in the same run.

A restore from the CPU tier is a host-to-device copy out of the tier's arena, a store a
device-to-host copy into a staging slot, both issued on kvtier's side stream. kvtier's slots
are page-aligned anonymous mappings registered with CUDA (:class:`HostBuffer`), not
``cudaHostAlloc`` memory, so whether they move at the pinned speed is a question for the
hardware. The reference is the physical operation: ``copy_`` between a
``pin_memory=True`` tensor and a device tensor, on the current stream. Pageable copies are
shown for scale (what an unpinned slot would cost). Both directions at once share the link:
an H2D and a D2H on two streams, bytes of both counted.

On CUDA: events on the current stream around each call, warm-up, median of repeats. Without
a GPU: the same code with host tensors standing in for the device (memcpy), a smoke run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GPU_SIZES_MIB = (2, 32, 128)
"""A layer of a 256-token Llama-3-8B chunk is 1 MiB and the chunk 32 MiB; 128 MiB is a
1,024-token restore in one copy."""
CPU_SIZES_MIB = (1, 4)
GOAL_VS_COPY = 0.8
"""Issue 29's goal for pinned transfers: kvtier's slots at >= 0.8x the plain pinned copy."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "host-transfer",
        help="host<->device copies of chunk-sized buffers: kvtier's pinned slots vs copy_",
        description="Time H2D, D2H and both at once between kvtier's host slots and the "
        "device, against torch copy_ from pin_memory tensors (and pageable memory) of the "
        "same sizes, in one run.",
    )
    p.add_argument("--sizes-mib", default=None,
                   help=f"comma-separated sizes (default GPU {GPU_SIZES_MIB}, CPU {CPU_SIZES_MIB})")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--out", type=Path, default=None, help="JSON result file")
    p.set_defaults(func=run)


class _Clock:
    """Median milliseconds of a call: CUDA events on the current stream, or perf_counter."""

    def __init__(self, device: Any, repeats: int, warmup: int = 3) -> None:
        import torch

        self.torch, self.device = torch, device
        self.gpu = device.type == "cuda"
        self.repeats, self.warmup = max(1, repeats), warmup

    def __call__(self, fn: Callable[[], None]) -> float:
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        samples = []
        for _ in range(self.repeats):
            if self.gpu:
                torch.cuda.synchronize(self.device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)


class _Copies:
    """The copies of one size: plain (current stream) and kvtier's (side stream, waited on
    by the current stream as the data path does)."""

    def __init__(self, device: Any, nbytes: int) -> None:
        import torch

        from kvtier.connectors.tiers.host_buffers import HostBuffer

        self.torch, self.device, self.nbytes = torch, device, nbytes
        gpu = device.type == "cuda"
        self.dev_a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
        self.dev_b = torch.empty_like(self.dev_a)
        self.pinned_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=gpu).random_(0, 255)
        self.pinned_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=gpu)
        self.pageable = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
        self._slots = [HostBuffer(nbytes), HostBuffer(nbytes)]
        self.slot_a = self._slots[0].tensor[:nbytes]
        self.slot_a.random_(0, 255)
        self.slot_b = self._slots[1].tensor[:nbytes]
        self.slots_pinned = all(s.pinned for s in self._slots)
        if gpu:
            self.h2d_stream = torch.cuda.Stream(device)
            self.d2h_stream = torch.cuda.Stream(device)

    def plain(self, dst: Any, src: Any) -> Callable[[], None]:
        return lambda: dst.copy_(src, non_blocking=True)

    def on_side(self, *pairs: tuple[Any, Any]) -> Callable[[], None]:
        """Each (dst, src) copy on its own side stream, the current stream waiting for all."""
        torch = self.torch
        if self.device.type != "cuda":
            def copy_all() -> None:
                for dst, src in pairs:
                    dst.copy_(src)

            return copy_all
        streams = [self.h2d_stream, self.d2h_stream][: len(pairs)]

        def go() -> None:
            cur = torch.cuda.current_stream(self.device)
            for stream, (dst, src) in zip(streams, pairs, strict=True):
                stream.wait_stream(cur)
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
            for stream in streams:
                cur.wait_stream(stream)

        return go

    def close(self) -> None:
        for s in self._slots:
            s.close()


def measure(device: Any, sizes_mib: list[int], repeats: int) -> list[dict[str, Any]]:
    """One row per size: GB/s of each case and kvtier's ratio to the plain pinned copy."""
    rows = []
    for mib in sizes_mib:
        c = _Copies(device, mib << 20)
        clock = _Clock(device, repeats)
        n = c.nbytes
        ms = {
            "h2d_copy": clock(c.plain(c.dev_b, c.pinned_a)),
            "h2d_kvtier": clock(c.on_side((c.dev_b, c.slot_a))),
            "h2d_pageable": clock(c.plain(c.dev_b, c.pageable)),
            "d2h_copy": clock(c.plain(c.pinned_b, c.dev_a)),
            "d2h_kvtier": clock(c.on_side((c.slot_b, c.dev_a))),
            "d2h_pageable": clock(c.plain(c.pageable, c.dev_a)),
            "both_copy": clock(c.on_side((c.dev_b, c.pinned_a), (c.pinned_b, c.dev_a))),
            "both_kvtier": clock(c.on_side((c.dev_b, c.slot_a), (c.slot_b, c.dev_a))),
        }
        row: dict[str, Any] = {"bytes": n, "slots_pinned": c.slots_pinned}
        for case, t in ms.items():
            moved = 2 * n if case.startswith("both") else n
            row[f"{case}_ms"] = t
            row[f"{case}_GBps"] = moved / (t * 1e-3) / 1e9
        for way in ("h2d", "d2h", "both"):
            row[f"{way}_kvtier_vs_copy"] = row[f"{way}_kvtier_GBps"] / row[f"{way}_copy_GBps"]
        for way in ("h2d", "d2h"):
            row[f"{way}_pageable_vs_copy"] = row[f"{way}_pageable_GBps"] / row[f"{way}_copy_GBps"]
        c.close()
        rows.append(row)
    return rows


def print_report(payload: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if Console().is_terminal else Console(width=140)
    t = Table(title=f"host <-> device copies on {payload['device_name']} (GB/s; x = kvtier "
              "slot / plain pinned copy_, same run)", title_justify="left")
    for col in ("MiB", "H2D copy", "H2D kvtier", "x", "H2D pageable", "D2H copy",
                "D2H kvtier", "x", "both copy", "both kvtier", "x"):
        t.add_column(col, justify="right")
    for r in payload["rows"]:
        t.add_row(str(r["bytes"] >> 20), *(
            f"{r[k]:.2f}" for k in ("h2d_copy_GBps", "h2d_kvtier_GBps", "h2d_kvtier_vs_copy",
                                    "h2d_pageable_GBps", "d2h_copy_GBps", "d2h_kvtier_GBps",
                                    "d2h_kvtier_vs_copy", "both_copy_GBps", "both_kvtier_GBps",
                                    "both_kvtier_vs_copy")))
    console.print(t)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvtier.benchmarks.machine import bench_device
    from kvtier.benchmarks.results import write_result
    from kvtier.errors import InvalidArgumentError

    device = bench_device(args.device)
    gpu = device.type == "cuda"
    if args.sizes_mib:
        try:
            sizes = [int(x) for x in args.sizes_mib.split(",") if x.strip()]
        except ValueError as exc:
            raise InvalidArgumentError(f"--sizes-mib must be integers: {args.sizes_mib!r}") from exc
        if not sizes or min(sizes) <= 0:
            raise InvalidArgumentError("--sizes-mib needs positive sizes")
    else:
        sizes = list(GPU_SIZES_MIB if gpu else CPU_SIZES_MIB)
    repeats = args.repeats or (20 if gpu else 5)
    payload: dict[str, Any] = {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if gpu else "CPU (memcpy smoke run)",
        "timing": {"repeats": repeats, "statistic": "median",
                   "clock": "cuda events" if gpu else "perf_counter"},
        "goal_vs_copy": GOAL_VS_COPY,
        "rows": measure(device, sizes, repeats),
    }
    print_report(payload)
    if args.out:
        print(f"wrote {write_result(args.out, 'host-transfer', payload)}")
    return 0
