"""The FastAPI application: routes, guards, error bodies and request metrics together."""

from __future__ import annotations

import os

from fastapi import FastAPI

from kvtier import __version__
from kvtier.config import ServerConfig
from kvtier.server import routes_chat, routes_chunks, routes_control, routes_regions, routes_turns
from kvtier.server.chat_bounds import ChatBounds
from kvtier.server.connection_limits import ConnectionLimits, ConnectionTable
from kvtier.server.descriptors import current_limit
from kvtier.server.errors import install_error_handlers
from kvtier.server.identity import identities
from kvtier.server.metrics import ServiceMetrics
from kvtier.server.middleware import BearerAuth, BodyLimit, ConnectionGate, RequestCounter
from kvtier.server.state import ServiceState

DESCRIPTION = """Tiered KV-cache service. Control plane (sessions, stats, metrics), chunk
data plane (the chunk format of kvtier), and in engine mode an OpenAI-compatible chat
endpoint whose sessions survive idleness by moving their KV down the tiers."""


def inflight_budget(configured: int | None, max_body: int) -> int:
    """Bytes of request bodies the service holds at once: as configured, else an eighth of
    the machine's memory capped at 2 GiB; never below one largest body."""
    if configured is None:
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            ram = 8 << 30
        configured = min(ram // 8, 2 << 30)
    return max(int(configured), max_body)


def connection_table(server: ServerConfig, several_tenants: bool,
                     metrics: ServiceMetrics) -> ConnectionTable:
    """The server's connection bookkeeping: the cap within the descriptor limit as it
    stands (``kvtier serve`` raised it before), a tenant's share where there are several."""
    limit = current_limit()
    cap = limit.connection_cap(server.max_connections, server.reserved_descriptors)
    per_tenant = max(1, int(cap * server.tenant_connection_share)) if several_tenants else None
    table = ConnectionTable(ConnectionLimits(cap, per_tenant, server.request_head_timeout_s),
                            lambda reason: metrics.connections_closed.labels(reason.value).inc())
    metrics.descriptor_limit.set(limit.soft)
    metrics.connection_cap.set(cap)
    metrics.connections_open.set_function(lambda: table.open_count)
    return table


def create_app(state: ServiceState) -> FastAPI:
    """An app serving ``state``; the caller owns ``state`` and closes it after the server."""
    app = FastAPI(title="kvtier", version=__version__, description=DESCRIPTION)
    app.state.kvtier = state
    app.state.chat_bounds = (None if state.engine is None else
                             ChatBounds.of(state.engine.engine, state.config.server.max_chat_chars))
    install_error_handlers(app, state.metrics.count_error)
    app.include_router(routes_control.router)
    app.include_router(routes_chunks.router)
    app.include_router(routes_turns.router)
    app.include_router(routes_regions.router)
    app.include_router(routes_chat.router)

    app.add_middleware(RequestCounter, count=lambda method, route, status:
                       state.metrics.requests.labels(method, route, status).inc())

    server = state.config.server
    # Outermost first to run: auth, then the size limit, then the app.
    budget = inflight_budget(server.max_inflight_bytes, server.max_body_bytes)
    tokens = identities(server)
    # A tenant's share matters where there are tenants to share with.
    app.add_middleware(BodyLimit, limit=server.max_body_bytes, budget=budget,
                       tenant_share=state.tenant_share,
                       body_timeout_s=server.body_timeout_s,
                       idle_timeout_s=server.body_idle_timeout_s)
    # The server's connections, as kvtier serve's protocol reports them (serving.py).
    app.state.connections = connection_table(server, len({i.tenant for i in tokens.values()}) > 1,
                                             state.metrics)
    app.add_middleware(ConnectionGate, table=app.state.connections)
    state.size_budgets(budget)  # uploads copied out of regions and reads count alike
    if tokens:
        app.add_middleware(BearerAuth, tokens=tokens)
    return app
