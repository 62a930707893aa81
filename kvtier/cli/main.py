"""The ``kvtier`` command: one CLI with subcommands.

Each subcommand lives in the module that owns the work and exposes
``register(subparsers) -> None``; the module is imported only when the CLI is built, and
heavy imports (torch, triton, matplotlib) stay inside the command's run function so
``kvtier --help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from kvtier import __version__
from kvtier.errors import KVTierError

# (module, where) pairs: "top" commands hang off ``kvtier``, "bench" ones off ``kvtier bench``.
COMMANDS: list[tuple[str, str]] = [
    ("kvtier.cli.config", "top"),
    ("kvtier.make_model.writer", "top"),
    ("kvtier.make_model.get_model", "top"),
    ("kvtier.cli.chat", "top"),
    ("kvtier.cli.calibrate", "top"),
    ("kvtier.cli.serve", "top"),
    ("kvtier.cli.chat_demo", "top"),
    ("kvtier.benchmarks.fragmentation.cli", "bench"),
    ("kvtier.benchmarks.allocator", "bench"),
    ("kvtier.benchmarks.kernels", "bench"),
    ("kvtier.benchmarks.engine_throughput", "bench"),
    ("kvtier.benchmarks.tiers", "bench"),
    ("kvtier.benchmarks.peers", "bench"),
    ("kvtier.benchmarks.ttft", "bench"),
    ("kvtier.benchmarks.host_transfer", "bench"),
    ("kvtier.benchmarks.gpu_kit", "bench"),
    ("kvtier.benchmarks.policy_sim.cli", "bench"),
    ("kvtier.benchmarks.policy_sim.hardware", "bench"),
    ("kvtier.benchmarks.service", "bench"),
    ("kvtier.benchmarks.faults", "bench"),
    ("kvtier.benchmarks.vllm_bench", "bench"),
    ("kvtier.benchmarks.codecs", "bench"),
    ("kvtier.benchmarks.connector_transfers", "bench"),
    ("kvtier.benchmarks.block_path", "bench"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="Tiered KV-cache offloading for multi-turn LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    top.required = True
    bench = top.add_parser(
        "bench", help="run a benchmark suite (results go to benchmarks/results/)"
    )
    bench_sub = bench.add_subparsers(dest="bench", metavar="SUITE")
    bench_sub.required = True
    for module_name, where in COMMANDS:
        module = importlib.import_module(module_name)
        module.register(bench_sub if where == "bench" else top)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except KVTierError as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
