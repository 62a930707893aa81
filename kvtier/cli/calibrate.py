"""``kvtier calibrate``: measure this machine's tiers and a model's prefill into a profile.

Tiers: the model's KV is offloaded from the pool to each tier (CPU arena, disk directory,
and Redis when ``--redis-url`` is given) and restored back, end to end as the engine does
it, at several sizes, and ``latency + bytes / bandwidth`` is fitted to each direction.
Prefill: the model runner computes ``new`` tokens after ``cached`` ones over a grid of
lengths off round numbers, and the ``overhead + linear + attention`` model is fitted by
non-negative least squares. The
profile is what the policies and ``kvtier bench policies --simulate`` decide with.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from kvtier.errors import KVTierError


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


def prefill_sizes(top: int, rng: random.Random) -> list[int]:
    """New-token counts to time, from a few tokens up to ``top``: spread over the range and
    jittered off round numbers, because real prompts have arbitrary lengths and a matmul over
    a power-of-two length runs measurably faster than its neighbours (a fit to round sizes
    alone under-predicts real prefills by about 10 % on a CPU)."""
    sizes = {max(8, round(top * f * rng.uniform(0.85, 1.0)))
             for f in (1 / 128, 1 / 32, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 1)}
    return sorted(n for n in sizes if n <= top)


def calibrate_transfer(runner, tier, chunk_tokens: int, repeats: int,
                       n_chunks: int = 8) -> tuple[list, list]:
    """(bytes, seconds) samples of offloading and restoring 1, 4 and ``n_chunks`` chunks
    between the pool and ``tier`` end to end, as the engine does it: gathering blocks and
    encoding chunks on the way out, reading, verifying and scattering on the way back (a
    restore that does not stream). The tier's raw put and get alone under-state what a
    restore costs several times on a CPU, and the policies decide with these numbers."""
    from kvtier.connectors.tiers.manager import TierManager
    from kvtier.transfer.kv_transfer import KVTransfer

    kv = KVTransfer(runner, TierManager([tier], fingerprint=runner.fingerprint), chunk_tokens,
                    stream=False)
    per_token = runner.pool.storage.bytes_per_token
    vocab = min(runner.config.vocab_size, 1000)
    writes, reads = [], []
    for n in sorted({1, min(4, n_chunks), n_chunks}):
        ids = random.Random(n).choices(range(10, vocab), k=n * chunk_tokens)
        keys = [ck.key for ck in kv._keys(ids)]
        runner.add_sequence("__calibrate", ids)  # its blocks hold the chunks' KV
        runner.pool.mark_computed("__calibrate", len(ids))
        runner.free_sequence("__calibrate")

        def save(ids=ids):
            if kv.save(ids).tokens != len(ids):
                raise KVTierError(f"calibration: the {tier.name} tier did not take the chunks")

        def restore(ids=ids):
            if kv.load(ids, stream=False).tokens != len(ids):
                raise KVTierError(f"calibration: the {tier.name} tier lost the chunks")

        save()  # warm-up (first writes allocate)
        kv.evict(ids)
        restore()
        writes.append((n * chunk_tokens * per_token,
                       _median_time(save, repeats, lambda k=keys: tier.delete(k))))
        reads.append((n * chunk_tokens * per_token,
                       _median_time(restore, repeats, lambda ids=ids: kv.evict(ids))))
        tier.delete(keys)
        kv.evict(ids)
    return writes, reads


def _load_runner(args: argparse.Namespace):
    """The model runner to calibrate with, its device and dtype name."""
    import torch

    from kvtier.engine.model_runner import ModelRunner
    from kvtier.gpu_pool.kv_storage import resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    runner = ModelRunner(args.model, dtype=dtype, device=device,
                         memory_bytes=None,
                         num_blocks=(2 * args.max_tokens + 8 * args.chunk_tokens) // 16 + 64,
                         max_model_len=None)
    return runner, device, dtype


MAX_ROUNDS = 4
"""Rounds of transfer samples pooled before calibration gives up on a noisy machine."""


def fastest_per_size(samples: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The quickest (bytes, seconds) sample of each size: another process busy on the
    cores only ever adds time, so the minimum over rounds converges on the transfer's own
    cost where a least-squares fit over every sample follows the interference."""
    best: dict[float, float] = {}
    for nbytes, seconds in samples:
        best[nbytes] = min(seconds, best.get(nbytes, seconds))
    return sorted(best.items())


