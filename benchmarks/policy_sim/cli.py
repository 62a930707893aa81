"""``kvtier bench policies``: replay workloads against kvtier's policy and the baselines.

``--simulate`` (default) runs the discrete-event simulator driven by a calibration profile
over every workload x GPU budget x system and prints, per workload and budget, TTFT mean /
p50 / p99, hit rate per tier, bytes moved per tier, prefill tokens saved and peak GPU KV
memory; ``--out`` writes JSON and ``--plot DIR`` TTFT CDFs and memory-over-time plots.
``--real --model DIR`` replays the same workloads (use few ``--sessions``) on the reference
engine with real tiers for the systems the engine can be (recompute-only, vLLM-like,
kvtier), and simulates each replay's as-run workload next to it: the table then shows the
real TTFTs and the simulator's error.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

from kvtier.errors import InvalidArgumentError

BUILTIN_WORKLOADS = ("multiturn", "slow-tiers")
DEFAULT_PROFILE = Path(__file__).resolve().parents[1] / "profiles" / "cpu-smollm-135m.json"


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvtier.benchmarks.policy_sim.systems import DEFAULT_SYSTEMS

    p = subparsers.add_parser(
        "policies",
        help="compare offload/restore/eviction policies on multi-turn workloads",
        description="Replay multi-turn workloads (synthetic, Mooncake JSONL traces, CSV) "
        "against kvtier's policy and baselines (recompute-only, vLLM-like, LMCache-like, "
        "CachedAttention-like, Pensieve-like) for several GPU memory budgets.",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--simulate", action="store_true",
                      help="discrete-event simulation driven by --profile (the default)")
    mode.add_argument("--real", action="store_true",
                      help="replay on the reference engine with real tiers (needs --model; "
                      "the profile should be this model's, from `kvtier calibrate`)")
    p.add_argument("--model", type=Path, default=None, help="model directory for --real")
    p.add_argument("--max-output", type=int, default=8,
                   help="--real: cap on generated reply tokens per turn")
    _workload_args(p)
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help="systems to compare (names or dotted paths to a SystemSpec)")
    p.add_argument("--budgets", default="0.25,0.5,1.0",
                   help="GPU KV budgets as fractions of the workload's live working set")
    p.add_argument("--cpu-frac", type=float, default=0.5, help="CPU tier size / working set")
    p.add_argument("--disk-frac", type=float, default=4.0, help="disk tier size / working set")
    p.add_argument("--profile", default=str(DEFAULT_PROFILE),
                   help="a calibration profile (file from `kvtier calibrate`) or the name of a "
                   "shipped hardware profile (`kvtier bench hardware-profiles` lists them)")
    p.add_argument("--nodes", type=int, default=1,
                   help="serving nodes, each with its GPU pool and CPU/disk tiers, sharing the "
                   "profile's redis tier (a remote store)")
    p.add_argument("--router", default="cache-aware",
                   help="how turns reach nodes: round-robin, session-affinity, cache-aware")
    p.add_argument("--network", choices=("25gbe", "100gbe"), default=None,
                   help="replace the profile's redis tier by a remote store over this link")
    p.add_argument("--sessions", type=int, default=400, help="sessions per synthetic workload")
    p.add_argument("--target-load", type=float, default=0.7,
                   help="stretch arrivals so recompute-only prefill keeps the server this busy "
                   "in the busiest tenth of the turns (the profile's machine is slower or "
                   "faster than the one a trace came from)")
    p.add_argument("--time-scale", type=float, default=None,
                   help="stretch arrival times by this factor instead of --target-load")
    p.add_argument("--codecs", default="",
                   help="tiers that keep KV compressed, e.g. disk=int8,redis=int4: their "
                        "capacity holds more tokens, their transfers move fewer bytes and pay "
                        "this machine's measured encode/decode (docs/tiers.md)")
    p.add_argument("--codec-kv-dtype", default="bfloat16",
                   help="the KV dtype the codecs' ratios are taken against")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write JSON results here")
    p.add_argument("--plot", type=Path, default=None, help="write PNG plots into this directory")
    p.set_defaults(func=run)


def _workload_args(p: argparse.ArgumentParser) -> None:
    """What is replayed: built-in workloads, traces, CSVs, the trace family."""
    p.add_argument("--workloads", default=",".join(BUILTIN_WORKLOADS),
                   help=f"built-in synthetic workloads, comma-separated, or 'none' "
                   f"({', '.join(BUILTIN_WORKLOADS)})")
    p.add_argument("--trace", action="append", default=[], metavar="FILE",
                   help="a Mooncake-format JSONL trace (repeatable)")
    p.add_argument("--csv", action="append", default=[], metavar="FILE",
                   help="a CSV of sessionised turns (see docs/policies.md; repeatable)")
    p.add_argument("--trace-limit", type=int, default=None, help="first N trace requests only")
    p.add_argument("--family", type=int, default=0, metavar="N",
                   help="also N synthetic workloads spanning published trace shapes (turns, "
                        "think times and their tails, message and document lengths, shared "
                        "prompts, arrival rates; Latin hypercube, --seed) and a robustness "
                        "table: kvtier against the best other system on each")


def resolve_profile(text: str) -> Path:
    """A profile path, or the shipped profile of that name (``benchmarks/profiles``)."""
    path = Path(text)
    if path.suffix == ".json" or path.exists():
        return path
    shipped = DEFAULT_PROFILE.parent / f"{text}.json"
    if not shipped.is_file():
        names = sorted(p.stem for p in DEFAULT_PROFILE.parent.glob("*.json"))
        raise InvalidArgumentError(f"no profile {text!r}: give a file, or one of {', '.join(names)}")
    return shipped


def builtin_workload(name: str, sessions: int, seed: int):
    from kvtier.benchmarks.policy_sim.workloads import SyntheticSpec, synthetic

    if name == "multiturn":
        # Long-context chat: a shared 1K-token system prompt, a pasted document in the
        # first turn, several follow-ups: reuse is worth a lot, offloading pays.
        spec = SyntheticSpec(sessions=sessions, system_tokens=1024, first_turn_extra_tokens=1536,
                             turns_mean=5.0, think_median_s=30.0)
        return synthetic(spec, seed, "multiturn")
    if name == "slow-tiers":
        # The same conversations, with tiers far slower than recompute (see run()).
        spec = SyntheticSpec(sessions=sessions, system_tokens=1024, first_turn_extra_tokens=1536,
                             turns_mean=5.0, think_median_s=30.0)
        return synthetic(spec, seed + 1, "slow-tiers")
    raise InvalidArgumentError(f"unknown workload {name!r}; built-in: {', '.join(BUILTIN_WORKLOADS)}")


def with_codecs(cost, spec: str, kv_dtype: str):
    """The profile with ``spec``'s tiers (``tier=codec,...``) keeping their KV compressed:
    the ratio at a 256-token chunk of 128-wide heads, this machine's codec speeds."""
    from kvtier.chunk_format import DTYPES
    from kvtier.connectors.tiers.codec_setup import tier_codec
    from kvtier.kv_codecs import Codec

    codecs = dict(cost.codecs)
    for item in filter(None, (x.strip() for x in spec.split(","))):
        tier, sep, name = item.partition("=")
        if not sep or tier not in cost.tiers:
            raise InvalidArgumentError(f"--codecs {item!r}: give tier=codec with a tier of the "
                                       f"profile ({', '.join(cost.tiers)})")
        codec = Codec.parse(name)
        if kv_dtype not in DTYPES:
            raise InvalidArgumentError(f"--codec-kv-dtype {kv_dtype!r}: one of {sorted(DTYPES)}")
        if codec is not Codec.NONE:
            codecs[tier] = tier_codec(codec, (1, 2, 256, 8, 128), DTYPES[kv_dtype])
    return dataclasses.replace(cost, codecs=codecs)


