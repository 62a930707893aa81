"""``kvtier calibrate``: measure this machine's tiers and a model's prefill into a profile.

Tiers: chunks of the model's real size are put and read back through the tier classes
themselves (CPU arena, disk directory, and Redis when ``--redis-url`` is given) at several
batch sizes, and ``latency + bytes / bandwidth`` is fitted to each direction. Prefill: the
model runner computes ``new`` tokens after ``cached`` ones over a grid, and the
``overhead + linear + attention`` model is fitted by non-negative least squares. The
profile is what the policies and ``kvtier bench policies --simulate`` decide with.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="measure tier and prefill costs for a model on this machine (a profile)",
        description="Measure put/get cost of every tier and the model's prefill cost on this "
        "machine, fit the cost model and write it as a calibration profile (JSON).",
    )
    p.add_argument("--model", type=Path, required=True, help="model directory (HF format)")
    p.add_argument("--out", type=Path, default=None, help="default: <model>/kvtier-profile.json")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--device", default="auto")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--disk-dir", type=Path, default=None, help="default: a temp dir")
    p.add_argument("--redis-url", default=None, help="also calibrate a Redis tier")
    p.add_argument("--max-tokens", type=int, default=2048, help="largest prefill measured")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=run)


def _median_time(fn, repeats: int, before=None) -> float:
    out = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def calibrate_tier(tier, blobs: dict[str, bytes], repeats: int) -> tuple[list, list]:
    """(bytes, seconds) samples of put and get at 1, 4 and all chunks per batch."""
    keys = list(blobs)
    writes, reads = [], []
    for n in sorted({1, min(4, len(keys)), len(keys)}):
        batch = {k: blobs[k] for k in keys[:n]}
        nbytes = sum(len(b) for b in batch.values())
        writes.append((nbytes, _median_time(lambda b=batch: tier.put(b), repeats,
                                            lambda b=batch: tier.delete(list(b)))))
        tier.put(batch)
        reads.append((nbytes, _median_time(lambda b=batch: tier.get(list(b)), repeats)))
        tier.delete(list(batch))
    return writes, reads


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from kvtier.chunk_format import encode_chunk
    from kvtier.chunk_keys import chunk_keys
    from kvtier.connectors.cpu_tier import CPUTier
    from kvtier.connectors.disk_tier import DiskTier
    from kvtier.gpu_pool.kv_storage import resolve_device
    from kvtier.model_runner import ModelRunner
    from kvtier.policies.cost_model import CostModel, LinearCost, PrefillCost, TierCost
    from kvtier.profile import save_profile, this_machine
    from kvtier.tier_factory import chunk_blob_bytes

    console = Console()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    runner = ModelRunner(args.model, dtype=dtype, device=device,
                         memory_bytes=None, num_blocks=2 * args.max_tokens // 16 + 64,
                         max_model_len=None)
    cfg = runner.config
    top = min(args.max_tokens, runner.max_model_len - 1)
    kv = runner.pool.storage
    elem = kv.kv.element_size()
    slot = chunk_blob_bytes(cfg.num_hidden_layers, args.chunk_tokens, cfg.num_key_value_heads,
                            cfg.head_dim, elem)
    n_chunks = 8
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(10, min(cfg.vocab_size, 1000), (n_chunks * args.chunk_tokens,),
                           generator=gen).tolist()
    shape = (cfg.num_hidden_layers, 2, args.chunk_tokens, cfg.num_key_value_heads, cfg.head_dim)
    blobs = {ck.key: encode_chunk(ck.key, runner.fingerprint,
                                  torch.randn(shape, generator=gen).to(kv.kv.dtype))
             for ck in chunk_keys(tokens, args.chunk_tokens, runner.fingerprint)}
    tmp = None
    disk_dir = args.disk_dir
    if disk_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvtier-calibrate-")
        disk_dir = Path(tmp.name)
    tiers = {"cpu": CPUTier(slot * (n_chunks + 1), slot),
             "disk": DiskTier(disk_dir, capacity_bytes=None, fsync=True)}
    if args.redis_url:
        from kvtier.connectors.redis_tier import RedisTier

        tiers["redis"] = RedisTier(args.redis_url, timeout_s=5.0)
    tier_costs = {}
    try:
        for name, tier in tiers.items():
            with console.status(f"calibrating the {name} tier"):
                writes, reads = calibrate_tier(tier, blobs, args.repeats)
            tier_costs[name] = TierCost(name, LinearCost.fit(reads), LinearCost.fit(writes))
            console.print(f"{name}: read {tier_costs[name].read}, write {tier_costs[name].write}")
    finally:
        for tier in tiers.values():
            tier.close()
        if tmp is not None:
            tmp.cleanup()

    samples = []
    news = [n for n in (16, 64, 256, 1024, 2048) if n <= top]
    with console.status("calibrating prefill"):
        counter = iter(range(10**9))
        for cached in (0, top // 2):
            for new in news:
                if cached + new > top:
                    continue
                ids = torch.randint(10, min(cfg.vocab_size, 1000), (cached + new,),
                                    generator=gen).tolist()

                def prepare(ids=ids, cached=cached):
                    """Only the first ``cached`` tokens are in the pool."""
                    runner.pool.block_pool.reset_prefix_cache()
                    if cached:
                        sid = f"w{next(counter)}"
                        runner.add_sequence(sid, ids[:cached])
                        runner.run([(sid, cached)])
                        runner.free_sequence(sid)

                def step(ids=ids):
                    sid = f"p{next(counter)}"
                    added = runner.add_sequence(sid, ids)
                    runner.run([(sid, len(ids) - added.num_cached_tokens)])
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    runner.free_sequence(sid)

                prepare()
                step()  # warm-up
                hit = cached - cached % runner.pool.block_size
                samples.append((hit, len(ids) - hit, _median_time(step, args.repeats, prepare)))
    prefill = PrefillCost.fit(samples)
    console.print(f"prefill: {prefill}")
    cost = CostModel(
        model=runner.fingerprint.hex(),
        machine=this_machine(),
        kv_bytes_per_token=kv.bytes_per_token,
        num_layers=cfg.num_hidden_layers,
        prefill=prefill,
        tiers=tier_costs,
    )
    out = args.out or Path(args.model) / "kvtier-profile.json"
    save_profile(out, cost, {
        "model_dir": str(args.model), "dtype": dtype, "device": str(device),
        "chunk_tokens": args.chunk_tokens, "prefill_samples": samples,
    })
    console.print(f"wrote {out}")
    return 0
