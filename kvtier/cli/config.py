"""``kvtier config``: print the effective configuration (defaults, file, environment)."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "config",
        help="print the effective configuration as JSON",
        description="Merge defaults, --config FILE and KVTIER_* variables, validate, and print.",
    )
    p.add_argument("--config", default=None, metavar="FILE", help="YAML config file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.config import load_config

    cfg = load_config(args.config)
    print(json.dumps(cfg.model_dump(), indent=2))
    return 0
