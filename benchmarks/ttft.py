"""``kvtier bench ttft``: time to first token when a session resumes, restore vs recompute.

For each history length, a session's history is computed once; then the TTFT of its next
turn (a short new message) is measured four ways on the reference engine's model runner:
recompute the whole history; KV still in the pool (the floor); restore from each tier
(CPU arena; disk, warm page cache and cold; Redis when a URL is given) then compute only
the new message — once loading every layer first, once streamed (``*_stream``: layer l
computes while layer l+1 loads). Ratios are against recompute, measured in the same run.
Recompute is kvtier's own prefill; torch's fused SDPA prefill of the same model, weights and
tokens (:mod:`sdpa_prefill`) is timed beside it (``sdpa_recompute_s``, ``sdpa_vs_engine``),
so a restore's gain can be read against the faster of the two.
Then the shared-prefix case (:mod:`ttft_shared`): a new session whose long system prompt
another session stored, found by content in each tier.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.kv_codecs import Codec

DEFAULT_HISTORIES = (512, 1024, 2048, 4096)
NEW_TOKENS = 32


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "ttft",
        help="TTFT of resuming a session: restore from each tier vs recompute",
        description="Resume a session with N tokens of history: recompute vs restore from "
        "the CPU arena, disk (warm and cold) and Redis, on the reference engine.",
    )
    p.add_argument("--model", type=Path, default=None, help="model dir (default: --preset)")
    p.add_argument("--preset", default="smollm-135m")
    p.add_argument("--models-dir", type=Path, default=Path("out/models"))
    p.add_argument("--histories", default=",".join(map(str, DEFAULT_HISTORIES)))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--disk-dir", type=Path, default=None, help="default: a temp dir")
    p.add_argument("--redis-url", default=None, help="also measure a Redis tier")
    p.add_argument("--codecs", default="",
                   help="also tiers keeping their chunks encoded (fp8,int8,int4): a disk tier "
                        "per codec, and a Redis tier per codec with --redis-url")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--shared-prefix", type=int, default=1024, metavar="TOKENS",
                   help="also time a new session whose TOKENS-token system prompt another "
                   "session stored, in each tier (0: skip)")
    p.add_argument("--out", type=Path, default=None)
    p.set_defaults(func=run)


def _drop_page_cache(directory: Path) -> None:
    """Evict a directory's files from the page cache (cold reads), without root."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from kvtier.benchmarks.engine_throughput import _ints
    from kvtier.gpu_pool.kv_storage import resolve_device
    from kvtier.make_model.writer import make_model

    histories = _ints(args.histories, "histories")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    model_dir = args.model or args.models_dir / args.preset
    if not (model_dir / "config.json").is_file():
        make_model(args.preset, model_dir, dtype=dtype)
    bench = _Resume.start(model_dir, dtype, device, histories, args)
    console = Console() if Console().is_terminal else Console(width=140)

    config = {"model": str(model_dir), "dtype": dtype, "device": str(device),
              "chunk_tokens": args.chunk_tokens, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "redis": bool(args.redis_url)}
    rows: list[dict[str, Any]] = []
    shared: list[dict[str, Any]] = []
    for h in histories:
        rows.append(bench.measure(h, args.repeats, console))
        _write(args.out, config, rows, args.shared_prefix, shared)  # a cut run keeps its rows
    _print_table(console, rows, f"{model_dir.name} {dtype} on {device}")
    bench.close()
    if args.shared_prefix:
        from kvtier.benchmarks.ttft_shared import measure_shared_prefix, print_shared_table

        with console.status(f"shared prefix of {args.shared_prefix} tokens: timing"):
            shared = measure_shared_prefix(
                model_dir, dtype, str(device), args.shared_prefix, args.chunk_tokens,
                args.repeats, bench.disk_dir, args.redis_url, args.threads,
            )
        print_shared_table(console, shared, f"{model_dir.name} {dtype} on {device}")
    _write(args.out, config, rows, args.shared_prefix, shared, console)
    if args.disk_dir is None:
        shutil.rmtree(bench.disk_dir, ignore_errors=True)
    return 0


