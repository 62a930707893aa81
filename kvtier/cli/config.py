"""``kvtier config``: print the effective configuration (defaults, file, environment),
checked as a command that runs would check it; ``--help`` lists every option."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvtier.config import describe_fields

    p = subparsers.add_parser(
        "config",
        help="print the effective configuration as JSON",
        description="Merge defaults, --config FILE and KVTIER_* variables, validate, and print "
        "the result with every default filled in. Options (name = default [variable]):",
        epilog="\n".join(describe_fields()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default=None, metavar="FILE", help="YAML config file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.config import load_config
    from kvtier.connectors.tiers.factory import configured_eviction

    cfg = load_config(args.config)
    for name in ("cpu_eviction", "disk_eviction"):  # names a registry resolves
        configured_eviction(cfg.tiers, name)
    print(json.dumps(cfg.model_dump(), indent=2))
    return 0
