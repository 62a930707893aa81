"""``kvtier serve``: run the service with uvicorn.

With ``--model DIR`` it is the multi-turn chat backend (engine mode); without, a sidecar that
serves the chunk data plane over its own tiers. Configuration comes from ``--config FILE``
and ``KVTIER_*`` variables (see docs/config.md); ``--host`` / ``--port`` / ``--auth-token``
override ``server.*``.
"""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the kvtier service (HTTP API, metrics; chat with --model)",
        description="Serve the control plane, the chunk data plane and /metrics; with "
        "--model, also OpenAI-compatible /v1/chat/completions on the reference engine.",
    )
    p.add_argument("--host", default=None, help="listen address (default server.host)")
    p.add_argument("--port", type=int, default=None, help="listen port (default server.port)")
    p.add_argument("--model", default=None, metavar="DIR", help="model directory: engine mode")
    p.add_argument("--config", default=None, metavar="FILE", help="YAML configuration file")
    p.add_argument("--auth-token", default=None, help="bearer token (default server.auth_token)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--kv-memory-mib", type=int, default=256, help="KV pool size (engine mode)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def build_state(args: argparse.Namespace):
    from kvtier.config import load_config
    from kvtier.server.state import ServiceState

    overrides: dict = {}
    server: dict = {}
    if args.host is not None:
        server["host"] = args.host
    if args.port is not None:
        server["port"] = args.port
    if args.auth_token is not None:
        server["auth_token"] = args.auth_token
    if server:
        overrides["server"] = server
    config = load_config(args.config, overrides=overrides)
    if args.model is None:
        return ServiceState.sidecar(config)
    return ServiceState.with_engine(
        config,
        args.model,
        dtype=args.dtype,
        kv_memory_bytes=args.kv_memory_mib << 20,
        num_threads=args.threads,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvtier.server.app import create_app

    state = build_state(args)
    cfg = state.config.server
    try:
        app = create_app(state)
        log.info(
            "kvtier serve: %s mode on http://%s:%d (tiers: %s)",
            state.mode,
            cfg.host,
            cfg.port,
            ", ".join(t.name for t in state.manager.tiers) if state.manager else "none",
        )
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=args.log_level)
    finally:
        state.close()
    return 0