def slow_tiers(cost):
    """The profile with every tier 1000x slower and 50 ms more latency: a remote store
    behind a congested link, where loading always loses to recompute."""
    from kvtier.policies.cost_model import LinearCost

    def slow(c: LinearCost) -> LinearCost:
        return LinearCost(c.latency_s + 0.05, c.bandwidth_bps / 1000)

    return dataclasses.replace(cost, tiers={
        n: dataclasses.replace(t, read=slow(t.read), write=slow(t.write)) for n, t in cost.tiers.items()
    })


def offered_load(workload, cost) -> float:
    """Recompute-only prefill seconds per second of arrivals in the busiest stretch of a
    tenth of the turns (at least 20): a trace whose load grows, or comes in bursts, must
    not overload the server there, or every system's TTFT is a queue that never drains."""
    turns = workload.turns
    n = len(turns)
    if n < 2:
        return 0.0
    w = min(n, max(20, n // 10))
    work = [0.0]
    for t in turns:
        work.append(work[-1] + cost.prefill.time(0, t.prompt_tokens))
    best = 0.0
    for a in range(n - w + 1):
        span = turns[a + w - 1].arrival_s - turns[a].arrival_s
        best = max(best, (work[a + w] - work[a]) / max(span, 1e-9))
    return best


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidArgumentError(f"--{what} takes comma-separated numbers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise InvalidArgumentError(f"--{what} needs positive numbers, got {text!r}")
    return vals


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvtier.benchmarks.results import write_result
    from kvtier.machine import this_machine
    from kvtier.policies.profile import load_profile

    console = Console()
    if not console.is_terminal:  # a log file: do not squeeze the tables into 80 columns
        console = Console(width=160)
    budgets = _floats(args.budgets, "budgets")
    systems = _systems(args)
    if args.real and args.nodes != 1:
        raise InvalidArgumentError("--real replays on this one machine: --nodes is simulation only")
    if args.real and args.model is None:
        raise InvalidArgumentError("--real needs --model DIR (a checkpoint from `kvtier make-model`)")
    args.profile = resolve_profile(args.profile)
    cost, warnings = load_profile(args.profile, machine=this_machine())
    if args.network:
        from kvtier.benchmarks.policy_sim.hardware import with_network

        cost = with_network(cost, args.network)
    for w in warnings:
        console.print(f"[yellow]warning:[/] {w}")
    cost = with_codecs(cost, args.codecs, args.codec_kv_dtype)
    workloads = _workloads(args)

    results = _replay_all(args, workloads, budgets, systems, cost, console)
    _report(args, results, console)
    robust = robust_adaptive = None
    if args.family:
        from kvtier.benchmarks.policy_sim.family import robustness
        from kvtier.benchmarks.policy_sim.report import print_robustness

        robust = robustness(results)
        print_robustness(console, robust)
        if any(s.adaptive for s in systems):
            robust_adaptive = robustness(results, "kvtier-adaptive")
            print_robustness(console, robust_adaptive)
    if args.out:
        path = write_result(args.out, "policies", {
            "config": {"mode": "real" if args.real else "simulate", "profile": str(args.profile), "budgets": budgets,
                       "systems": [s.name for s in systems], "cpu_frac": args.cpu_frac,
                       "disk_frac": args.disk_frac, "seed": args.seed,
                       "sessions": args.sessions, "target_load": args.target_load,
                       "nodes": args.nodes, "router": args.router, "network": args.network,
                       "codecs": {t: dataclasses.asdict(c) for t, c in cost.codecs.items()},
                       "profile_warnings": warnings},
            "workloads": results,
            **({"robustness": robust} if robust is not None else {}),
            **({"robustness_adaptive": robust_adaptive} if robust_adaptive is not None else {}),
        })
        console.print(f"wrote {path}")
    return 0


def _systems(args: argparse.Namespace) -> list:
    """The --systems specs; with --real, the default list becomes what the engine can be."""
    from kvtier.benchmarks.policy_sim.systems import DEFAULT_SYSTEMS, system

    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    if args.real:
        from kvtier.benchmarks.policy_sim.real import REAL_SYSTEMS

        if args.systems == ",".join(DEFAULT_SYSTEMS):
            names = list(REAL_SYSTEMS)
        if "slow-tiers" in args.workloads.split(","):
            raise InvalidArgumentError("--real replays on this machine's tiers; slow-tiers is "
                                       "simulation only (use --workloads multiturn)")
    return [system(n) for n in names]


def _workloads(args: argparse.Namespace) -> list:
    """The built-in --workloads, then every --trace, then every --csv."""
    from kvtier.benchmarks.policy_sim.workloads import from_csv, mooncake

    workloads = []
    if args.workloads != "none":
        for name in [n.strip() for n in args.workloads.split(",") if n.strip()]:
            workloads.append(builtin_workload(name, args.sessions, args.seed))
    for path in args.trace:
        workloads.append(mooncake(path, limit=args.trace_limit))
    for path in args.csv:
        workloads.append(from_csv(path))
    if args.family < 0:
        raise InvalidArgumentError(f"--family takes a number of members, not {args.family}")
    if args.family:
        from kvtier.benchmarks.policy_sim.family import family

        workloads += family(args.family, args.seed, args.sessions)
    if not workloads:
        raise InvalidArgumentError("nothing to replay: give --workloads, --trace, --csv or --family")
    return workloads


def _replay_all(args: argparse.Namespace, workloads: list, budgets: list[float], systems: list,
                cost, console) -> dict[str, Any]:
    """Every workload x budget x system, simulated (or, with --real, run): results by
    workload name, each with its rows by budget and system."""
    from rich.progress import Progress

    from kvtier.benchmarks.policy_sim.workloads import scale_time

    results: dict[str, Any] = {}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("replaying", total=len(workloads) * len(budgets) * len(systems))
        for wl in workloads:
            wcost = slow_tiers(cost) if wl.name == "slow-tiers" else cost
            load = offered_load(wl, wcost) / args.nodes
            scale = args.time_scale or max(1.0, load / args.target_load)
            wl = scale_time(wl, scale)
            working = wl.peak_live_tokens() * wcost.kv_bytes_per_token
            entry: dict[str, Any] = {
                "turns": len(wl.turns), "sessions": len({t.session for t in wl.turns}),
                "time_scale": scale, "offered_load_recompute": offered_load(wl, wcost) / args.nodes,
                "nodes": args.nodes, "router": args.router,
                "working_set_bytes": working, "reuse_ceiling": wl.reuse_ceiling(),
                "budgets": {},
            }
            if "family_spec" in wl.meta:
                entry["family_spec"] = wl.meta["family_spec"]
            stats = wl.meta.get("session_stats")
            if stats is not None:
                entry["session_stats"] = stats
                console.print(
                    f"{wl.name}: {stats['requests']:,} requests -> {stats['sessions']:,} sessions "
                    f"(turns per session p50 {stats['turns_per_session_p50']}, p90 "
                    f"{stats['turns_per_session_p90']}, max {stats['turns_per_session_max']}); "
                    f"{stats['continuing_fraction']:.0%} of requests continue a session, "
                    f"{stats['shared_prefix_token_fraction']:.0%} of prompt tokens in prefixes "
                    "shared across sessions")
            n = args.nodes  # CPU and disk tiers per node; the redis tier is the cluster's
            tier_bytes = {"cpu": args.cpu_frac * working / n, "disk": args.disk_frac * working / n,
                          "redis": args.disk_frac * working}
            longest = wl.longest_context_tokens() * wcost.kv_bytes_per_token
            entry["longest_context_bytes"] = longest
            entry["gpu_bytes_per_node"] = {f"{b:g}": gpu_bytes_per_node(b, working, n, longest)
                                           for b in budgets}
            for b in budgets:
                gpu_bytes = entry["gpu_bytes_per_node"][f"{b:g}"]
                rows = {}
                for spec in systems:
                    progress.update(task, description=f"{wl.name} budget {b:g} {spec.name}")
                    if args.real:
                        rows[spec.name] = _real_row(args, wl, spec, wcost, gpu_bytes, tier_bytes)
                    else:
                        rows[spec.name] = _sim_row(wl, spec, wcost, gpu_bytes, tier_bytes,
                                                   n, args.router)
                    progress.advance(task)
                entry["budgets"][f"{b:g}"] = rows
            results[wl.name] = entry
    return results


def _sim_row(wl, spec, cost, gpu_bytes: float, tier_bytes: dict[str, float], nodes: int = 1,
             router: str = "cache-aware") -> dict:
    """One system in the simulator (one node, or a cluster of ``nodes`` sharing the redis
    tier; ``gpu_bytes`` per node), with how long the simulation itself took."""
    from kvtier.benchmarks.policy_sim.adaptive import AdaptiveReplay
    from kvtier.benchmarks.policy_sim.cluster import Cluster
    from kvtier.benchmarks.policy_sim.simulator import Simulator

    def make(s):
        if nodes > 1:
            return Cluster(wl, s, cost, gpu_bytes, tier_bytes, nodes, router)
        return Simulator(wl, s, cost, gpu_bytes, tier_bytes)

    t0 = time.perf_counter()
    res = AdaptiveReplay(wl, spec, make).run() if spec.adaptive else make(spec).run()
    secs = time.perf_counter() - t0
    return {**res.summary(), "sim_seconds": secs,
            "sim_turns_per_s": len(wl.turns) / max(secs, 1e-9),
            "timeline": res.timeline,
            "ttft_sorted_s": _thin(sorted(res.ttft_s))}


def _report(args: argparse.Namespace, results: dict[str, Any], console) -> None:
    """The tables, the simulator's error on each --real replay, and --plot's plots."""
    from kvtier.benchmarks.policy_sim.report import plot_results, print_tables

    print_tables(console, results)
    if args.real:
        for wname, entry in results.items():
            for b, rows in entry["budgets"].items():
                for name, row in rows.items():
                    console.print(f"{wname} budget {b} {name}: real mean TTFT "
                                  f"{row['ttft_mean_s']:.3f} s, simulated {row['sim_ttft_mean_s']:.3f} s "
                                  f"({row['sim_error']:+.0%})")
    if args.plot:
        for path in plot_results(results, args.plot):
            console.print(f"wrote {path}")


def gpu_bytes_per_node(budget: float, working_bytes: float, nodes: int, longest_bytes: float) -> float:
    """A node's GPU pool: its share of ``budget`` times the working set, and never less
    than the longest request's context. A serving engine refuses to start with a KV cache
    smaller than one request of its ``max_model_len`` (vLLM does), so a smaller pool is no
    deployment: every system would overflow it on such a request, and a light workload
    spread over many nodes would replay that impossible case on every turn."""
    return max(budget * working_bytes / nodes, longest_bytes)


def _real_row(args, wl, spec, cost, gpu_bytes, tier_bytes) -> dict:
    """One system on the reference engine, and the simulator on the same turns as run."""
    from kvtier.benchmarks.policy_sim.real import replay_real
    from kvtier.benchmarks.policy_sim.simulator import Simulator

    gpu_tokens = int(gpu_bytes / cost.kv_bytes_per_token)
    res, as_run = replay_real(wl, spec, args.model, gpu_tokens, tier_bytes, args.profile,
                              max_output_tokens=args.max_output, seed=args.seed)
    sim = Simulator(as_run, spec, cost, gpu_tokens * cost.kv_bytes_per_token, tier_bytes).run()
    real_mean, sim_mean = res.summary()["ttft_mean_s"], sim.summary()["ttft_mean_s"]
    return {**res.summary(), "mode": "real", "ttft_sorted_s": _thin(sorted(res.ttft_s)),
            "timeline": [], "sim_ttft_mean_s": sim_mean,
            "sim_error": (sim_mean - real_mean) / real_mean if real_mean else math.nan}


def _thin(xs: list[float], n: int = 400) -> list[float]:
    """At most ``n`` evenly spaced quantiles (for CDF plots) of a sorted list."""
    if len(xs) <= n:
        return xs
    return [xs[min(len(xs) - 1, math.floor(i * len(xs) / n))] for i in range(n)] + [xs[-1]]
