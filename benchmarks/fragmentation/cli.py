"""``kvtier bench fragmentation``: replay workloads through allocation strategies."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtier.errors import InvalidArgumentError

DEFAULT_WORKLOADS = "uniform-long,mixed-dynamic,short-turnover,rare-long"


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvtier.benchmarks.fragmentation.strategies import STRATEGY_NAMES

    p = subparsers.add_parser(
        "fragmentation",
        help="compare contiguous and paged KV allocation on workloads",
        description=(
            "Replay workloads (four built-in patterns and Mooncake-format traces) through "
            "KV allocation strategies and report utilisation, internal and external "
            "fragmentation, concurrency, rejections and reallocation copies."
        ),
    )
    p.add_argument(
        "--workloads",
        default=DEFAULT_WORKLOADS,
        help=f"comma-separated built-in workloads, or 'none' (default: {DEFAULT_WORKLOADS})",
    )
    p.add_argument(
        "--trace",
        action="append",
        default=[],
        metavar="FILE",
        help="a Mooncake-format JSONL trace to replay as well (repeatable)",
    )
    p.add_argument(
        "--strategies",
        default=",".join(STRATEGY_NAMES),
        help="comma-separated strategies (contiguous-maxlen, contiguous-exact-firstfit, "
        "contiguous-exact-bestfit, paged-N)",
    )
    p.add_argument("--scale", type=float, default=1.0, help="multiply built-in request counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--memory-tokens",
        type=int,
        default=None,
        help="KV memory in token slots for every workload (default: each workload's own)",
    )
    p.add_argument("--ms-per-step", type=float, default=20.0, help="trace time per decode step")
    p.add_argument(
        "--trace-limit", type=int, default=None, help="read only the first N trace requests"
    )
    p.add_argument(
        "--max-wait-steps", type=int, default=4096, help="reject after waiting this long"
    )
    p.add_argument("--out", type=Path, default=None, help="write JSON results here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG plot here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from rich.console import Console

    from kvtier.benchmarks.fragmentation.analysis import analyse
    from kvtier.benchmarks.fragmentation.report import plot, print_tables
    from kvtier.benchmarks.fragmentation.strategies import make_strategy
    from kvtier.benchmarks.fragmentation.workloads import builtin_workload, load_mooncake_trace
    from kvtier.benchmarks.results import write_result

    if args.scale <= 0:
        raise InvalidArgumentError(f"--scale must be > 0, got {args.scale}")
    if args.memory_tokens is not None and args.memory_tokens < 1:
        raise InvalidArgumentError(f"--memory-tokens must be >= 1, got {args.memory_tokens}")
    names = [n.strip() for n in args.workloads.split(",") if n.strip() and n.strip() != "none"]
    workloads = [builtin_workload(n, args.scale, args.seed) for n in names]
    workloads += [
        load_mooncake_trace(t, args.ms_per_step, limit=args.trace_limit) for t in args.trace
    ]
    if not workloads:
        raise InvalidArgumentError("nothing to replay: give --workloads and/or --trace")
    if args.memory_tokens is not None:
        workloads = [replace(w, memory_tokens=args.memory_tokens) for w in workloads]
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for s in strategies:  # fail on a bad name before any replay runs
        make_strategy(s, max(w.memory_tokens for w in workloads))

    console = Console() if Console().is_terminal else Console(width=160)
    with console.status("replaying") as status:
        analyses = analyse(
            workloads,
            strategies,
            args.max_wait_steps,
            progress=lambda w, s: status.update(f"replaying {w} through {s}"),
        )
    print_tables(analyses, console)
    if args.out:
        path = write_result(
            args.out,
            "fragmentation",
            {
                "config": {
                    "workloads": names,
                    "traces": [str(t) for t in args.trace],
                    "strategies": strategies,
                    "scale": args.scale,
                    "seed": args.seed,
                    "ms_per_step": args.ms_per_step,
                    "trace_limit": args.trace_limit,
                    "max_wait_steps": args.max_wait_steps,
                },
                "workloads": [a.as_dict() for a in analyses],
            },
        )
        console.print(f"wrote {path}")
    if args.plot:
        console.print(f"wrote {plot(analyses, args.plot)}")
    return 0
