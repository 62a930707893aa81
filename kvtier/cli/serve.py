"""``kvtier serve``: run the service with uvicorn.

With ``--model DIR`` it is the multi-turn chat backend (engine mode); without, a sidecar that
serves the chunk data plane over its own tiers. Configuration comes from ``--config FILE``
and ``KVTIER_*`` variables (see docs/config.md); flags override them: ``--host`` /
``--port`` / ``--auth-token`` the ``server`` section, ``--dtype`` / ``--device`` /
``--kv-memory-mib`` the pool, ``--threads`` the engine, ``--log-level`` ``log_level``.
"""

from __future__ import annotations

import argparse
import logging

from kvtier.cli.options import add_engine_flags, apply_log_level, config_from_args, log_level

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the kvtier service (HTTP API, metrics; chat with --model)",
        description="Serve the control plane, the chunk data plane and /metrics; with "
        "--model, also OpenAI-compatible /v1/chat/completions on the reference engine.",
        epilog="Every other option comes from --config FILE and KVTIER_* variables: "
        "`kvtier config --help` lists them with their defaults, `kvtier config` shows the "
        "values in effect.",
    )
    p.add_argument("--host", default=None, help="listen address (default server.host)")
    p.add_argument("--port", type=int, default=None, help="listen port (default server.port)")
    p.add_argument("--model", default=None, metavar="DIR", help="model directory: engine mode")
    p.add_argument("--auth-token", default=None, help="bearer token (default server.auth_token)")
    p.add_argument(
        "--allow-unauthenticated", action="store_true",
        help="serve beyond loopback without a bearer token (refused otherwise: anyone who "
        "can reach the port could read and write KV)",
    )
    p.add_argument(
        "--served-model-name", nargs="+", default=None, metavar="NAME",
        help="names /v1/models lists and chat requests may use (default: the model "
        "directory's name; server.served_model_names)",
    )
    add_engine_flags(p)
    p.add_argument(
        "--log-level", default=None, choices=["debug", "info", "warning", "error"],
        help="kvtier's and uvicorn's log level (default log_level)",
    )
    p.set_defaults(func=run)


def serve_config(args: argparse.Namespace):
    """The config with ``kvtier serve``'s flags on top."""
    level = getattr(args, "log_level", None)
    return config_from_args(
        args,
        **{
            "server.host": args.host,
            "server.port": args.port,
            "server.auth_token": args.auth_token,
            "server.served_model_names": getattr(args, "served_model_name", None),
            "log_level": level.upper() if level else None,
        },
    )


def build_state(args: argparse.Namespace, config=None):
    from kvtier.server.state import ServiceState

    config = config if config is not None else serve_config(args)
    apply_log_level(config, args)
    if args.model is None:
        return ServiceState.sidecar(config)
    return ServiceState.with_engine(config, args.model)


def check_exposure(host: str, token: str | None, allowed: bool) -> None:
    """Refuse to listen beyond loopback without a token, unless the user says so."""
    import ipaddress

    from kvtier.errors import ConfigError

    if token or host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = False  # a host name: it may resolve to anything
    if loopback:
        return
    if not allowed:
        raise ConfigError(
            f"kvtier serve would listen on {host} without a bearer token: anyone who can "
            "reach it could read, write and poison KV. Set --auth-token (server.auth_token), "
            "bind to 127.0.0.1, or pass --allow-unauthenticated if the network is yours alone"
        )
    log.warning("kvtier serve listens on %s without a bearer token (--allow-unauthenticated)",
                host)


STARTUP_FAILURE = 3
"""The exit status where the server could not start (the port taken ...), as uvicorn's."""


class _StopSignal(BaseException):
    """SIGTERM or SIGINT reached ``kvtier serve`` (raised by its handler, caught by run)."""


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT, then stop cleanly and exit 0.

    uvicorn catches both signals, drains the requests in flight (at most
    ``server.drain_timeout_s``), then raises the signal again for the handler that was
    there before it, which by default kills the process before ``state.close()`` could run
    (regions left behind, tiers not closed). Ours is there before uvicorn's: it ends the
    serving with :class:`_StopSignal`, and the ``finally`` closes the state. Either
    handler arms a :class:`~kvtier.server.serving.HardStop`: the process is gone
    ``server.stop_timeout_s`` after the signal even where a thread never returns."""
    import signal

    from kvtier.server.app import create_app
    from kvtier.server.descriptors import raise_open_files_limit
    from kvtier.server.serving import HardStop, bounded_server

    config = serve_config(args)
    check_exposure(config.server.host,
                   config.server.auth_token or (config.server.tokens[0].token
                                                if config.server.tokens else None),
                   getattr(args, "allow_unauthenticated", False))
    hard_stop = HardStop(config.server.stop_timeout_s)

    def stop_on_signal(signum: int, _frame) -> None:
        hard_stop.arm()
        raise _StopSignal(signum)

    previous = {sig: signal.signal(sig, stop_on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        raise_open_files_limit(config.server.open_files_limit)
        state = build_state(args, config)
        cfg = state.config.server
        try:
            app = create_app(state)
            log.info(
                "kvtier serve: %s mode on http://%s:%d (tiers: %s; at most %d connections)",
                state.mode,
                cfg.host,
                cfg.port,
                ", ".join(t.name for t in state.manager.tiers) if state.manager else "none",
                app.state.connections.limits.max_connections,
            )
            server = bounded_server(app, cfg, log_level(state.config, args).lower(), hard_stop)
            server.run()
            if not server.started:
                return STARTUP_FAILURE
        finally:
            for sig in previous:  # a second signal must not cut the close short
                signal.signal(sig, signal.SIG_IGN)
            state.close()
            log.info("kvtier serve: stopped (tiers closed, regions removed)")
    except _StopSignal as stop:
        log.info("kvtier serve: stopped by %s", signal.Signals(stop.args[0]).name)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
