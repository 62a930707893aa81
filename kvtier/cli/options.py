"""Flags shared by the commands that run an engine or the service, and how they land in
the one config: a flag given on the command line overrides ``--config FILE`` and
``KVTIER_*`` variables; a flag left out leaves the config's value."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from kvtier.chunk_format import DTYPES as KV_DTYPES
from kvtier.config import KVTierConfig, load_config

DTYPES = ["auto", *KV_DTYPES]


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """``--config`` and the engine flags (pool dtype, device and size, CPU threads)."""
    p.add_argument("--config", default=None, metavar="FILE", help="YAML configuration file")
    p.add_argument("--dtype", default=None, choices=DTYPES, help="model and KV dtype (pool.dtype)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto (pool.device)")
    p.add_argument(
        "--kv-memory-mib", type=int, default=None, help="KV pool size (pool.memory_bytes)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (engine.num_threads)")


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *path, last = dotted.split(".")
    node = tree
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value


def config_from_args(args: argparse.Namespace, **extra: Any) -> KVTierConfig:
    """The config with the command's flags on top; ``extra`` maps dotted config names to
    flag values (None: not given)."""
    flags = {
        "pool.dtype": getattr(args, "dtype", None),
        "pool.device": getattr(args, "device", None),
        "engine.num_threads": getattr(args, "threads", None),
        **extra,
    }
    mib = getattr(args, "kv_memory_mib", None)
    overrides: dict[str, Any] = {}
    if mib is not None:
        _set(overrides, "pool.memory_bytes", mib << 20)
        _set(overrides, "pool.num_blocks", None)
    for name, value in flags.items():
        if value is not None:
            _set(overrides, name, value)
    return load_config(getattr(args, "config", None), overrides=overrides)


def log_level(config: KVTierConfig, args: argparse.Namespace | None = None) -> str:
    """The level in effect: ``kvtier -v`` (debug) wins over ``log_level``."""
    return "DEBUG" if args is not None and getattr(args, "verbose", False) else config.log_level


def apply_log_level(config: KVTierConfig, args: argparse.Namespace | None = None) -> None:
    """``log_level`` (or ``-v``) governs kvtier's loggers; ``serve`` passes it to uvicorn."""
    logging.getLogger("kvtier").setLevel(log_level(config, args))