def calibrate_tiers(runner, args: argparse.Namespace, console, n_chunks: int = 8) -> dict:
    """A fitted ``TierCost`` per tier: CPU, disk (``--disk-dir`` or a temp dir) and Redis
    when ``--redis-url`` is given; every tier is closed (and the temp dir removed) after."""
    from kvtier.chunk_format import kv_payload_bytes, max_chunk_bytes
    from kvtier.connectors.tiers.cpu_tier import CPUTier
    from kvtier.connectors.tiers.disk_tier import DiskTier
    from kvtier.errors import InvalidArgumentError
    from kvtier.policies.cost_model import LinearCost, TierCost

    cfg = runner.config
    elem = runner.pool.storage.kv.element_size()
    slot = max_chunk_bytes(cfg.num_hidden_layers, kv_payload_bytes(
        cfg.num_hidden_layers, args.chunk_tokens, cfg.num_key_value_heads, cfg.head_dim, elem))
    tmp = None
    disk_dir = args.disk_dir
    if disk_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvtier-calibrate-")
        disk_dir = Path(tmp.name)
    tiers = {"cpu": CPUTier(slot * (n_chunks + 1), slot),
             "disk": DiskTier(disk_dir, capacity_bytes=None, fsync=True)}
    if args.redis_url:
        from kvtier.connectors.tiers.redis_tier import RedisTier

        tiers["redis"] = RedisTier(args.redis_url, timeout_s=5.0)
    # Host RAM under a GPU pool is reached over PCIe, whose two directions move at once (a
    # copy engine each way); under a host pool reads and writes share the memory bus. A
    # drive, and a Redis server running one command at a time, are one path.
    on_gpu = runner.pool.storage.kv.device.type == "cuda"
    tier_costs = {}
    try:
        for name, tier in tiers.items():
            writes: list = []
            reads: list = []
            # On a busy machine one round of samples can be too noisy to show the cost
            # growing with size; more rounds pool their samples before giving up.
            for attempt in range(1, MAX_ROUNDS + 1):
                with console.status(f"calibrating the {name} tier (round {attempt})"):
                    w, r = calibrate_transfer(runner, tier, args.chunk_tokens,
                                              args.repeats, n_chunks)
                writes += w
                reads += r
                try:
                    tier_costs[name] = TierCost(name, LinearCost.fit(fastest_per_size(reads)),
                                                LinearCost.fit(fastest_per_size(writes)),
                                                duplex=name == "cpu" and on_gpu)
                    break
                except InvalidArgumentError:
                    if attempt == MAX_ROUNDS:
                        raise
            console.print(f"{name}: read {tier_costs[name].read}, write {tier_costs[name].write}")
    finally:
        for tier in tiers.values():
            tier.close()
        if tmp is not None:
            tmp.cleanup()
    return tier_costs


def calibrate_prefill(runner, device, top: int, repeats: int, console) -> list:
    """(cached, new, seconds) samples of prefilling ``new`` tokens after ``cached`` ones in
    the pool, for ``cached`` 0 and ``top // 2`` and ``new`` from :func:`prefill_sizes`."""
    import torch

    vocab = min(runner.config.vocab_size, 1000)
    samples = []
    gen = torch.Generator().manual_seed(0)
    news = prefill_sizes(top, random.Random(0))
    with console.status("calibrating prefill"):
        counter = iter(range(10**9))
        for cached in (0, top // 2):
            for new in news:
                if cached + new > top:
                    continue
                ids = torch.randint(10, vocab, (cached + new,), generator=gen).tolist()

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
                samples.append((hit, len(ids) - hit, _median_time(step, repeats, prepare)))
    return samples


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvtier.machine import this_machine
    from kvtier.policies.cost_model import CostModel, PrefillCost
    from kvtier.policies.profile import save_profile
    from kvtier.transfer.restore import CPU_STREAM_MIN_TOKENS, CUDA_STREAM_MIN_TOKENS

    console = Console()
    runner, device, dtype = _load_runner(args)
    cfg = runner.config
    top = min(args.max_tokens, runner.max_model_len - 1)
    tier_costs = calibrate_tiers(runner, args, console)
    samples = calibrate_prefill(runner, device, top, args.repeats, console)
    prefill = PrefillCost.fit(samples)
    console.print(f"prefill: {prefill}")
    cost = CostModel(
        model=runner.fingerprint.hex(),
        machine=this_machine(),
        kv_bytes_per_token=runner.pool.storage.bytes_per_token,
        num_layers=cfg.num_hidden_layers,
        prefill=prefill,
        tiers=tier_costs,
        stream_min_tokens=CUDA_STREAM_MIN_TOKENS if device.type == "cuda" else CPU_STREAM_MIN_TOKENS,
    )
    out = args.out or Path(args.model) / "kvtier-profile.json"
    save_profile(out, cost, {
        "model_dir": str(args.model), "dtype": dtype, "device": str(device),
        "chunk_tokens": args.chunk_tokens, "prefill_samples": samples,
    })
    console.print(f"wrote {out}")
    return 0
