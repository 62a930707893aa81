"""Who is calling, and what they may do: tenants and scoped tokens.

Every request is made by an :class:`Identity`: a tenant (the namespace its chunks live in)
and scopes. A bearer token names one (``server.tokens``, or ``server.auth_token`` with every
scope in tenant ``default``); without any token configured the service runs open on
loopback and every caller is tenant ``default`` with every scope. Which scope a request
needs follows from its method and path (:func:`required_scope`), so the guard acts before a
route reads a byte of the body.

Namespaces are what make writers unable to poison: a client's chunk ``k`` is stored under
``tenant.k`` (:func:`kvtier.chunk_format.namespaced_key`), so no client can overwrite, read
or pre-seed another tenant's chunks, nor the engine's own (bare keys in no namespace), and
"present" for the engine means written by the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.config import DEFAULT_TENANT, SCOPES, ServerConfig

IDENTITY_KEY = "kvtier.identity"
"""Where the guard leaves the caller's identity in the ASGI scope."""


@dataclass(frozen=True)
class Identity:
    tenant: str
    scopes: frozenset[str]


OPEN_ACCESS = Identity(DEFAULT_TENANT, frozenset(SCOPES))
"""The caller of a service with no token configured (loopback use)."""


def identities(server: ServerConfig) -> dict[bytes, Identity]:
    """Token -> identity, from ``auth_token`` and ``tokens``; empty: no auth."""
    out: dict[bytes, Identity] = {}
    if server.auth_token:
        out[server.auth_token.encode()] = OPEN_ACCESS
    for t in server.tokens:
        out[t.token.encode()] = Identity(t.tenant, frozenset(t.scopes))
    return out


def required_scope(method: str, path: str) -> str | None:
    """The scope a request needs (None: open, e.g. ``/healthz``)."""
    if path == "/healthz":
        return None
    if path.startswith("/v1/regions"):
        return "read"  # a region is memory to move chunks through, no access to any chunk
    if path.startswith("/v1/chunks"):
        reads = method in ("GET", "HEAD") or path in (
            "/v1/chunks/lookup", "/v1/chunks/batch/get", "/v1/chunks/batch/get-into-region",
            "/v1/chunks/prefetch")
        return "read" if reads else "write"
    if path.startswith(("/v1/chat/", "/v1/models")):
        return "chat"
    return "admin"


def tenant_session(tenant: str, session: str) -> str:
    """A caller's session as the service keeps it: in its tenant's namespace (two tenants'
    sessions of one name are two sessions): chunk owners and turns; a chat session of a tenant
    other than the default."""
    return f"{tenant}:{session}"


def identity_of(scope: dict) -> Identity:
    """The caller's identity (set by the guard; open access where no guard runs)."""
    return scope.get(IDENTITY_KEY, OPEN_ACCESS)