def _write(out: Path | None, config: dict[str, Any], rows: list[dict[str, Any]],
           prefix_tokens: int, shared: list[dict[str, Any]], console=None) -> None:
    if out is None:
        return
    from kvtier.benchmarks.results import write_result

    path = write_result(out, "ttft", {
        "config": config,
        "rows": rows,
        "shared_prefix": {"prefix_tokens": prefix_tokens, "rows": shared},
    })
    if console is not None:
        console.print(f"wrote {path}")


class _Resume:
    """A model runner, a KVTransfer per tier, and the TTFT of a resumed turn on them."""

    def __init__(self, runner, device, tiers: dict[str, Any], xfers: dict[str, Any],
                 disk_dir: Path) -> None:
        import torch

        from kvtier.benchmarks.sdpa_prefill import SDPAPrefill

        self.runner = runner
        self.sdpa = SDPAPrefill.from_model(runner.model)  # the runner's tensors, no copy
        self.device = device
        self.tiers = tiers
        self.xfers = xfers
        self.disk_dir = disk_dir
        self.gen = torch.Generator().manual_seed(0)
        self.vocab = min(runner.config.vocab_size, 1000)
        self.counter = iter(range(10**9))

    @classmethod
    def start(cls, model_dir: Path, dtype: str, device, histories: list[int],
              args: argparse.Namespace) -> _Resume:
        """A runner sized for the longest history, a CPU arena that holds it, a disk tier
        (in --disk-dir or a temp dir) and a Redis tier when --redis-url is given."""
        from kvtier.chunk_format import kv_payload_bytes, max_chunk_bytes
        from kvtier.connectors.tiers.cpu_tier import CPUTier
        from kvtier.connectors.tiers.disk_tier import DiskTier
        from kvtier.connectors.tiers.manager import TierManager
        from kvtier.engine.model_runner import ModelRunner
        from kvtier.kv_codecs import Codec
        from kvtier.transfer.kv_transfer import KVTransfer

        longest = max(histories) + NEW_TOKENS + 16
        runner = ModelRunner(model_dir, dtype=dtype, device=device,
                             num_blocks=2 * (longest // 16) + 64, max_model_len=longest)
        cfg = runner.config
        slot = max_chunk_bytes(cfg.num_hidden_layers, kv_payload_bytes(
            cfg.num_hidden_layers, args.chunk_tokens, cfg.num_key_value_heads, cfg.head_dim,
            runner.pool.storage.kv.element_size()))
        arena = slot * (max(histories) // args.chunk_tokens + 2)
        disk_dir = args.disk_dir or Path(tempfile.mkdtemp(prefix="kvtier-ttft-"))
        tiers: dict[str, Any] = {
            "cpu": CPUTier(arena, slot),
            "disk": DiskTier(disk_dir, capacity_bytes=None, fsync=True),
        }
        if args.redis_url:
            from kvtier.connectors.tiers.redis_tier import RedisTier

            tiers["redis"] = RedisTier(args.redis_url, timeout_s=5.0)
        for codec in _codecs(args.codecs):  # the same media, chunks kept encoded
            tiers[f"disk-{codec.value}"] = DiskTier(disk_dir / codec.value, capacity_bytes=None,
                                                    fsync=True)
            if args.redis_url:
                tiers[f"redis-{codec.value}"] = RedisTier(args.redis_url, timeout_s=5.0,
                                                          prefix=f"kvtier-{codec.value}:")
        for name, tier in tiers.items():
            if "-" in name:
                tier.codec = Codec.parse(name.split("-", 1)[1])
        xfers = {name: KVTransfer(runner, TierManager([t], fingerprint=runner.fingerprint,
                                                      promote_on_hit=False), args.chunk_tokens)
                 for name, t in tiers.items()}
        return cls(runner, device, tiers, xfers, disk_dir)

    def close(self) -> None:
        for x in self.xfers.values():
            x.close()
        for tier in self.tiers.values():
            tier.close()

    def ttft(self, prompt: list[int], prepare) -> float:
        """Seconds from the turn's arrival to its first token's logits."""
        from kvtier.benchmarks.engine_throughput import _sync

        runner = self.runner
        prepare()
        _sync(self.device)
        t0 = time.perf_counter()
        restore = getattr(prepare, "restore", None)
        if restore is not None:
            restore()
        sid = f"t{next(self.counter)}"
        added = runner.add_sequence(sid, prompt)
        runner.run([(sid, max(len(prompt) - added.num_cached_tokens, 1))])
        _sync(self.device)
        elapsed = time.perf_counter() - t0
        runner.free_sequence(sid)
        runner.reap_layer_loads(wait=True)  # a streamed restore is over once the run is
        return elapsed

    def measure(self, h: int, repeats: int, console) -> dict[str, Any]:
        """One row: the median TTFT of every case for a history of ``h`` tokens."""
        import torch

        history = torch.randint(10, self.vocab, (h,), generator=self.gen).tolist()
        prompt = history + torch.randint(10, self.vocab, (NEW_TOKENS,),
                                         generator=self.gen).tolist()
        with console.status(f"history {h}: computing it once and storing it in every tier"):
            sid = f"h{next(self.counter)}"
            self.runner.add_sequence(sid, history)
            self.runner.run([(sid, h)])
            self.runner.free_sequence(sid)
            stored = {name: x.save(history).tokens for name, x in self.xfers.items()}
        cases = self.cases(h, history, stored)
        row: dict[str, Any] = {"history_tokens": h, "new_tokens": NEW_TOKENS,
                               "stored_tokens": stored}
        with console.status(f"history {h}: timing"):
            # Warm the pool state once: the first pool_hit needs the history computed.
            for name, prep in cases.items():
                if name == "pool_hit":
                    self.xfers["cpu"].load(history)
                self.ttft(prompt, prep)  # warm-up
                samples = [self.ttft(prompt, prep) for _ in range(repeats)]
                row[f"{name}_s"] = statistics.median(samples)
            self.sdpa_recompute(row, prompt, repeats)
        for name in cases:
            row[f"{name}_vs_recompute"] = row[f"{name}_s"] / row["recompute_s"]
        self.restore_costs(row, cases, stored, repeats)
        return row

    def sdpa_recompute(self, row: dict[str, Any], prompt: list[int], repeats: int) -> None:
        """The reference recompute: torch SDPA's prefill of the same prompt to its first
        token's logits, timed as :meth:`ttft` is (synced, warm-up, median), from the token
        list on; ``sdpa_vs_engine`` < 1 means torch alone is faster than kvtier's prefill.
        ``sdpa_gqa`` says how its attention met the grouped K/V heads."""
        from kvtier.benchmarks.engine_throughput import _median_s

        row["sdpa_recompute_s"] = _median_s(lambda: self.sdpa.last_logits(prompt), repeats,
                                            self.device)
        row["sdpa_vs_engine"] = row["sdpa_recompute_s"] / row["recompute_s"]
        row["sdpa_gqa"] = self.sdpa.gqa

    def restore_costs(self, row: dict[str, Any], cases, stored: dict[str, int], repeats: int) -> None:
        """What each restore costs over a pool hit (``<case>_restore_overhead_s``), the
        KV bytes it brought back (``restored_bytes``), its effective GB/s, and the
        reference measured in this run (``copy_GBps``, ``copy_kind``): the physical move of
        the same bytes into memory that already exists, a host copy on a CPU, a host-to-
        device copy from pinned memory on a GPU."""
        bpt = self.runner.pool.storage.bytes_per_token
        row["restored_bytes"] = {name: n * bpt for name, n in stored.items()}
        row["copy_GBps"], row["copy_kind"] = _copy_gbps(max(stored.values()) * bpt, repeats,
                                                        self.device)
        for name in cases:
            if name in ("recompute", "pool_hit"):
                continue
            over = row[f"{name}_s"] - row["pool_hit_s"]
            nbytes = row["restored_bytes"][name.split("_")[0]]
            row[f"{name}_restore_overhead_s"] = over
            row[f"{name}_GBps"] = nbytes / over / 1e9 if over > 0 else None

    def cases(self, h: int, history: list[int], stored: dict[str, int]) -> dict[str, Any]:
        """Each case's ``prepare()`` (run before the clock starts) with, for restores, a
        ``prepare.restore()`` that runs on the clock: recompute, pool hit, and every tier
        loaded whole and streamed (and disk again with a cold page cache)."""
        any_x = next(iter(self.xfers.values()))
        block_size = self.runner.pool.block_size
        disk_dir = self.disk_dir

        def evict():
            any_x.evict(history)

        def keep():
            if any_x.storable_tokens(history) < h - h % block_size:
                raise RuntimeError("history fell out of the pool")

        cases: dict[str, Any] = {"recompute": evict, "pool_hit": keep}
        for name, x in self.xfers.items():
            for stream in (False, True):
                def prep():
                    evict()

                def restore(x=x, n=stored[name], stream=stream):
                    x.load(history, n, stream=stream)

                prep.restore = restore
                suffix = "_stream" if stream else ""
                cases[name + suffix] = prep
                if name.startswith("disk"):
                    def prep_cold():
                        evict()
                        _drop_page_cache(disk_dir)

                    prep_cold.restore = restore
                    cold = "disk_cold" if name == "disk" else f"{name}_cold"
                    cases[cold + suffix] = prep_cold
        return cases


def _codecs(text: str) -> list[Codec]:
    from kvtier.kv_codecs import Codec

    codecs = [Codec.parse(c.strip()) for c in text.split(",") if c.strip()]
    return [c for c in codecs if c is not Codec.NONE]


def _copy_gbps(nbytes: int, repeats: int, device) -> tuple[float, str]:
    """GB/s of a torch copy of ``nbytes`` into a tensor that already exists (the medium's
    speed for a restore from host memory), median of ``repeats`` after a warm-up: host to
    host on a CPU, pinned host to device on a GPU (the fastest a restore from RAM can go)."""
    import torch

    gpu = device.type == "cuda"
    src = torch.ones(max(nbytes, 1), dtype=torch.uint8, pin_memory=gpu)
    dst = torch.empty_like(src, device=device)
    dst.copy_(src)
    samples = []
    for _ in range(max(repeats, 3)):
        if gpu:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=gpu)
        if gpu:
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - t0)
    return nbytes / statistics.median(samples) / 1e9, ("pinned H2D" if gpu else "host copy")


def _print_table(console, rows: list[dict[str, Any]], what: str) -> None:
    from rich.table import Table

    t = Table(title=f"TTFT of a resumed turn ({NEW_TOKENS} new tokens): {what}",
              title_justify="left")
    names = [k[:-2] for k in rows[0] if k.endswith("_s") and f"{k[:-2]}_vs_recompute" in rows[0]]
    t.add_column("history", justify="right")
    t.add_column("torch SDPA recompute ms (x)", justify="right")
    for n in names:
        t.add_column(f"{n} ms (x)", justify="right")
    for r in rows:
        t.add_row(str(r["history_tokens"]),
                  f"{r['sdpa_recompute_s'] * 1e3:.1f} ({r['sdpa_vs_engine']:.2f})", *(
            f"{r[f'{n}_s'] * 1e3:.1f} ({r[f'{n}_vs_recompute']:.2f})" for n in names))
    console.print(t)
    console.print("(x) = TTFT / recompute TTFT (kvtier's prefill), lower is better; torch "
                  "SDPA's prefill of the same prompt is the reference")
    cost = Table(title="Restore cost over a pool hit: ms, effective GB/s (x the torch copy "
                 f"of the same bytes into existing memory, {rows[0]['copy_kind']}, this run)",
                 title_justify="left")
    restores = [n for n in names if f"{n}_restore_overhead_s" in rows[0]]
    cost.add_column("history", justify="right")
    cost.add_column("KV bytes", justify="right")
    cost.add_column("copy GB/s", justify="right")
    for n in restores:
        cost.add_column(n, justify="right")
    for r in rows:
        cells = []
        for n in restores:
            gbps = r[f"{n}_GBps"]
            over = r[f"{n}_restore_overhead_s"] * 1e3
            cells.append(f"{over:.1f}, {gbps:.2f} ({gbps / r['copy_GBps']:.2f})" if gbps else f"{over:.1f}, -")
        nbytes = max(r["restored_bytes"].values())
        cost.add_row(str(r["history_tokens"]), f"{nbytes / 1e6:.1f} MB", f"{r['copy_GBps']:.2f}", *cells)
    console.print(cost)
